"""From manifests to pieces: every (parameter slice, receiver) that must move, and who can supply it.

How this works: ``index_sources`` (``sources.py``) checks that all senders agree on each parameter
(dtype, full shape) and that shards tile cleanly. ``build_pieces`` walks each receiver's manifest (skipping
names the receiver ties to another: one storage moves once), resolves each tensor through the name
mapping into parts (``mapping.py``: fused components, transposes, TP shards, casts, FP8 weight and
scales), and turns each part into one ``Piece`` — or several, when only a combination of dim-0 shards
covers it. ``Resolver`` does that walk (receivers of one layout share it, and tensors alike but for their
names, every layer's q_proj of one TP rank, share it too), resolving each tensor to numbered templates
(``Resolver.tensors``); ``expand.Expanded`` lays the templates out as arrays and expands every tensor
into its pieces' rows, designates the gatherers on those rows and then makes the pieces (and, for the
planner, the same pieces cut into per-receiver streams by candidate tuple: ``build_streams``);
``catalog.py`` uses the walk to check one joining receiver. A piece lists its candidate senders; how a
part is cut along the senders' shards (shard-to-shard, blocks, block-FP8 runs) is ``cuts.py``'s.
Pieces that need a gather (a TP slice along another dim, a transform) may only go to k designated
holders per parameter (``Expanded.designate``), least-loaded first, k its bytes to send over a fair
share of all bytes, when a gather per receiver would not fit the senders' spare room; so a large
parameter is gathered a few times, not by every sender that sends a slice of it. A holder whose
shorter gathers leave its port idle until its longest is done also gathers a shorter one, so that
every gatherer has work once the shorter gathers are done; each gatherer's table takes its gathers
shortest first (``Streams.gathers``, ``tables.build_tables``).
Every failure is a ``PlanError`` naming the parameter and ranks.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, Mapping, NamedTuple, Optional, Sequence


from weightsync.wire import Manifest, TensorSpec

from ..errors import UnknownParameter, Unsuppliable
from .links import Participant
from .mapping import FP8, SCALE_SUFFIX, Mapping as NameMapping, SourceShape, components, dtype_transform
from .mapping import get_mapping, parts_for
from .cuts import pieces_for
from .expand import Expanded
from .sources import Interned, Piece, Source, Streams, index_sources

if TYPE_CHECKING:
    from .catalog import Index

__all__ = ["PlanCache", "Piece", "Resolver", "Source", "build_pieces", "build_streams", "index_sources", "layout_key"]



def build_pieces(
    senders: Sequence[Participant],
    receivers: Sequence[Participant],
    transforms: Mapping[tuple[str, str], str] = {},
    mapping: "str | NameMapping" = "identity",
    cache: "Optional[PlanCache]" = None,
) -> tuple[list[Piece], dict[str, Source]]:
    """``cache``: what the previous plan resolved, reused while the senders are the same."""
    expanded, narrowed, resolver = _expanded(senders, receivers, transforms, mapping, cache)
    return expanded.pieces(narrowed), resolver.sources


def build_streams(
    senders: Sequence[Participant],
    receivers: Sequence[Participant],
    transforms: Mapping[tuple[str, str], str] = {},
    mapping: "str | NameMapping" = "identity",
    cache: "Optional[PlanCache]" = None,
    index: "Optional[Index]" = None,
) -> "tuple[list[Piece], Optional[Streams]]":
    """``build_pieces``'s pieces, in the streams' order, and the same pieces as streams
    (``Expanded.streams``; None if no pieces). ``index``: what a ``Catalog`` lent (``Catalog.lend``):
    its sources, if they index exactly these senders, and its receivers' layout numbers."""
    expanded, narrowed, resolver = _expanded(senders, receivers, transforms, mapping, cache, index)
    return expanded.streams(narrowed, resolver.sources, resolver.intern)


def _expanded(senders, receivers, transforms, mapping, cache, index=None) -> tuple[Expanded, dict, "Resolver"]:
    if cache is None:
        resolver = Resolver(sources_of(senders, index), transforms, mapping)
    else:
        resolver = cache.resolver(senders, transforms, mapping, index)
    expanded = resolver.expanded(((p.rank, p.manifest) for p in receivers), index.layout_of if index else None)
    return expanded, expanded.designate(resolver.sources, len(senders), resolver.intern), resolver


def sources_of(senders: Sequence[Participant], index: "Optional[Index]" = None) -> dict[str, Source]:
    """The senders' sources: those ``index`` holds if it indexes exactly these senders (a
    ``Catalog``'s, kept as they joined), else made now (``index_sources``)."""
    if index is not None and index.indexes(senders):
        return index.sources
    return index_sources(senders)


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

    def resolver(self, senders: Sequence[Participant], transforms, mapping,
                 index: "Optional[Index]" = None) -> "Resolver":
        if self.same_senders(senders, transforms, mapping):
            self.hits += 1
            return self._resolver
        self.misses += 1
        self._resolver, self.last = None, None  # (a failed index leaves nothing behind)
        self._resolver = Resolver(sources_of(senders, index), transforms, mapping)
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
        self.templates: dict[tuple, int] = {}  # (kind, layout) -> its templates' number in made (-1: none)
        self.made: list[list[tuple]] = []  # templates, numbered
        self.srcs: list[tuple[str, ...]] = []  # each weight name's sources, numbered
        self.comps_of: dict[str, tuple] = {}
        self.kind_of: dict[str, tuple] = {}  # weight name -> (its kind, its sources' number): ``_kind``
        self._likeness: dict[str, int] = {}  # source name -> its likeness, numbered (``_likenesses``)
        self._likenesses: dict[tuple, int] = {}
        self._kinds: dict[tuple, int] = {}  # (rule, each source's likeness) -> kind

    def pieces(self, receivers: Iterable[tuple[int, Manifest]]) -> list[Piece]:
        return self.expanded(receivers).pieces()

    def expanded(self, receivers: Iterable[tuple[int, Manifest]], layout_of=None) -> Expanded:
        """The receivers' pieces as columns, before any gatherer is designated (``expand.py``);
        ``layout_of`` as in ``tensors``."""
        return Expanded(self.tensors(receivers, layout_of), self.srcs, self.made)

    def tensors(self, receivers: Iterable[tuple[int, Manifest]],
                layout_of: "Optional[Callable[[int, Manifest], Hashable]]" = None) -> "Resolved":
        """Each receiver tensor that moves, resolved: per receiver layout, a row per tensor (name, its
        sources' number in ``srcs``, its templates' number in ``made``, region, offset); ``Expanded``
        makes the pieces. A receiver's rows depend on its layout only (``layout_key``; ``layout_of``
        may give it instead, as a number a ``Catalog`` gave it when it joined): receivers of one
        layout (every instance's TP rank r) are resolved once. What a tensor's row depends on by its
        name alone (its kind and sources, the weight a block scale is for, whether it has block
        scales, whether it is tied) is the same for a layout whose tensors have the names, dtypes and
        ties of the one before (every TP or EP rank): it is worked out for the first (``_facts``)."""
        out = Resolved([], [], [])
        numbers: dict[Hashable, int] = {}
        last: tuple = ((), [])  # (names, dtypes, ties) of the layout before, and its tensors' facts
        for rank, manifest in receivers:
            key = None if layout_of is None else layout_of(rank, manifest)
            if key is None:
                key = ("key", layout_key(manifest))
            number = numbers.get(key)
            if number is None:
                number = numbers[key] = len(out.rows)
                ts = manifest.tensors
                sig = (list(map(_name, ts)), list(map(_dtype, ts)), list(map(_tied_to, ts)))
                if sig != last[0]:
                    last = (sig, self._facts(manifest))
                rows: list[tuple] = []
                self._rows(rank, ts, last[1], sig[0], rows.append)
                out.rows.append(rows)
            out.ranks.append(rank)
            out.layout.append(number)
        return out

    def _facts(self, manifest: Manifest) -> list[Optional[tuple]]:
        """Each of a receiver's tensors' facts by name: None for a tied tensor (it moves once, under the
        name it is tied to), else (kind, sources, sources' number, the position of the weight it holds
        block scales of or -1, whether it has block scales)."""
        sources, kind_of = self.sources, self.kind_of
        specs = manifest.by_name()
        names = frozenset(specs)
        position = {t.name: i for i, t in enumerate(manifest.tensors)}
        facts: list[Optional[tuple]] = []
        for t in manifest.tensors:
            if t.tied_to is not None:
                facts.append(None)
                continue
            name = t.name
            scale_of = _scales_of(t, specs, sources) if name.endswith(SCALE_SUFFIX) else None
            weight = name if scale_of is None else scale_of.name
            kind = kind_of.get(weight)
            if kind is None:
                kind = kind_of[weight] = (*self._kind(weight), len(self.srcs))
                self.srcs.append(kind[1])
            like, srcs, srcs_at = kind
            facts.append((like, srcs, srcs_at, -1 if scale_of is None else position[weight],
                          t.dtype == FP8 and name + SCALE_SUFFIX in names))
        return facts

    def _rows(self, rank: int, ts, facts: list[Optional[tuple]], names: list[str], add) -> None:
        """One layout's rows (``tensors``), from its first receiver's tensors and their ``facts``
        (``_facts``, worked out for it or for a layout before it with the same names, dtypes and ties)."""
        templates = self.templates
        for t, fact in zip(ts, facts):
            if fact is None:
                continue
            like, srcs, srcs_at, w, has_scales = fact
            sh = t.shard
            scale_of = None if w < 0 else ts[w]
            # what the pieces depend on, as plain values (inline here: a call per tensor costs a tenth
            # of this loop's time)
            key = (like, t.dtype, t.shape, None if sh is None else (sh.full_shape, sh.dim, sh.start, sh.stop),
                   None if scale_of is None else _layout(scale_of), has_scales)
            made = templates.get(key)
            if made is None:
                made = self._new_templates(key, t, rank, scale_of, frozenset(names), srcs)
            if made >= 0:
                add((t.name, srcs_at, made, t.region if t.region is not None else 0, t.offset))

    def _new_templates(self, key: tuple, t: TensorSpec, rank: int, scale_of, names, srcs) -> int:
        """A layout not seen before: its templates made, numbered and kept (-1 when it has no pieces)."""
        got = self._made(t, rank, scale_of, names, srcs)
        made = self.templates[key] = len(self.made) if got else -1
        if got:
            self.made.append(got)
        return made

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


class Resolved(NamedTuple):
    """``Resolver.tensors``: receiver ``ranks[i]`` (in the order given) has layout ``layout[i]``, whose
    rows, one per tensor that moves, in its manifest's order, are ``rows[layout[i]]``: (name, its
    sources' number, its templates' number, region, offset)."""

    ranks: list[int]
    layout: list[int]
    rows: list[list[tuple[str, int, int, int, int]]]


_name, _dtype, _tied_to = attrgetter("name"), attrgetter("dtype"), attrgetter("tied_to")
_shape, _shard, _region, _offset = attrgetter("shape"), attrgetter("shard"), attrgetter("region"), attrgetter("offset")


def layout_key(manifest: Manifest) -> tuple:
    """What a receiver's rows (``Resolver.tensors``) depend on but its rank: each tensor's name, dtype,
    tie, shape, shard (dim, rows, full shape) and place (region, offset), read by C-level maps (about
    0.4 µs a tensor, against 0.7 µs to resolve it); receivers with equal keys resolve alike."""
    ts = manifest.tensors
    shards = list(map(_shard, ts))
    return (tuple(map(_name, ts)), tuple(map(_dtype, ts)), tuple(map(_tied_to, ts)), tuple(map(_shape, ts)),
            *(tuple(map(getattr, shards, repeat(field), repeat(None)))
              for field in ("dim", "start", "stop", "full_shape")),
            tuple(map(_region, ts)), tuple(map(_offset, ts)))


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
