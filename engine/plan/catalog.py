"""What the joined members hold and need, kept as they join and leave: a join is checked in time that
grows with the newcomer's manifest, not with everyone's.

How this works: ``Catalog`` keeps the senders' ``Source``s (``sources.py``), the same that
``index_sources`` would make from the senders joined now, one sender at a time (``Source.hold`` /
``release``). A joining sender is checked tensor by tensor against them: the dtype and full shape of
the holders before it (``ManifestMismatch``), and a non-gatherable shard cut along the same dim as the
others and overlapping none (``BadTiling``); each error names the parameter, the newcomer and a holder
it disagrees with. A joining receiver's tensors are resolved against them (``needs.Resolver``): a
dtype or shape it cannot be given is an error; a receiver of a layout already resolved against
today's senders (every instance's TP rank r after the first) passes as that one did. A name or
rows that no sender holds is an error only once every configured sender has joined: with expert- or
pipeline-parallel trainers each sender holds a part, and the holder may be one still to come (the
first plan waits for everyone and reports whatever is still missing then). A sender that brings a
name no joined sender had has the joined receivers resolved again (they may ask for it with another
dtype or shape): that happens for the first sender, and the first of each pipeline stage, only.
``sync`` brings the catalog in line with the members the caller holds (those gone are released).
Each receiver's layout (``needs.layout_key``: its tensors' names, dtypes, shapes, shards and places)
is numbered as it joins, so a plan resolves one receiver per layout and gives the others its rows.
``lend`` hands a planning thread what the catalog holds now (``Index``: the senders' sources, the
members' manifests, the receivers' layouts), so ``plan`` indexes no sender tensor again; the catalog
then copies a source before a join or a leave changes it (copy on write), so what was lent stays as
it was while the plan reads it. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Mapping, Sequence

from weightsync.wire import Manifest

from ..errors import ManifestMismatch, PlanError
from .links import Participant
from .mapping import Mapping as NameMapping
from .needs import Resolver, layout_key
from .sources import Source


@dataclasses.dataclass(frozen=True)
class Index:
    """What a ``Catalog`` held when it was lent (``Catalog.lend``): the senders' sources (as
    ``sources.index_sources`` makes them from those senders), the members' manifests by rank, and
    each receiver's layout number (receivers of one number resolve alike). Read only: the catalog
    copies what it changes after lending it."""

    sources: Mapping[str, Source]
    senders: Mapping[int, Manifest]
    receivers: Mapping[int, Manifest]
    layouts: Mapping[int, int]

    def indexes(self, senders: Sequence[Participant]) -> bool:
        """Whether ``sources`` is the index of exactly these senders (the same manifest objects)."""
        return len(senders) == len(self.senders) and all(self.senders.get(p.rank) is p.manifest for p in senders)

    def layout_of(self, rank: int, manifest: Manifest) -> "Hashable | None":
        """Receiver ``rank``'s layout number, if ``manifest`` is the one the catalog numbered."""
        return self.layouts.get(rank) if self.receivers.get(rank) is manifest else None


class Catalog:
    """The joined senders' holdings and the joined receivers' manifests, by rank."""

    def __init__(self, mapping: "str | NameMapping" = "identity",
                 transforms: Mapping[tuple[str, str], str] = {}) -> None:
        self.mapping, self.transforms = mapping, transforms
        self.sources: dict[str, Source] = {}
        self.senders: dict[int, Manifest] = {}
        self.receivers: dict[int, Manifest] = {}
        self._resolvers: dict[bool, Resolver] = {}  # absent_ok -> one over today's sources (reset on change)
        self._checked: dict[bool, set[int]] = {}  # absent_ok -> the layouts its resolver found no fault with
        self.resolved = 0  # receiver tensor layouts resolved so far (a receiver of a known layout adds none)
        self.layouts: dict[int, int] = {}  # receiver rank -> its layout's number
        self._layout_ids: dict[tuple, int] = {}  # layout key (``needs.layout_key``) -> its number
        self._layout_keys: dict[int, tuple] = {}  # ... and back (a key no receiver has is forgotten)
        self._next_layout = 0
        self._lent = False  # whether ``sources`` (the dict) is lent: the next change makes a new one
        self._shared: set[str] = set()  # names of sources lent and not copied since: copied before a change
        self.copied = 0  # sources copied because a plan may have been reading them
        # one object per shard key, as ``index_sources`` keeps: sources sharded alike hold the same keys, so
        # comparing their shardings (``Interned.spans``) reads a few thousand keys, not a million
        self._keys: dict[tuple[int, int, int], tuple[int, int, int]] = {}

    def __repr__(self) -> str:
        return (f"<Catalog senders={len(self.senders)} receivers={len(self.receivers)} params={len(self.sources)} "
                f"resolved={self.resolved} layouts={len(self._layout_ids)} copied={self.copied}>")

    def lend(self) -> Index:
        """What the catalog holds now, for a planning thread (``plan(index=...)``): read only; the catalog
        copies each source it lends before it next changes it."""
        self._lent, self._shared = True, set(self.sources)
        return Index(self.sources, dict(self.senders), dict(self.receivers), dict(self.layouts))

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
        ``senders_complete``), then record it; raises a ``PlanError`` (and records nothing). A receiver
        of a layout already checked against today's senders passes as that layout did."""
        key = layout_key(manifest)
        absent_ok = not senders_complete
        if self.senders:
            number = self._layout_ids.get(key)
            if number is None or number not in self._checked.get(absent_ok, ()):
                self._resolve(absent_ok, [(rank, manifest)])
        self._record_receiver(rank, manifest, key)
        if self.senders:
            self._checked.setdefault(absent_ok, set()).add(self.layouts[rank])

    def sync(self, senders: Mapping[int, Manifest], receivers: Mapping[int, Manifest]) -> None:
        """Keep exactly these members: release those gone (or rejoined with another manifest), record
        those missing (unchecked: their caller admitted them)."""
        for rank in [r for r, m in self.senders.items() if senders.get(r) is not m]:
            self._release(rank)
        for rank in [r for r, m in self.receivers.items() if receivers.get(r) is not m]:
            self._forget_receiver(rank)
        for rank, manifest in senders.items():
            if rank not in self.senders:
                self._hold(rank, manifest)
        for rank, manifest in receivers.items():
            if rank not in self.receivers:
                self._record_receiver(rank, manifest, layout_key(manifest))

    def _record_receiver(self, rank: int, manifest: Manifest, key: tuple) -> None:
        number = self._layout_ids.get(key)
        if number is None:
            number = self._layout_ids[key] = self._next_layout
            self._layout_keys[number] = key
            self._next_layout += 1
        self.receivers[rank], self.layouts[rank] = manifest, number

    def _forget_receiver(self, rank: int) -> None:
        del self.receivers[rank]
        number = self.layouts.pop(rank)
        if number not in self.layouts.values():
            del self._layout_ids[self._layout_keys.pop(number)]

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
        lent, keys = self._own(), self._keys
        sources, names = self.sources, len(self.sources)
        for t in manifest.tensors:
            shard = t.shard
            src = sources.get(t.name)
            if src is None:
                full_shape = tuple(t.shape if shard is None else shard.full_shape)
                src = sources[t.name] = Source(t.name, t.dtype, full_shape, rank)
            elif lent and t.name in lent:
                src = self._copy(src)
            key = _key(shard)
            key = None if key is None else keys.setdefault(key, key)
            src.hold(rank, key, t.gatherable)
        self.senders[rank] = manifest
        self._changed(len(sources) != names)

    def _release(self, rank: int) -> None:
        lent = self._own()
        sources, names = self.sources, len(self.sources)
        for t in self.senders.pop(rank).tensors:
            src = sources[t.name]
            if lent and t.name in lent:
                src = self._copy(src)
            src.release(rank, _key(t.shard), t.gatherable)
            if not src.held():
                del sources[t.name]
        self._changed(len(sources) != names)

    def _own(self) -> set[str]:
        """Before a change: if the sources were lent, a dict of the catalog's own (the lent one stays as
        it is; the resolvers over it are dropped); the names of sources still shared with a plan, each
        copied before it changes (``_copy``)."""
        if self._lent:
            self.sources, self._lent = dict(self.sources), False
            self._drop_resolvers(True)
        return self._shared

    def _copy(self, src: Source) -> Source:
        self._shared.discard(src.name)
        self.copied += 1
        out = self.sources[src.name] = src.clone()
        return out

    def _changed(self, names: bool) -> None:
        """The holders changed (and the names, if ``names``). What a resolver that tolerates absence
        raises depends on the names, dtypes and shapes only (who holds which rows decides what is
        absent): it is kept while the names stay; the strict one is not."""
        self._drop_resolvers(names)

    def _drop_resolvers(self, both: bool) -> None:
        """Drop the strict resolver (and the tolerant one too, if ``both``), with the layouts they checked."""
        for absent_ok in (False, True) if both else (False,):
            self._resolvers.pop(absent_ok, None)
            self._checked.pop(absent_ok, None)

    def _resolve(self, absent_ok: bool, receivers) -> None:
        resolver = self._resolvers.get(absent_ok)
        if resolver is None:
            resolver = self._resolvers[absent_ok] = Resolver(self.sources, self.transforms, self.mapping, absent_ok)
        before = len(resolver.templates)
        resolver.tensors(receivers, self._layout_of)  # (resolving is the check: no pieces are made)
        self.resolved += len(resolver.templates) - before
        self._checked.setdefault(absent_ok, set()).update(self.layouts[rank] for rank, m in receivers
                                                           if self.receivers.get(rank) is m)

    def _layout_of(self, rank: int, manifest: Manifest) -> Hashable:
        """A recorded receiver's layout number; one joining now, its own (its layout is resolved anew)."""
        return self.layouts[rank] if self.receivers.get(rank) is manifest else ("joining", rank)


def _key(shard) -> "tuple[int, int, int] | None":
    """A shard as ``Source`` keys it: (dim, start, stop)."""
    return None if shard is None else (shard.dim, shard.start, shard.stop)
