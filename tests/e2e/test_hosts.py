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
