"""Small builders for planner tests: participants from {name: shape} dicts, and a coverage checker."""

from __future__ import annotations

import math
from collections import defaultdict

from weightsync.engine.plan import Participant, RoutingPlan
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
