"""Small builders for planner tests: participants from {name: shape} dicts, a coverage checker, and
random instances with mixed locality (hypothesis)."""

from __future__ import annotations

import math
from collections import defaultdict

from hypothesis import strategies as st

from weightsync.engine.plan import LinkModel, Participant, RoutingPlan
from weightsync.wire import Manifest, RegionInfo, ShardSpec, TensorSpec, TransportInfo, dtype_size


def tensor(name, shape, dtype="float32", shard=None, gatherable=False, tied_to=None, offset=0):
    shape = tuple(shape)
    local = ShardSpec(shape, *shard).local_shape() if shard else shape
    spec = ShardSpec(shape, *shard) if shard else None
    n = math.prod(local) * dtype_size(dtype)
    strides = tuple(math.prod(local[i + 1:]) for i in range(len(local)))
    return TensorSpec(name, dtype, local, n, strides, True, "cpu", 0, offset, spec, tied_to, gatherable)


def participant(rank, tensors, host="h0", device="cpu", kind="tcp"):
    laid, at = [], 0
    for t in tensors:
        if t.tied_to is None:
            laid.append(TensorSpec(**{**t.__dict__, "offset": at}))
            at += t.nbytes
        else:
            laid.append(t)
    by_name = {t.name: t for t in laid}
    laid = [TensorSpec(**{**t.__dict__, "offset": by_name[t.tied_to].offset}) if t.tied_to else t for t in laid]
    manifest = Manifest(tuple(laid), (RegionInfo(0, at, device, b""),))
    return Participant(rank, manifest, TransportInfo(kind, host, f"{host}:{9000 + rank}", device, b""))


def check_coverage(plan: RoutingPlan, receivers) -> None:
    """Every byte a receiver needs arrives exactly once, and sender rows mirror receiver entries."""
    mirrored = {(s, t.index): t for s, table in plan.senders.items() for t in table.transfers}
    for rp in receivers:
        table = plan.receivers[rp.rank]
        spans = defaultdict(list)
        for e in table.entries:
            t = mirrored.pop((e.src_rank, e.index))
            assert (t.dst_rank, t.dst_name, t.dst_offset, t.nbytes, t.slice) == (rp.rank, e.name, e.offset, e.nbytes, e.slice)
            spans[e.name].append((e.offset, e.offset + e.nbytes))
        for t in rp.manifest.tensors:
            if t.tied_to is not None:
                assert t.name not in spans, f"tied {t.name} moved separately"
                continue
            got = sorted(spans.pop(t.name, []))
            if t.nbytes == 0:  # nothing to move; a zero-byte transfer is allowed, not required
                assert all(a == b for a, b in got)
                continue
            at = t.offset
            for a, b in got:
                assert a == at, f"{t.name} on receiver {rp.rank}: gap or overlap at byte {at} (next span {a})"
                at = b
            assert at == t.offset + t.nbytes, f"{t.name} on receiver {rp.rank}: ends at {at}"
        assert not spans, f"unexpected names {sorted(spans)}"
    assert not mirrored, "transfers nobody expects"


@st.composite
def mixed_locality(draw):
    """Replicas and FSDP shards spread over hosts and GPUs, so pieces can arrive over several link
    classes, some only after a gather."""
    n_send = draw(st.integers(1, 5))
    names = {f"p{i}": (draw(st.integers(n_send, 64)), 16) for i in range(draw(st.integers(1, 5)))}
    fsdp = {n for n in names if draw(st.booleans())}  # dim-0 shards over every sender, gathered if need be
    place = st.tuples(st.sampled_from(["h0", "h1", "h2"]), st.sampled_from(["cuda:0", "cuda:1"]))
    senders = []
    for r in range(n_send):
        host, device = draw(place)
        specs = []
        for n, shape in names.items():
            if n in fsdp:
                rows = (shape[0] * r // n_send, shape[0] * (r + 1) // n_send)
                specs.append(tensor(n, shape, shard=(0, *rows), gatherable=True))
            elif r == 0 or draw(st.booleans()):  # sender 0 holds everything: every need has a supplier
                specs.append(tensor(n, shape))
        senders.append(participant(r, specs, host=host, device=device))
    receivers = []
    for r in range(draw(st.integers(1, 4))):
        host, device = draw(place)
        # a cast or a column slice of FSDP rows needs a gather or blocks
        need = [tensor(n, s, dtype=draw(st.sampled_from(["float32", "float16"])) if n in fsdp else "float32",
                       shard=(1, 0, 8) if n in fsdp and draw(st.booleans()) else None) for n, s in names.items()]
        receivers.append(participant(r, need, host=host, device=device))
    link = LinkModel(net_bw=draw(st.sampled_from([1e9, 5e9])), host_bw=draw(st.sampled_from([2e9, 8e9])),
                     local_bw=draw(st.sampled_from([4e9, 3e10])), per_transfer_s=0.0)
    return senders, receivers, link
