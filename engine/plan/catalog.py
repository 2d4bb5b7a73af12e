"""What the joined members hold and need, kept as they join and leave: a join is checked in time that
grows with the newcomer's manifest, not with everyone's.

How this works: ``Catalog`` keeps the senders' ``Source``s (``sources.py``), the same that
``index_sources`` would make from the senders joined now, one sender at a time (``Source.hold`` /
``release``). A joining sender is checked tensor by tensor against them: the dtype and full shape of
the holders before it (``ManifestMismatch``), and a non-gatherable shard cut along the same dim as the
others and overlapping none (``BadTiling``); each error names the parameter, the newcomer and a holder
it disagrees with. A joining receiver's tensors are resolved against them (``needs.Resolver``;
receivers of one layout share the work): a dtype or shape it cannot be given is an error. A name or
rows that no sender holds is an error only once every configured sender has joined: with expert- or
pipeline-parallel trainers each sender holds a part, and the holder may be one still to come (the
first plan waits for everyone and reports whatever is still missing then). A sender that brings a
name no joined sender had has the joined receivers resolved again (they may ask for it with another
dtype or shape): that happens for the first sender, and the first of each pipeline stage, only.
``sync`` brings the catalog in line with the members the caller holds (those gone are released).
Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Mapping

from weightsync.wire import Manifest

from ..errors import ManifestMismatch, PlanError
from .mapping import Mapping as NameMapping
from .needs import Resolver
from .sources import Source


class Catalog:
    """The joined senders' holdings and the joined receivers' manifests, by rank."""

    def __init__(self, mapping: "str | NameMapping" = "identity",
                 transforms: Mapping[tuple[str, str], str] = {}) -> None:
        self.mapping, self.transforms = mapping, transforms
        self.sources: dict[str, Source] = {}
        self.senders: dict[int, Manifest] = {}
        self.receivers: dict[int, Manifest] = {}
        self._resolvers: dict[bool, Resolver] = {}  # absent_ok -> one over today's sources (reset on change)
        self.resolved = 0  # receiver tensor layouts resolved so far (a receiver of a known layout adds none)

    def __repr__(self) -> str:
        return (f"<Catalog senders={len(self.senders)} receivers={len(self.receivers)} "
                f"params={len(self.sources)} resolved={self.resolved}>")

    def admit_sender(self, rank: int, manifest: Manifest) -> None:
        """Check sender ``rank`` against the senders and receivers joined, then record it; raises a
        ``PlanError`` naming parameter and ranks (and records nothing)."""
        new_names = self._check_sender(rank, manifest)
        self._hold(rank, manifest)
        if new_names and self.receivers:
            try:
                self._resolve(True, self.receivers.items())
            except PlanError as exc:
                self._release(rank)
                raise ManifestMismatch(f"a joined receiver cannot take what sender/{rank} holds: {exc}",
                                       param=exc.param, ranks=[f"sender/{rank}", *exc.ranks]) from exc

    def admit_receiver(self, rank: int, manifest: Manifest, senders_complete: bool) -> None:
        """Check receiver ``rank`` against the joined senders (names and rows no sender holds only when
        ``senders_complete``), then record it; raises a ``PlanError`` (and records nothing)."""
        if self.senders:
            self._resolve(not senders_complete, [(rank, manifest)])
        self.receivers[rank] = manifest

    def sync(self, senders: Mapping[int, Manifest], receivers: Mapping[int, Manifest]) -> None:
        """Keep exactly these members: release those gone (or rejoined with another manifest), record
        those missing (unchecked: their caller admitted them)."""
        for rank in [r for r, m in self.senders.items() if senders.get(r) is not m]:
            self._release(rank)
        for rank in [r for r, m in self.receivers.items() if receivers.get(r) is not m]:
            del self.receivers[rank]
        for rank, manifest in senders.items():
            if rank not in self.senders:
                self._hold(rank, manifest)
        for rank, manifest in receivers.items():
            self.receivers.setdefault(rank, manifest)

    def _check_sender(self, rank: int, manifest: Manifest) -> bool:
        """Raise on the first tensor that disagrees with the holders; whether any name is new."""
        sources, new_names = self.sources, False
        for t in manifest.tensors:
            shard = t.shard
            full_shape = tuple(t.shape if shard is None else shard.full_shape)
            src = sources.get(t.name)
            if src is None:
                new_names = True
                continue
            if src.dtype != t.dtype or src.full_shape != full_shape:
                raise ManifestMismatch(
                    f"senders disagree: {src.dtype}{list(src.full_shape)} vs {t.dtype}{list(full_shape)}",
                    param=t.name, ranks=[f"sender/{src.a_holder()}", f"sender/{rank}"])
            if shard is not None and not t.gatherable:
                problem = src.overlap(rank, _key(shard))
                if problem is not None:
                    raise problem
        return new_names

    def _hold(self, rank: int, manifest: Manifest) -> None:
        sources, names = self.sources, len(self.sources)
        for t in manifest.tensors:
            shard = t.shard
            src = sources.get(t.name)
            if src is None:
                full_shape = tuple(t.shape if shard is None else shard.full_shape)
                src = sources[t.name] = Source(t.name, t.dtype, full_shape, rank)
            src.hold(rank, _key(shard), t.gatherable)
        self.senders[rank] = manifest
        self._changed(len(sources) != names)

    def _release(self, rank: int) -> None:
        sources, names = self.sources, len(self.sources)
        for t in self.senders.pop(rank).tensors:
            src = sources[t.name]
            src.release(rank, _key(t.shard), t.gatherable)
            if not src.held():
                del sources[t.name]
        self._changed(len(sources) != names)

    def _changed(self, names: bool) -> None:
        """The holders changed (and the names, if ``names``). What a resolver that tolerates absence
        raises depends on the names, dtypes and shapes only (who holds which rows decides what is
        absent): it is kept while the names stay; the strict one is not."""
        self._resolvers.pop(False, None)
        if names:
            self._resolvers.clear()

    def _resolve(self, absent_ok: bool, receivers) -> None:
        resolver = self._resolvers.get(absent_ok)
        if resolver is None:
            resolver = self._resolvers[absent_ok] = Resolver(self.sources, self.transforms, self.mapping, absent_ok)
        before = len(resolver.templates)
        resolver.tensors(receivers)  # (resolving is the check: no pieces are made)
        self.resolved += len(resolver.templates) - before


def _key(shard) -> "tuple[int, int, int] | None":
    """A shard as ``Source`` keys it: (dim, start, stop)."""
    return None if shard is None else (shard.dim, shard.start, shard.stop)
