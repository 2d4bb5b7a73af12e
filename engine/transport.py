"""The transport contract, and a lazy-import registry of backends.

How this works: a ``Transport`` is one worker's data-plane endpoint. The target side (a receiver)
``register`` s whole allocations as numbered regions and ``describe`` s them (an opaque descriptor
that travels in manifests); its agent lands incoming bytes straight into them and keeps per-source
counters. The initiator (a sender) ``connect`` s to a peer from its ``PeerInfo`` and gets a
``Connection``: ``write`` puts a byte range of a local tensor into (region, offset) of the peer and
completes when the source may be reused (optionally ordered after a CUDA event: ``after``); ``fence``
completes only once every earlier write on that connection is visible at the target, and checks the
target's byte counts against ours. Writes carry their round (``epoch``): a target counts per (source,
epoch), because a sender may start writing before the receiver has even seen the round begin, and
drops late writes of rounds it has closed. Everything is awaitable; nothing blocks the event loop.
What else a connection can do it declares in its ``abilities`` (``Abilities``, read by the data path,
never probed): the writes in flight it wants, ``submit`` (``write`` in two halves: queue now, return a
future for the completion) and ``submit_many(rows, epoch)`` with ``batch`` (several rows ``(source,
region, offset, after)`` queued in one call, every row checked before any is queued; a future per row,
possibly one shared by all), compiled tables (``compile``/``replay``), writing in place, and delivery
proofs: ``seal()`` returns a token (bytes) that proves, once the
target sees it fulfilled, delivery of every write issued so far, or ``None`` where it cannot; the
target transport's ``await_proofs({source rank: token}, timeout_s)`` waits for them and returns
{source rank: why not} for those it could not confirm. A proof starts with its transport's four-byte
``proof_magic`` (so ``auto`` hands it to the right child). With them a sender announces its writes
before they complete and the round's control messages overlap the last copies (``weightsync.engine.datapath.pipeline``).

Data-plane authentication (``weightsync.engine.dataauth``): every target transport has a ``guard``; the receiver
``authorize`` s the senders its plan names (their pair keys) and opens the regions writable now. An
initiator's ``connect(peer, key)`` proves its pair key to the target where the transport has a
handshake (tcp, uccl, memory); a connection or write the guard refuses is counted and never applied.

A target whose regions stay the memory they were registered with (whatever tensor owns it later) says
``stable_regions``; a shadow receiver may then commit by exchanging its two buffers' memory.

Backends are imported only when first used (``create_transport``), so ``uccl`` or CUDA never load on
a machine that does not ask for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import ipaddress
import os
import socket
import struct
from typing import Awaitable, Callable, Optional, Protocol, runtime_checkable

import torch

from weightsync.wire import PeerInfo, RegionInfo, TransportInfo

from . import dataauth
from .aio import within
from .errors import ConfigError, TransportError, TransportUnavailable


PEER_COPIES = ("fastest", "kernel", "dma")


@dataclasses.dataclass(frozen=True)
class TransportOptions:
    """Where a transport listens and what it advertises. Loopback unless told otherwise."""

    bind_host: str = "127.0.0.1"
    port: int = 0
    advertise_host: Optional[str] = None  # the address peers connect to (defaults to bind_host)
    host_id: Optional[str] = None  # network locality (default: ``local_host_id()``): same id, same host
    device: str = "cpu"
    uccl_tcp: bool = False  # the caller runs UCCL's tcp mode (UCCL_P2P_TRANSPORT=tcp): no RDMA NIC needed
    busy_poll: bool = False  # poll device completions without napping (WorkerOptions.spin sets it): one busy core
    pitched_kernel: bool = True  # cuda_ipc: a compiled table's pitched rows in one kernel launch (to the same
    #                              GPU; to another as ``peer_copies`` says: engine.cuda.copy_kernel.PitchedKernel);
    #                              False: a cudaMemcpy2DAsync each
    peer_copies: str = "fastest"  # cuda_ipc, rows into another GPU: "kernel" (stores into its mapped memory), "dma"
    #                               (copy engines), "fastest" (both timed on the first rounds, the faster kept per
    #                               link: engine.cuda.fastest)
    kernel_grid: tuple[float, float] = (2.0, 4.0)  # cuda_ipc copy kernels' programs per SM: into the same GPU,
    #                                               into another, where a sender copies into several GPUs; each loops
    #                                               over its pieces, so the colocated copy and the one into
    #                                               another GPU share the SMs and run at once (0: a
    #                                               program per piece, the first kernel fills the GPU; engine.cuda.copy_kernel.grid;
    #                                               measured: bench/diagnostics/copy_overlap.py, docs/TRANSPORTS.md)
    connect_timeout_s: float = 10.0  # an initiator's connect, up to the target's challenge
    connect_attempt_s: float = 1.0  # tcp: a connect not answered this long starts again on a fresh socket (a
    #                                 SYN lost to a partition is otherwise resent on the kernel's backoff:
    #                                 engine.transports.tcp_connect), within ``connect_timeout_s`` in all
    tcp_user_timeout_s: float = 10.0  # TCP_USER_TIMEOUT: a data connection whose sent bytes stay unacknowledged
    #                                   this long fails (a partitioned peer: the round aborts, the next plan reconnects)
    handshake_timeout_s: float = 5.0  # a target closes a connection that has not proven a key by then
    max_unauthenticated: int = 64  # connections waiting to prove a key at once (a newcomer evicts the oldest)
    max_unauthenticated_per_address: int = 16  # of them, from one address

    def __post_init__(self) -> None:
        if not self.connect_attempt_s > 0:
            raise ConfigError("connect_attempt_s", f"must be > 0 seconds, got {self.connect_attempt_s!r}")
        if self.peer_copies not in PEER_COPIES:
            raise ConfigError("peer_copies", f"must be one of {PEER_COPIES}, got {self.peer_copies!r}")
        if (not isinstance(self.kernel_grid, tuple) or len(self.kernel_grid) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in self.kernel_grid)):
            raise ConfigError("kernel_grid", f"must be (same GPU, another GPU) programs per SM, each >= 0, "
                                             f"got {self.kernel_grid!r}")

    def host(self) -> str:
        """The host id this endpoint advertises: ``host_id``, else ``local_host_id()``."""
        return self.host_id or local_host_id()


@functools.lru_cache(maxsize=None)
def local_host_id() -> str:
    """This process's network locality, as processes can observe it: the hostname, the boot (two
    machines of one name differ) and the network namespace (containers or namespaces that share a
    hostname but not a network differ; processes in one namespace of one boot share it). Two endpoints
    of one id may use host-local transports (cuda_ipc, memory) and the planner's host link classes;
    any two others go by the network."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "noboot"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{boot}/{netns}"


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this host only (an empty or wildcard one is not)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass
class SourceCounters:
    """What a target received from one source since the last reset."""

    count: int = 0
    nbytes: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


class EpochCounts:
    """Target side: what each source delivered per round (epoch), and the newest round closed (writes
    of it or of an earlier one are late: dropped, never counted). The transports that observe incoming
    writes (tcp, uccl, memory) keep theirs in one of these."""

    def __init__(self) -> None:
        self._counters: dict[tuple[int, int], SourceCounters] = {}
        self.closed_epoch = -1

    def counters(self, epoch: int) -> dict[int, SourceCounters]:
        return {src: c for (src, e), c in self._counters.items() if e == epoch}

    def strays(self, epoch: int) -> dict[int, list[int]]:
        """Sources whose writes landed under a round other than ``epoch`` that is not closed either:
        source rank -> those epochs. A fence of ``epoch`` fails on any (a write under a future round
        would otherwise be committed as this one). Refused writes are not counted here: they are
        reported at the writer's own fence."""
        out: dict[int, list[int]] = {}
        for (src, e), c in sorted(self._counters.items()):
            if e != epoch and e > self.closed_epoch and c.count:
                out.setdefault(src, []).append(e)
        return out

    def forget_strays(self, epoch: int) -> None:
        """Round ``epoch`` failed on the strays it saw: forget them, so they do not fail the next one too."""
        for src, epochs in self.strays(epoch).items():
            for e in epochs:
                self._counters.pop((src, e), None)

    def close_epoch(self, epoch: int) -> None:
        self.closed_epoch = max(self.closed_epoch, epoch)
        self._counters = {k: c for k, c in self._counters.items() if k[1] > self.closed_epoch}

    def count(self, source: int, epoch: int) -> SourceCounters:
        """The counters of ``source`` for round ``epoch`` (made on first use)."""
        c = self._counters.get((source, epoch))
        if c is None:
            c = self._counters[source, epoch] = SourceCounters()
        return c


@dataclasses.dataclass(frozen=True)
class Abilities:
    """What one connection can do beyond ``write``, ``fence`` and ``close``: declared by its transport
    when the connection is made, read by the data path (never probed). A flag promises the methods
    ``ABILITY_METHODS`` lists for it; ``undeclared``/``unimplemented`` say where a connection and its
    declaration disagree (tests check every transport both ways)."""

    devices: frozenset = frozenset({"cpu"})  # device types whose memory a write reads (others are staged)
    depth: int = 0  # writes it wants in flight (0: the pipeline's default)
    compiles: bool = False  # compile(rows) -> table, replay(table, epoch): a lane's rows in a few host calls
    direct_devices: frozenset = frozenset()  # with compiles: device types a compiled row reads in place
    pitched_rows: bool = False  # with compiles: rows may be pitched (2-D) as well as contiguous
    submits: bool = False  # submit(src, region, offset, epoch, after) -> completion future
    batch: int = 1  # with submits, > 1: submit_many(rows, epoch) takes up to this many rows
    seals: bool = False  # seal() -> a delivery proof the target checks (``Transport.await_proofs``)
    writes_in_place: bool = False  # address(...) and submit_written(...): a transform stores into the target
    delta_auto: bool = False  # delta="auto" sends deltas here: a link slower than encoding (docs/DELTAS.md)

    def promised(self) -> set[str]:
        """The methods these flags promise."""
        flags = {"compiles": self.compiles, "submits": self.submits, "batches": self.submits and self.batch > 1,
                 "seals": self.seals, "writes_in_place": self.writes_in_place}
        return {name for flag, on in flags.items() if on for name in ABILITY_METHODS[flag]}


ABILITY_METHODS: dict[str, tuple[str, ...]] = {
    "compiles": ("compile", "replay"),
    "submits": ("submit",),
    "batches": ("submit_many",),
    "seals": ("seal",),
    "writes_in_place": ("address", "submit_written"),
}


def unimplemented(conn: object) -> list[str]:
    """Methods ``conn.abilities`` promises that ``conn`` lacks."""
    return sorted(name for name in conn.abilities.promised() if not callable(getattr(conn, name, None)))


def undeclared(conn: object) -> list[str]:
    """Ability methods ``conn`` has that its ``abilities`` do not declare (the data path would never use them)."""
    every = {name for names in ABILITY_METHODS.values() for name in names}
    return sorted(name for name in every - conn.abilities.promised() if callable(getattr(conn, name, None)))


@runtime_checkable
class Connection(Protocol):
    peer: str
    abilities: Abilities
    generation: int  # changes when the target's regions move (a compiled table of the old ones is stale)

    async def write(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
                    after: Optional[torch.cuda.Event] = None) -> None:
        """Write the bytes of ``src`` (contiguous) into the peer's region at an offset, for round ``epoch``.

        ``after``: a CUDA event that marks ``src`` complete (a transform still running on a side
        stream). A transport that queues device work orders the write behind it on the device;
        the others wait for it on the host (``wait_after``) before reading ``src``."""

    async def fence(self) -> None:
        """Return once every earlier write is visible at the target; raise if any failed."""

    async def close(self) -> None: ...


async def await_each_proof(proofs: dict[int, bytes], timeout_s: float,
                           waiter: Callable[[bytes], Awaitable[None]]) -> dict[int, str]:
    """A target's ``await_proofs`` over its own ``waiter(proof)`` (an awaitable fulfilled with the
    proof; raising ``ValueError``, ``KeyError``, ``struct.error`` or ``RuntimeError`` for one it cannot
    use): source rank -> why it is not confirmed, for each proof unusable or not fulfilled in time."""
    failed = {}
    for src, proof in sorted(proofs.items()):
        try:
            fulfilled = waiter(proof)
        except (ValueError, KeyError, struct.error, RuntimeError) as exc:
            failed[src] = f"unusable delivery proof ({exc!r})"
            continue
        try:
            await within(fulfilled, timeout_s)
        except asyncio.TimeoutError:
            failed[src] = f"writes not delivered within {timeout_s}s of the fence"
        except TransportError as exc:  # (its connection closed first)
            failed[src] = f"writes not delivered: {exc}"
    return failed


async def wait_after(after: Optional[torch.cuda.Event]) -> None:
    """For transports that read a source from the host side: until ``after`` (if any) has happened."""
    if after is not None:
        from .cuda import cuda_rt

        await cuda_rt.wait_event(after)


@runtime_checkable
class Transport(Protocol):
    kind: str

    async def start(self, rank: int) -> TransportInfo:
        """Open the endpoint (a target also starts its agent); returns how peers reach it."""

    def register(self, region_id: int, buffer: torch.Tensor) -> RegionInfo:
        """Make a whole allocation (1-D uint8 tensor) writable by peers as ``region_id``."""

    def deregister(self, region_id: int) -> None: ...

    guard: dataauth.DataGuard

    async def connect(self, peer: PeerInfo, key: bytes = b"") -> Connection:
        """A connection to ``peer`` that proves ``key`` (the pair key the plan gave us for it)."""

    def counters(self, epoch: int) -> dict[int, SourceCounters]:
        """Target side: what each source rank delivered for round ``epoch`` (empty where the transport
        cannot observe one-sided writes)."""

    async def settle(self) -> None:
        """Target side: make landed bytes visible in the registered buffers (a no-op for most)."""

    def strays(self, epoch: int) -> dict[int, list[int]]:
        """Target side: sources that wrote under an open round other than ``epoch`` (``EpochCounts.strays``)."""

    def forget_strays(self, epoch: int) -> None:
        """Target side: forget the strays a failed fence of ``epoch`` reported."""

    def close_epoch(self, epoch: int) -> None:
        """Target side: round ``epoch`` and every earlier one are over: drop their late writes, forget them."""

    async def close(self) -> None: ...


async def connect_authorized(src: Transport, dst: Transport, peer: PeerInfo) -> Connection:
    """For programs that own both ends (tests, benches): ``dst`` accepts a fresh pair key for ``src``'s
    rank, and ``src`` connects with it."""
    key = dataauth.new_secret()
    dst.guard.authorize({**dst.guard.keys, src.rank: key})
    return await src.connect(peer, key)


BACKENDS: dict[str, str] = {
    "tcp": "weightsync.engine.transports.tcp:TcpTransport",
    "memory": "weightsync.engine.transports.memory:MemoryTransport",
    "cuda_ipc": "weightsync.engine.transports.cuda_ipc:CudaIpcTransport",
    "uccl": "weightsync.engine.transports.uccl:UcclTransport",
    "auto": "weightsync.engine.transports.auto:AutoTransport",
}


def register_backend(kind: str, target: str) -> None:
    """Add a backend as ``module:Class`` (imported on first use)."""
    BACKENDS[kind] = target


def create_transport(kind: str, options: TransportOptions = TransportOptions()) -> Transport:
    try:
        target = BACKENDS[kind]
    except KeyError:
        raise ConfigError("transport", f"unknown transport {kind!r}; known: {', '.join(sorted(BACKENDS))}") from None
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TransportUnavailable(f"transport {kind!r} cannot be imported here: {exc}") from exc
    return getattr(module, cls_name)(options)
