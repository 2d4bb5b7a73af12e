"""``transport="auto"``: every backend that can run here, and the best one chosen per peer.

How this works: ``start`` starts each available child (``cuda_ipc`` where CUDA is, ``uccl`` where an
RDMA NIC is and uccl imports, ``tcp`` always) and advertises all of them in ``TransportInfo.data``
(a MessagePack map kind -> [address, device, data]); ``register`` registers a region with every child
and ships all descriptors (a map kind -> descriptor). ``connect`` picks for each peer: same host and
both have CUDA IPC -> ``cuda_ipc`` (the same GPU included: a device copy); different hosts and both
have UCCL -> ``uccl``; otherwise ``tcp``. Forcing a kind by name (``transport="tcp"``) bypasses this.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import torch

from weightsync.wire import PeerInfo, RegionInfo, TransportInfo

from .. import dataauth
from ..errors import TransportError, TransportUnavailable
from ..transport import SourceCounters, TransportOptions, create_transport

log = logging.getLogger("weightsync")

PREFERENCE = ("cuda_ipc", "uccl", "tcp")


def available_kinds(options: TransportOptions) -> list[str]:
    """The backends this process can start, best first (probing, never aborting)."""
    kinds = []
    if options.device.startswith("cuda") and torch.cuda.is_available():
        kinds.append("cuda_ipc")
        from .uccl import uccl_unavailable_reason

        if uccl_unavailable_reason(options) is None:
            kinds.append("uccl")
    kinds.append("tcp")
    return kinds


def choose(local: dict[str, Any], peer: dict[str, Any], same_host: bool) -> str:
    if same_host and "cuda_ipc" in local and "cuda_ipc" in peer:
        return "cuda_ipc"
    if not same_host and "uccl" in local and "uccl" in peer:
        return "uccl"
    if "tcp" in local and "tcp" in peer:
        return "tcp"
    raise TransportUnavailable(f"no transport in common: ours {sorted(local)}, the peer's {sorted(peer)}")


class AutoTransport:
    kind = "auto"

    def __init__(self, options: TransportOptions = TransportOptions()) -> None:
        self.options = options
        self.children: dict[str, Any] = {}
        self.infos: dict[str, TransportInfo] = {}
        self.host = options.host()
        self.guard = dataauth.DataGuard()  # one for all children: a receiver authorizes and opens once
        self.chosen: dict[int, str] = {}

    def __repr__(self) -> str:
        return f"<AutoTransport children={sorted(self.children)} chosen={self.chosen}>"

    async def start(self, rank: int) -> TransportInfo:
        for kind in available_kinds(self.options):
            try:
                child = create_transport(kind, self.options)
                child.guard = self.guard
                self.infos[kind] = await child.start(rank)
                self.children[kind] = child
            except TransportUnavailable as exc:
                log.info("auto transport: %s unavailable: %s", kind, exc)
        data = msgpack.packb({k: [i.address, i.device, i.data] for k, i in self.infos.items()}, use_bin_type=True)
        return TransportInfo(self.kind, self.host, self.infos["tcp"].address, self.options.device, data)

    def register(self, region_id: int, buffer: torch.Tensor) -> RegionInfo:
        descs = {kind: child.register(region_id, buffer).descriptor for kind, child in self.children.items()}
        size = buffer.numel() * buffer.element_size()
        return RegionInfo(region_id, size, str(buffer.device), msgpack.packb(descs, use_bin_type=True))

    def deregister(self, region_id: int) -> None:
        for child in self.children.values():
            child.deregister(region_id)

    @property
    def stable_regions(self) -> bool:
        return all(getattr(child, "stable_regions", False) for child in self.children.values())

    async def connect(self, peer: PeerInfo, key: bytes = b""):
        name = f"receiver/{peer.rank}"
        if peer.transport.kind != self.kind:
            child = self.children.get(peer.transport.kind)
            if child is None:
                raise TransportUnavailable(f"peer uses {peer.transport.kind!r}, which is not available here "
                                           f"(have {sorted(self.children)})")
            return await child.connect(peer, key)
        try:
            offered = msgpack.unpackb(peer.transport.data, raw=False)
            descs = [msgpack.unpackb(r.descriptor, raw=False) for r in peer.regions]
        except Exception as exc:  # a malformed peer descriptor
            raise TransportError(f"cannot read the peer's auto descriptors: {exc}", peer=name) from exc
        kind = choose(self.children, offered, peer.transport.host == self.host)
        address, device, data = offered[kind]
        info = TransportInfo(kind, peer.transport.host, address, device, data)
        regions = tuple(RegionInfo(r.region_id, r.nbytes, r.device, d[kind]) for r, d in zip(peer.regions, descs))
        self.chosen[peer.rank] = kind
        log.info("auto transport: %s via %s", name, kind)
        return await self.children[kind].connect(PeerInfo(peer.rank, info, regions), key)

    def counters(self, epoch: int) -> dict[int, SourceCounters]:
        out: dict[int, SourceCounters] = {}
        for child in self.children.values():
            out.update(child.counters(epoch))
        return out

    def strays(self, epoch: int) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for child in self.children.values():
            for src, epochs in child.strays(epoch).items():
                out.setdefault(src, []).extend(epochs)
        return out

    def forget_strays(self, epoch: int) -> None:
        for child in self.children.values():
            child.forget_strays(epoch)

    def close_epoch(self, epoch: int) -> None:
        for child in self.children.values():
            child.close_epoch(epoch)

    async def settle(self) -> None:
        for child in self.children.values():
            await child.settle()

    async def await_proofs(self, proofs: dict[int, bytes], timeout_s: float) -> dict[int, str]:
        """Each proof to the child that made its kind (its first bytes name it: ``proof_magic``)."""
        by_magic = {getattr(c, "proof_magic", None): c for c in self.children.values()}
        failed: dict[int, str] = {}
        groups: dict[bytes, dict[int, bytes]] = {}
        for src, proof in proofs.items():
            magic = proof[:4]
            if magic in by_magic:
                groups.setdefault(magic, {})[src] = proof
            else:
                failed[src] = f"a delivery proof of no transport here (kinds {sorted(self.children)})"
        for magic, group in groups.items():
            failed.update(await by_magic[magic].await_proofs(group, timeout_s))
        return failed

    async def close(self) -> None:
        for child in self.children.values():
            await child.close()
