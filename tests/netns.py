"""A cluster of "hosts" on this machine: network namespaces on one bridge, each link shaped with tc.

How this works: ``Cluster(hosts)`` makes, for each host, a network namespace ``<prefix>-<host>`` with
loopback up and one veth pair to a bridge that lives in a switch namespace of its own
(``<prefix>-sw``), so nothing of the machine's own network is touched. Host i gets 198.18.0.(i+1)/24
(198.18.0.0/15 is reserved for benchmarking). Each link is shaped in both directions with an ``htb``
at ``rate`` (default 1 Gbit/s) whose first class carries the control plane (DSCP CS6) ahead of the rest. ``popen(host, argv)`` runs a process inside a host's namespace
(``ip netns exec``); ``cut(host)`` takes its link down (a partition: the host reaches nobody),
``heal(host)`` brings it back, ``shape(host, rate)`` changes its rate, ``drop_port(host, port)`` drops
one TCP port's traffic (htb and a u32 filter: the data plane cut with the control plane up).
``close`` kills the processes it started and deletes every namespace it made; so does a later
``Cluster`` with the same prefix for leftovers of one that crashed (nothing else is touched).
``available()`` says why namespaces cannot be made here (not root, no iproute2), for tests to skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Optional, Sequence

from weightsync.roles.channel import CONTROL_DSCP

SUBNET = "198.18.0"
PREFIX = "wsc"


def available() -> Optional[str]:
    """None where clusters can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _in(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *args], check=check, capture_output=True, text=True)


CONTROL_TOS = CONTROL_DSCP << 2  # the control plane's DSCP in the TOS byte (CS6: 0xc0)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def bits_per_s(rate: str) -> int:
    """``"1gbit"`` -> 10**9 (tc's units, decimal)."""
    for unit in sorted(_UNITS, key=len, reverse=True):
        if rate.endswith(unit) and rate[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(rate[: -len(unit)]) * _UNITS[unit])
    raise ValueError(f"rate {rate!r}: a number and one of {sorted(_UNITS)}")


def _link(ns: str, dev: str, rate: str) -> None:
    """``dev``'s egress at ``rate``: htb 1:1 at the rate; 1:10 (control, by TOS) first, 1:20 the rest
    with a 50 ms queue. Both may take the whole rate when the other is idle."""
    bits = bits_per_s(rate)
    control, rest = max(8, bits // 10), max(8, bits - bits // 10)
    queue = max(64 * 1024, bits // 8 // 20)  # bytes: 50 ms at the rate, 64 KiB at least
    _in(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
    _in(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    _in(ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate)
    _in(ns, "tc", "class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate", f"{control}bit",
        "ceil", rate, "prio", "0")
    _in(ns, "tc", "class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", "rate", f"{rest}bit",
        "ceil", rate, "prio", "1")
    _in(ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:20", "bfifo", "limit", str(queue))
    _in(ns, "tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
        "match", "ip", "tos", hex(CONTROL_TOS), "0xfc", "flowid", "1:10")


def class_bytes(ns: str, dev: str) -> dict[str, int]:
    """Bytes sent per htb class of ``dev`` (``"1:10"`` -> n)."""
    out = _in(ns, "tc", "-s", "class", "show", "dev", dev).stdout.split("\n")
    sent, current = {}, None
    for line in out:
        words = line.split()
        if words[:2] == ["class", "htb"]:
            current = words[2]
        elif words[:1] == ["Sent"] and current is not None:
            sent[current] = int(words[1])
    return sent


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace named ``<prefix>-...`` (an earlier cluster that did not close); the
    veths and the bridge inside them go with them. Returns what was removed."""
    listed = _ip("netns", "list", check=False).stdout.split()
    gone = [ns for ns in listed if ns.startswith(prefix + "-")]
    for ns in gone:
        _ip("netns", "delete", ns, check=False)
    return gone


class Cluster:
    def __init__(self, hosts: Sequence[str], rate: str = "1gbit", prefix: str = PREFIX) -> None:
        self.hosts = list(hosts)
        self.rate = rate
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.procs: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"<Cluster {self.prefix} hosts={self.hosts} rate={self.rate} procs={len(self.procs)}>"

    # --- names ------------------------------------------------------------------------------------

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def _port(self, host: str) -> str:  # the switch's end of the host's link (interface names: 15 bytes)
        return f"{self.prefix}p{self.hosts.index(host)}"

    # --- lifecycle --------------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        remove_leftovers(self.prefix)
        try:
            _ip("netns", "add", self.switch)
            _in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            _in(self.switch, "ip", "link", "set", "br0", "up")
            for host in self.hosts:
                self._link(host)
        except BaseException:
            self.close()
            raise

    def _link(self, host: str) -> None:
        ns, port = self.ns(host), self._port(host)
        _ip("netns", "add", ns)
        _in(ns, "ip", "link", "set", "lo", "up")
        _in(ns, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
        _in(ns, "ip", "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
        _in(ns, "ip", "link", "set", "eth0", "up")
        _in(self.switch, "ip", "link", "set", port, "master", "br0")
        _in(self.switch, "ip", "link", "set", port, "up")
        self.shape(host, self.rate)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        self.procs.clear()
        remove_leftovers(self.prefix)

    # --- processes and faults -----------------------------------------------------------------------

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def shape_loopback(self, host: str, rate: str) -> None:
        """Shape ``host``'s loopback as its link is (control first): processes of one host then talk
        through a link of ``rate`` (one host standing for two, as a benchmark of one link needs)."""
        _link(self.ns(host), "lo", rate)

    def shape(self, host: str, rate: str) -> None:
        """Both directions of the host's link at ``rate``: an htb whose high-priority class takes the
        control plane's packets (DSCP CS6, as weightsync marks them) and whose default class, with a
        queue of 50 ms at the rate, takes the rest. A network that schedules by class does the same."""
        for ns, dev in ((self.ns(host), "eth0"), (self.switch, self._port(host))):
            _link(ns, dev, rate)

    def cut(self, host: str) -> None:
        """Partition ``host``: its link goes down (both ends: nothing in flight gets through)."""
        _in(self.switch, "ip", "link", "set", self._port(host), "down")

    def heal(self, host: str) -> None:
        _in(self.switch, "ip", "link", "set", self._port(host), "up")

    def drop_port(self, host: str, port: int) -> None:
        """Starve TCP ``port`` of ``host`` both ways (8 bit/s: its data plane cut), the rest of its link
        as ``shape`` makes it: a u32 filter sends the port's packets (from it on the host's side, to it
        on the switch's) to a class of 8 bit/s. (This kernel has no tc actions and no nftables:
        classification is what there is.)"""
        for ns, dev, match in ((self.ns(host), "eth0", "sport"), (self.switch, self._port(host), "dport")):
            _link(ns, dev, self.rate)
            _in(ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:30", "htb", "rate", "8bit",
                "ceil", "8bit")
            _in(ns, "tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "2", "u32",
                "match", "ip", match, str(port), "0xffff", "flowid", "1:30")

    def undrop(self, host: str) -> None:
        self.shape(host, self.rate)

    def run(self, host: str, *argv: str) -> subprocess.CompletedProcess:
        return _in(self.ns(host), *argv)
