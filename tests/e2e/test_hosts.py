"""More than one host (bench/cluster.py over tests/netns.py): a controller, two trainer hosts and two
inference hosts, network namespaces on 1 Gbit/s shaped links, TCP with auth on. `make test-hosts`."""

from __future__ import annotations

import subprocess

import pytest

import netns
from children import bench_json

pytestmark = [pytest.mark.slow, pytest.mark.skipif(netns.available() is not None,
                                                   reason=str(netns.available()))]


async def cluster(*argv: str) -> tuple[int, dict]:
    return await bench_json("cluster.py", *argv)


def leftovers() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    return [ns for ns in listed if ns.startswith(netns.PREFIX + "-")]


@pytest.mark.timeout(300)
async def test_two_trainer_hosts_to_two_inference_hosts_bit_exact_over_the_network():
    code, result = await cluster("--cases", "tiny-dense,tiny-dense fp8", "--rounds", "2")
    assert code == 0 and result["bit_exact"], result
    for row in result["rows"]:
        assert row["classes"] == ["NET"] and row["transports"] == ["tcp"], row  # every pair crosses hosts
        assert row["hosts"] == 4  # four distinct host ids, though the namespaces share one hostname
    assert 0.5 < result["stream_gbit_s"] < 1.05  # the raw stream sees the shaped link
    assert leftovers() == []


@pytest.mark.timeout(300)
async def test_an_inference_host_cut_off_and_healed():
    code, result = await cluster("--partition", "--trials", "1", "--faults", "inference", "--model", "tiny-dense",
                                 "--heartbeat", "0.1", "--timeout", "1.0")
    assert (result["half_applied"], result["rollbacks"], result["wrong_blame"]) == (0, 0, 0), result["problems"]
    assert result["resumed_in_time"] == 1 and code == 0, result
    assert leftovers() == []


PING = """
import asyncio, sys, zmq
from weightsync.roles.channel import ControlChannel
async def main(kind, addr, dscp):
    chan = ControlChannel(zmq.ROUTER if kind == "bind" else zmq.DEALER, kind, dscp=int(dscp))
    if kind == "bind":
        chan.bind(addr)
        for _ in range(20):
            ident, body = await chan.sock.recv_multipart()
        await chan.sock.send_multipart([ident, b"done"])
    else:
        chan.connect(addr)
        for _ in range(20):
            await chan.sock.send(b"x" * 512)
        await chan.sock.recv()
    chan.close()
asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dscp", [48, 0])
def test_control_packets_take_the_links_first_class_only_when_marked(dscp):
    """The fixture schedules DSCP CS6 first (``tests/netns.py``); the control channel marks its packets
    with ``control_dscp``: 20 messages from b to a go through the class they are marked for."""
    import sys

    code = PING
    with netns.Cluster(["a", "b"], prefix="wsq") as cluster:
        before = netns.class_bytes(cluster.switch, cluster._port("a"))
        addr = f"tcp://{cluster.address('a')}:5599"
        server = cluster.popen("a", [sys.executable, "-c", code, "bind", addr, str(dscp)])
        client = cluster.popen("b", [sys.executable, "-c", code, "connect", addr, str(dscp)])
        assert server.wait(60) == 0 and client.wait(60) == 0
        after = netns.class_bytes(cluster.switch, cluster._port("a"))
    control = after["1:10"] - before.get("1:10", 0)
    rest = after["1:20"] - before.get("1:20", 0)
    if dscp:
        assert control > 20 * 512 and rest < 20 * 512, (before, after)
    else:
        assert control < 512 and rest > 20 * 512, (before, after)  # (the kernel's own ICMP/IGMP is CS6 too)


TARGET = """
import asyncio, sys
from weightsync.engine.transport import TransportOptions, create_transport
async def main(host):
    dst = create_transport("tcp", TransportOptions(bind_host=host, port=5601))
    await dst.start(1)
    print(dst.address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await dst.close()
asyncio.run(main(sys.argv[1]))
"""

CONNECT = """
import asyncio, sys, time
from weightsync.engine.transport import TransportOptions, create_transport
from weightsync.engine.transports.tcp import PROOF_TAG
from weightsync.wire import PeerInfo, TransportInfo
from weightsync.engine.transports import tcp_connect
made = tcp_connect.make_socket
def make_socket(host, options):  # (each attempt says so: the test heals the link at the 7th)
    print("attempt", flush=True)
    return made(host, options)
async def main(address):
    src = create_transport("tcp", TransportOptions(bind_host="0.0.0.0"))
    await src.start(0)
    peer = PeerInfo(1, TransportInfo("tcp", "h", address, "cpu", PROOF_TAG), ())
    await (await src.connect(peer)).close()  # (the path and the neighbour entries are up)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t0 = time.monotonic()
    tcp_connect.make_socket = make_socket
    conn = await src.connect(peer)
    print(f"{time.monotonic() - t0:.3f} {src.connect_retries}", flush=True)
    await conn.close()
    await src.close()
asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.timeout(120)
async def test_a_connect_begun_during_a_partition_gets_through_within_an_attempt_of_the_heal():
    """A trainer host connects to an inference host whose link is down (its SYNs lost); the link comes
    back as the connect's 7th attempt begins, about 6 s in. This kernel sends a lost SYN again 1, 2, 3
    and 4 s after the first, then backs off exponentially (``tcp_syn_linear_timeouts``; older kernels:
    1, 3, 7 s): alone, the first SYN's next retransmission would come at 10 s, when the connect's
    ``connect_timeout_s`` ends ("no connection within 10.0s" when tried with one attempt). Starting
    again on a fresh socket every ``connect_attempt_s`` (1 s), it is through within about a second of
    the heal."""
    import asyncio
    import sys

    with netns.Cluster(["a", "b"], prefix="wsr") as cluster:
        target = cluster.popen("b", [sys.executable, "-c", TARGET, cluster.address("b")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        address = await asyncio.to_thread(target.stdout.readline)
        client = cluster.popen("a", [sys.executable, "-c", CONNECT, address.strip()],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert (await asyncio.to_thread(client.stdout.readline)).strip() == "ready"
        cluster.cut("b")
        client.stdin.write("go\n")
        client.stdin.flush()
        for _ in range(7):
            assert (await asyncio.to_thread(client.stdout.readline)).strip() == "attempt"
        cluster.heal("b")
        lines = []
        while not lines or lines[-1] == "attempt":
            lines.append((await asyncio.to_thread(client.stdout.readline)).strip())
        seconds, retries = lines[-1].split()
        target.stdin.write("\n")
        target.stdin.flush()
        assert client.wait(30) == 0 and target.wait(30) == 0
    assert 6.0 < float(seconds) < 8.5 and int(retries) >= 6 and len(lines) <= 3, (seconds, retries, lines)
