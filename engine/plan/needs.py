"""From manifests to pieces: every (parameter slice, receiver) that must move, and who can supply it.

How this works: ``index_sources`` (``sources.py``) checks that all senders agree on each parameter
(dtype, full shape) and that shards tile cleanly. ``build_pieces`` walks each receiver's manifest (skipping
names the receiver ties to another: one storage moves once), resolves each tensor through the name
mapping into parts (``mapping.py``: fused components, transposes, TP shards, casts, FP8 weight and
scales), and turns each part into one ``Piece`` — or several, when only a combination of dim-0 shards
covers it. ``Resolver`` does that walk (receivers of one layout share it, and tensors alike but for their
names, every layer's q_proj of one TP rank, share it too), resolving each tensor to templates
(``Resolver.tensors``); ``made_pieces`` makes the pieces once the gatherers are designated;
``catalog.py`` uses the walk to check one joining receiver. A piece lists its candidate senders; how a
part is cut along the senders' shards (shard-to-shard, blocks, block-FP8 runs) is ``cuts.py``'s.
Pieces that need a gather (a TP slice along another dim, a transform) may only go to k designated
holders per parameter (``_designate_gatherers``), least-loaded first: k is the larger of what its
bytes to send need (over a fair share of all bytes) and how many full copies of it fit in a fair
share, so a small tensor keeps every holder as a candidate and a large one is gathered a few times,
not by every sender that sends a slice of it.
Every failure is a ``PlanError`` naming the parameter and ranks.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

from collections import defaultdict
from math import prod

from weightsync.wire import Manifest, TensorSpec, dtype_size

from ..errors import UnknownParameter, Unsuppliable
from .links import Participant
from .mapping import FP8, SCALE_SUFFIX, Mapping as NameMapping, SourceShape, components, dtype_transform
from .mapping import get_mapping, parts_for
from .cuts import pieces_for
from .sources import Interned, Piece, Source, index_sources, make_piece

__all__ = ["PlanCache", "Piece", "Resolver", "Source", "build_pieces", "index_sources"]



def build_pieces(
    senders: Sequence[Participant],
    receivers: Sequence[Participant],
    transforms: Mapping[tuple[str, str], str] = {},
    mapping: "str | NameMapping" = "identity",
    cache: "Optional[PlanCache]" = None,
) -> tuple[list[Piece], dict[str, Source]]:
    """``cache``: what the previous plan resolved, reused while the senders are the same."""
    if cache is None:
        resolver = Resolver(index_sources(senders), transforms, mapping)
    else:
        resolver = cache.resolver(senders, transforms, mapping)
    tensors = resolver.tensors((p.rank, p.manifest) for p in receivers)
    narrowed = _designate_gatherers(tensors, resolver.sources, len(senders), resolver.intern)
    return made_pieces(tensors, narrowed), resolver.sources


class PlanCache:
    """What one plan leaves to the next: the senders' index and every receiver tensor layout resolved
    against it (``Resolver``), kept while the senders are the same (rank for rank, the same manifest
    objects or, for a restarted sender, one with the same tensors) and so are the transforms and the
    name mapping. A controller replans when a receiver
    leaves or joins (a restarted inference worker): then the pieces are made from what is kept, and
    only a layout never seen is resolved; or, when the receivers are those of the last plan (restarted
    ones the planner cannot tell apart included), that plan is patched (``planner.patched_plan``).
    Used by one planning thread at a time."""

    def __init__(self) -> None:
        self._senders: list[tuple[int, Manifest]] = []
        self._rules: tuple = ()
        self._resolver: Optional[Resolver] = None
        self.hits = self.misses = 0
        self.last: Optional[tuple] = None  # (receivers, (link, options), senders, routing) (``planner``)
        self.patched = 0  # replans that only patched the last plan's tables (``planner.patched_plan``)

    def __repr__(self) -> str:
        return (f"<PlanCache senders={len(self._senders)} layouts={self.layouts} hits={self.hits} "
                f"misses={self.misses} patched={self.patched}>")

    def same_senders(self, senders: Sequence[Participant], transforms, mapping) -> bool:
        """Whether ``senders`` (and the rules) are those the kept index was made from: the same manifests,
        or a restarted process's with the same tensors (then kept in its place)."""
        if (self._resolver is None or (dict(transforms), mapping) != self._rules
                or len(senders) != len(self._senders)
                or any(p.rank != r for p, (r, _) in zip(senders, self._senders))):
            return False
        changed = [i for i, (p, (_, m)) in enumerate(zip(senders, self._senders)) if p.manifest is not m]
        if any(senders[i].manifest.tensors != self._senders[i][1].tensors for i in changed):
            return False
        for i in changed:  # (the index read only the tensors: it holds for the new process's manifest)
            self._senders[i] = (senders[i].rank, senders[i].manifest)
        return True

    @property
    def layouts(self) -> int:
        """Receiver tensor layouts resolved and kept."""
        return len(self._resolver.templates) if self._resolver is not None else 0

    def resolver(self, senders: Sequence[Participant], transforms, mapping) -> "Resolver":
        if self.same_senders(senders, transforms, mapping):
            self.hits += 1
            return self._resolver
        self.misses += 1
        self._resolver, self.last = None, None  # (a failed index leaves nothing behind)
        self._resolver = Resolver(index_sources(senders), transforms, mapping)
        self._senders, self._rules = [(p.rank, p.manifest) for p in senders], (dict(transforms), mapping)
        return self._resolver


class Resolver:
    """Receivers' tensors resolved against one set of sources, into pieces. A tensor's pieces depend on
    its layout (dtype, shape, shard; for block scales, the weight's) and on its sources, which enter by
    how each is held (``Source.likeness``) and by name: per *kind* of tensor (the mapping rule and its
    sources' likeness, ``_kind``) and layout, the pieces' templates (source slot, rows, bytes, offset
    from the tensor's, row size, transform, candidates) are made once, and each tensor takes them with
    its own sources' names. So receivers with the same layout share them, and so do tensors alike but
    for their names: every layer's q_proj of one TP rank, or every layer's slice of one EP rank's
    experts, is resolved once. A name whose sources are missing or repeated is its own kind.
    ``absent_ok``: a name no sender has, or rows no sender holds, resolve to no pieces instead of
    raising (``catalog``: while senders are still joining, the holder may be one of those to come)."""

    def __init__(self, sources: dict[str, Source], transforms: Mapping[tuple[str, str], str] = {},
                 mapping: "str | NameMapping" = "identity", absent_ok: bool = False) -> None:
        self.sources, self.transforms, self.absent_ok = sources, transforms, absent_ok
        self.shapes = {name: SourceShape(s.dtype, s.full_shape) for name, s in sources.items()}
        self.rules = get_mapping(mapping)
        self.intern = Interned()
        self.templates: dict[tuple, list[tuple]] = {}  # (kind, layout) -> templates
        self.comps_of: dict[str, tuple] = {}
        self.kind_of: dict[str, tuple] = {}  # weight name -> (its kind, its sources): ``_kind``
        self._likeness: dict[str, int] = {}  # source name -> its likeness, numbered (``_likenesses``)
        self._likenesses: dict[tuple, int] = {}
        self._kinds: dict[tuple, int] = {}  # (rule, each source's likeness) -> kind

    def pieces(self, receivers: Iterable[tuple[int, Manifest]]) -> list[Piece]:
        return made_pieces(self.tensors(receivers))

    def tensors(self, receivers: Iterable[tuple[int, Manifest]]) -> list[Resolved]:
        """Each receiver tensor that moves, resolved: (receiver, name, its sources, its templates, region,
        offset); ``made_pieces`` makes the pieces."""
        sources, templates, kind_of = self.sources, self.templates, self.kind_of
        out: list[Resolved] = []
        add = out.append
        for rank, manifest in receivers:
            specs = manifest.by_name()
            names = frozenset(specs)
            for t in manifest.tensors:
                if t.tied_to is not None:
                    continue  # the receiver shares this storage with t.tied_to: it moves once, under that name
                name, dtype, sh = t.name, t.dtype, t.shard
                scale_of = _scales_of(t, specs, sources) if name.endswith(SCALE_SUFFIX) else None
                weight = name if scale_of is None else scale_of.name
                kind = kind_of.get(weight)
                if kind is None:
                    kind = kind_of[weight] = self._kind(weight)
                like, srcs = kind
                # what the pieces depend on, as plain values (inline here: a call per tensor costs a tenth
                # of this loop's time)
                key = (like, dtype, t.shape, None if sh is None else (sh.full_shape, sh.dim, sh.start, sh.stop),
                       None if scale_of is None else _layout(scale_of),
                       dtype == FP8 and name + SCALE_SUFFIX in names)
                made = templates.get(key)
                if made is None:
                    made = templates[key] = self._made(t, rank, scale_of, names, srcs)
                if made:
                    add((rank, name, srcs, made, t.region if t.region is not None else 0, t.offset))
        return out

    def _kind(self, name: str) -> tuple:
        """(kind, sources) of receiver name ``name`` (a weight's, for its block scales): the kind numbers
        the mapping rule with how each source is held, or is ``name`` itself where a source is missing
        or named twice (then the tensor shares with no other name)."""
        rule, srcs = self.rules.recipe(name)
        if len(set(srcs)) != len(srcs):
            return name, srcs
        kinds = []
        for src_name in srcs:
            k = self._likeness.get(src_name)
            if k is None:
                src = self.sources.get(src_name)
                if src is None:
                    return name, srcs
                like = src.likeness(self.intern)
                k = self._likeness[src_name] = self._likenesses.setdefault(like, len(self._likenesses))
            kinds.append(k)
        return self._kinds.setdefault((id(rule), *kinds), len(self._kinds)), srcs

    def _made(self, t: TensorSpec, rank: int, scale_of, names, srcs: tuple[str, ...]) -> list[tuple]:
        """``t``'s templates, each with its source as a slot in ``srcs`` (its tensor's sources in order)."""
        slot = {src: i for i, src in reversed(list(enumerate(srcs)))}
        return [(slot[src], *rest) for src, *rest in self._templates(t, rank, scale_of, names)]

    def _templates(self, t: TensorSpec, rank: int, scale_of, names) -> list[tuple]:
        if self.absent_ok and not all(src in self.shapes for src in self.rules.recipe((scale_of or t).name)[1]):
            return []  # a name no sender has (yet): told before the error's name hints are looked for
        try:
            return _templates(t, rank, scale_of, names, self.rules, self.shapes, self.sources, self.transforms,
                              self.intern, self.comps_of)
        except (UnknownParameter, Unsuppliable):
            if not self.absent_ok:
                raise
            return []


def _templates(t: TensorSpec, rank: int, scale_of, names, rules, shapes, sources, transforms, intern,
               comps_of: dict) -> list[tuple]:
    """Receiver tensor ``t``'s pieces, as (source, rows, bytes, offset from ``t``'s, row size, transform,
    candidates); ``rank`` only names the receiver in errors."""
    where = f"receiver/{rank}"
    weight = scale_of or t
    made = comps_of.get(weight.name)  # (a name's components do not depend on the receiver)
    if made is None:
        made = comps_of[weight.name] = components(rules, weight.name, shapes, where)
    comps, src_dtype = made
    step = dtype_transform(src_dtype, weight, where, transforms, names)
    out = []
    for part in parts_for(t, comps, step, where, scale_of):
        for p in pieces_for(sources[part.src], t, rank, part, intern):
            out.append((p.src_name, p.slice, p.nbytes, p.offset - t.offset, p.row_bytes, p.transform, p.cands))
    return out


Resolved = tuple[int, str, tuple[str, ...], list[tuple], int, int]  # ``Resolver.tensors``


def made_pieces(tensors: list[Resolved], narrowed: Mapping[str, tuple[tuple, tuple]] = {}) -> list[Piece]:
    """The pieces of resolved receiver tensors, each template with the tensor's sources, region and
    offset; a piece of a source in ``narrowed`` (name -> (its full holders, those designated)) whose
    candidates are its full holders gets the designated ones."""
    pieces: list[Piece] = []
    add = pieces.append
    for rank, name, srcs, made, region, base in tensors:
        for slot, slice_, nbytes, at, row_bytes, transform, cands in made:
            src = srcs[slot]
            if narrowed:
                full_chosen = narrowed.get(src)
                if full_chosen is not None and full_chosen[0] is cands:
                    cands = full_chosen[1]
            add(make_piece(Piece, (rank, name, src, slice_, nbytes, region, base + at, row_bytes, transform, cands)))
    return pieces


def _designate_gatherers(tensors: list[Resolved], sources: dict[str, Source], n_senders: int,
                         intern: "Interned") -> dict[str, tuple[tuple, tuple]]:
    """Which gather-only sources' pieces to narrow to fewer candidates, where the gathers would not fit:
    name -> (its full holders, those designated), for ``made_pieces``. Every sender of such a
    parameter gathers it, and each gather costs the holders' outbound ports the full tensor. If the
    senders' spare room (their capacity, each sending as long as the busiest receiver receives, less
    all bytes sent) holds a gather for every receiver of every such parameter, every holder stays a
    candidate: the schedule keeps its choice. Otherwise each parameter gets k holders, chosen
    least-loaded first (k = its bytes to send over a fair share of all bytes, at least 1), its
    receivers dealt out among them."""
    gather_only = {name for name, s in sources.items() if s.gshards and not s.replicas}
    by_name: dict[str, dict[int, int]] = {}  # name -> receiver -> bytes of its gather-only pieces
    load: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    full = {name: sources[name].full_cands(intern) for name in gather_only}
    for rank, _, srcs, made, _, _ in tensors:
        for slot, _, nbytes, _, _, _, cands in made:
            received[rank] += nbytes
            name = srcs[slot]
            if full.get(name) is cands:
                group = by_name.get(name)
                if group is None:
                    group = by_name[name] = defaultdict(int)
                group[rank] += nbytes
            elif len(cands) == 1:
                load[cands[0]] += nbytes
    narrowed: dict[str, tuple[tuple, tuple]] = {}
    if not by_name:
        return narrowed
    total_all = sum(received.values())
    room = n_senders * max(received.values()) - total_all
    for name, group in by_name.items():
        src = sources[name]
        gathers = min(len(full[name]), len(group))
        room -= gathers * prod(src.full_shape) * dtype_size(src.dtype)
    if room >= 0:
        return narrowed
    fair = max(1, total_all // max(1, n_senders))
    totals = {name: sum(group.values()) for name, group in by_name.items()}
    for name in sorted(by_name, key=lambda n: -totals[n]):
        total, holders = totals[name], full[name]
        k = min(len(holders), max(1, -(-total // fair)))
        if k == len(holders):
            continue
        chosen = tuple(sorted(sorted(holders, key=load.__getitem__)[:k]))  # (holders ascend: ties by rank)
        narrowed[name] = (holders, intern.setdefault(chosen, chosen))
        for s in chosen:
            load[s] += total // k
    return narrowed


def _layout(t: TensorSpec) -> tuple:
    """What a receiver tensor's pieces depend on of the FP8 weight its block scales are for, but its
    name (the tensor's kind holds that), as plain values: hashing the structs would cost Python calls."""
    sh = t.shard
    return t.dtype, t.shape, None if sh is None else (sh.full_shape, sh.dim, sh.start, sh.stop)


def _scales_of(t: TensorSpec, specs: Mapping[str, TensorSpec], sources) -> Optional[TensorSpec]:
    """The FP8 weight whose block scales ``t`` (a name ending in the scale suffix) holds, if it is such
    a tensor."""
    if t.name in sources:
        return None
    weight = specs.get(t.name[: -len(SCALE_SUFFIX)])
    return weight if weight is not None and weight.dtype == FP8 else None
