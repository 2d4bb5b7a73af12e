"""The routing planner: coverage, determinism, TP slicing, tied weights, locality, errors, model."""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.engine import errors
from weightsync.engine.plan import (
    LinkClass,
    LinkModel,
    PlanOptions,
    broadcast_assignment,
    build_pieces,
    link_class,
    lower_bound,
    makespan,
    plan,
    seed_greedy_assignment,
    tables_from_assignment,
)
from plan_helpers import check_coverage, mixed_locality, participant, tensor
from weightsync.wire import Envelope, Slice, encode
from weightsync.wire import messages as m

MODEL = {"embed": (64, 16), "w1": (32, 16), "w2": (16, 32), "norm": (16,), "step": ()}


def _replicas(n, model=MODEL, **kw):
    return [participant(r, [tensor(k, s) for k, s in model.items()], host=f"t{r}", **kw) for r in range(n)]


def _receivers(n, model=MODEL):
    return [participant(r, [tensor(k, s) for k, s in model.items()], host=f"i{r}") for r in range(n)]


@pytest.mark.parametrize("n_send,n_recv", [(1, 1), (2, 3), (4, 2), (3, 7)])
def test_every_byte_exactly_once(n_send, n_recv):
    senders, receivers = _replicas(n_send), _receivers(n_recv)
    routing = plan(senders, receivers, options=PlanOptions(min_chunk_bytes=256, chunks_per_receiver=4))
    check_coverage(routing, receivers)
    used = {s for s, t in routing.senders.items() if t.transfers}
    assert len(used) == min(n_send, n_recv * 4) or n_send <= n_recv  # receivers fed by several senders


def test_deterministic_byte_for_byte():
    def encoded():
        routing = plan(_replicas(3), _receivers(4), options=PlanOptions(min_chunk_bytes=256))
        frames = [encode(Envelope(m.Plan(1, t, None), 1, "controller")) for t in routing.senders.values()]
        frames += [encode(Envelope(m.Plan(1, None, t), 1, "controller")) for t in routing.receivers.values()]
        return frames
    assert encoded() == encoded()


def test_large_tensor_is_split_across_senders_at_rows():
    senders = _replicas(4, {"big": (1024, 64)})
    receivers = _receivers(1, {"big": (1024, 64)})
    routing = plan(senders, receivers, options=PlanOptions(min_chunk_bytes=4096, chunks_per_receiver=4))
    check_coverage(routing, receivers)
    slices = sorted(t.slice.start for table in routing.senders.values() for t in table.transfers)
    assert len(slices) == 4 and slices[0] == 0
    assert all(t.slice.dim == 0 for table in routing.senders.values() for t in table.transfers)


def test_tp_receiver_gets_only_its_slice():
    senders = _replicas(2, {"col": (8, 4), "row": (4, 8)})
    receivers = [
        participant(r, [tensor("col", (8, 4), shard=(0, 4 * r, 4 * r + 4)), tensor("row", (4, 8), shard=(1, 4 * r, 4 * r + 4))],
                    host="i")
        for r in range(2)
    ]
    routing = plan(senders, receivers)
    check_coverage(routing, receivers)
    for r in range(2):
        entries = {e.name: e for e in routing.receivers[r].entries}
        assert entries["col"].slice.dim == 0 and (entries["col"].slice.start, entries["col"].nbytes) == (4 * r, 64)
        assert entries["row"].slice.dim == 1 and (entries["row"].slice.start, entries["row"].nbytes) == (4 * r, 64)
    assert routing.nbytes == 2 * (64 + 64)  # nothing unneeded moves


def test_tied_weights_move_once_when_receiver_ties_them():
    senders = [participant(0, [tensor("embed", (8, 4)), tensor("lm_head", (8, 4), tied_to="embed")])]
    tied = participant(0, [tensor("embed", (8, 4)), tensor("lm_head", (8, 4), tied_to="embed")], host="i")
    untied = participant(1, [tensor("embed", (8, 4)), tensor("lm_head", (8, 4))], host="i")
    routing = plan(senders, [tied, untied])
    check_coverage(routing, [tied, untied])
    assert [e.name for e in routing.receivers[0].entries] == ["embed"]
    assert sorted(e.name for e in routing.receivers[1].entries) == ["embed", "lm_head"]


def test_stitches_a_need_from_dim0_shards():
    shards = [participant(r, [tensor("w", (8, 2), shard=(0, 4 * r, 4 * r + 4))], host=f"t{r}") for r in range(2)]
    receivers = [participant(0, [tensor("w", (8, 2))], host="i"), participant(1, [tensor("w", (8, 2), shard=(0, 2, 6))], host="i")]
    routing = plan(shards, receivers)
    check_coverage(routing, receivers)
    got = sorted((e.src_rank, e.slice.start, e.slice.stop) for e in routing.receivers[1].entries)
    assert got == [(0, 2, 4), (1, 4, 6)]


@pytest.mark.parametrize("group, stitched", [(4, True), (8, True), (16, False)])
def test_small_parts_go_shard_to_shard_only_in_a_small_fsdp_group(group, stitched):
    """A 64 KiB tensor sharded by FSDP over ``group`` ranks, needed whole by one receiver: in a group of a
    host's size each rank sends its rows (no gather); in a larger one the parts are too many and too
    small, so one rank gathers it and sends it whole."""
    rows = 64
    senders = [participant(r, [tensor("w", (rows, 256), shard=(0, rows * r // group, rows * (r + 1) // group),
                                      gatherable=True)], host="t") for r in range(group)]
    receivers = [participant(0, [tensor("w", (rows, 256))], host="i")]
    routing = plan(senders, receivers)
    check_coverage(routing, receivers)
    sources = {e.src_rank for e in routing.receivers[0].entries}
    if stitched:
        assert sources == set(range(group))
        assert all(e.slice == Slice(0, rows * e.src_rank // group, rows * (e.src_rank + 1) // group)
                   for e in routing.receivers[0].entries)  # each its own rows: inside its shard
    else:
        assert len(sources) == 1 and len(routing.receivers[0].entries) == 1  # one gathering sender


def test_prefers_same_gpu_then_same_host():
    senders = [participant(0, [tensor("w", (4, 4))], host="a", device="cuda:0"),
               participant(1, [tensor("w", (4, 4))], host="a", device="cuda:1"),
               participant(2, [tensor("w", (4, 4))], host="b", device="cuda:0")]
    same_gpu = participant(0, [tensor("w", (4, 4))], host="a", device="cuda:1")
    same_host = participant(1, [tensor("w", (4, 4))], host="a", device="cuda:5")
    remote = participant(2, [tensor("w", (4, 4))], host="b", device="cuda:3")
    routing = plan(senders, [same_gpu, same_host, remote])
    assert link_class(senders[1], same_gpu) is LinkClass.LOCAL
    src = {r: routing.receivers[r].entries[0].src_rank for r in range(3)}
    assert src[0] == 1 and src[1] in (0, 1) and src[2] == 2


def test_unknown_name_lists_closest():
    receivers = [participant(0, [tensor("model.layers.0.mlp.up_proj.weigth", (4,))])]
    senders = [participant(0, [tensor("model.layers.0.mlp.up_proj.weight", (4,)), tensor("other", (4,))])]
    with pytest.raises(errors.UnknownParameter) as e:
        plan(senders, receivers)
    assert e.value.param == "model.layers.0.mlp.up_proj.weigth"
    assert "model.layers.0.mlp.up_proj.weight" in e.value.closest and "receiver/0" in e.value.ranks


def test_sources_disagree_on_dtype_or_shape():
    a = participant(0, [tensor("w", (4, 4))])
    b = participant(1, [tensor("w", (4, 4), dtype="bfloat16")])
    with pytest.raises(errors.ManifestMismatch) as e:
        plan([a, b], _receivers(1, {"w": (4, 4)}))
    assert e.value.param == "w" and e.value.ranks == ("sender/0", "sender/1")
    c = participant(1, [tensor("w", (4, 5))])
    with pytest.raises(errors.ManifestMismatch, match=r"\[4, 5\]"):
        plan([a, c], _receivers(1, {"w": (4, 4)}))


def test_receiver_disagrees_with_sources():
    senders = _replicas(1, {"w": (4, 4)})
    with pytest.raises(errors.ManifestMismatch, match="receiver wants full shape") as e:
        plan(senders, [participant(3, [tensor("w", (4, 8))])])
    assert e.value.ranks == ("receiver/3",)
    with pytest.raises(errors.ManifestMismatch, match="no transform"):
        plan(senders, [participant(0, [tensor("w", (4, 4), dtype="int32")])])
    routing = plan(senders, [participant(0, [tensor("w", (4, 4), dtype="int32")])],
                   transforms={("float32", "int32"): "my_round"})
    assert routing.senders[0].transfers[0].transform == "my_round"
    routing = plan(senders, [participant(0, [tensor("w", (4, 4), dtype="bfloat16")])])
    assert routing.senders[0].transfers[0].transform == "cast:bfloat16"  # float to float: built in


def test_overlapping_shards_do_not_tile():
    a = participant(0, [tensor("w", (8, 2), shard=(0, 0, 5))])
    b = participant(1, [tensor("w", (8, 2), shard=(0, 4, 8))])
    with pytest.raises(errors.BadTiling, match=r"\[0:5\] and \[4:8\] overlap") as e:
        plan([a, b], _receivers(1, {"w": (8, 2)}))
    assert e.value.param == "w"


def test_gap_in_shards_is_unsuppliable():
    a = participant(0, [tensor("w", (8, 2), shard=(0, 0, 4))])
    b = participant(1, [tensor("w", (8, 2), shard=(0, 6, 8))])
    with pytest.raises(errors.Unsuppliable, match="rows 4:6"):
        plan([a, b], _receivers(1, {"w": (8, 2)}))
    plan([a, b], [participant(0, [tensor("w", (8, 2), shard=(0, 6, 8))])])  # the gap is not needed: fine


def test_duplicate_ranks_and_no_senders():
    with pytest.raises(errors.PlanError, match="two senders claim rank 0"):
        plan([participant(0, []), participant(0, [])], [])
    with pytest.raises(errors.PlanError, match="no senders"):
        plan([], _receivers(1))


def test_model_bound_and_baselines():
    link = LinkModel(net_bw=1e9, per_transfer_s=0.0)
    senders, receivers = _replicas(4, {"w": (4096, 64)}), _receivers(4, {"w": (4096, 64)})
    routing = plan(senders, receivers, link, PlanOptions(min_chunk_bytes=1 << 16))
    pieces, _ = build_pieces(senders, receivers)
    bound = lower_bound(pieces, senders, receivers, link)
    assert bound == pytest.approx(4096 * 64 * 4 / 1e9)
    ours = makespan(routing.senders, senders, receivers, link)
    assert bound <= ours <= bound * 1.01
    bcast = tables_from_assignment(broadcast_assignment(pieces, senders), senders, receivers)
    assert makespan(bcast.senders, senders, receivers, link) == pytest.approx(4 * bound)
    greedy = tables_from_assignment(seed_greedy_assignment(pieces, senders), senders, receivers)
    check_coverage(greedy, receivers)
    assert makespan(greedy.senders, senders, receivers, link) >= bound


def test_per_transfer_latency_costs_something():
    senders, receivers = _replicas(1, {f"t{i}": (1,) for i in range(100)}), _receivers(1, {f"t{i}": (1,) for i in range(100)})
    routing = plan(senders, receivers)
    fast = makespan(routing.senders, senders, receivers, LinkModel(per_transfer_s=0.0))
    slow = makespan(routing.senders, senders, receivers, LinkModel(per_transfer_s=1e-3))
    assert slow >= 0.1 > fast


# --- property: random manifests plan with full coverage or raise PlanError -----------------------

NAMES = ["a", "b", "c", "d"]


@st.composite
def scenarios(draw):
    shapes = {n: tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3))) for n in NAMES}
    dtypes = {n: draw(st.sampled_from(["float32", "bfloat16", "int64"])) for n in NAMES}

    def spec(n, allow_shard):
        shape = shapes[n]
        shard = None
        if allow_shard and shape and draw(st.booleans()):
            dim = draw(st.integers(0, len(shape) - 1))
            a = draw(st.integers(0, shape[dim]))
            shard = (dim, a, draw(st.integers(a, shape[dim])))
        dtype = dtypes[n] if draw(st.integers(0, 9)) else "float64"  # sometimes a mismatch
        return tensor(n, shape, dtype, shard=shard, gatherable=draw(st.booleans()))

    n_send, n_recv = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    senders = [participant(r, [spec(n, True) for n in draw(st.lists(st.sampled_from(NAMES), unique=True))],
                           host=draw(st.sampled_from(["h0", "h1"])), device=f"cuda:{draw(st.integers(0, 1))}")
               for r in range(n_send)]
    receivers = [participant(r, [spec(n, True) for n in draw(st.lists(st.sampled_from(NAMES), unique=True))],
                             host=draw(st.sampled_from(["h0", "h1", "h2"])), device=f"cuda:{draw(st.integers(0, 1))}")
                 for r in range(n_recv)]
    return senders, receivers


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(1, 64))
def test_random_manifests_plan_fully_or_raise_plan_error(scenario, min_chunk):
    senders, receivers = scenario
    try:
        routing = plan(senders, receivers, options=PlanOptions(min_chunk_bytes=min_chunk, chunks_per_receiver=3))
    except errors.PlanError:
        return
    check_coverage(routing, receivers)
    again = plan(senders, receivers, options=PlanOptions(min_chunk_bytes=min_chunk, chunks_per_receiver=3))
    assert again == routing


# --- property: the lower bound is one, for every table the model replays ---------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_locality(), st.booleans())
def test_makespan_is_never_below_the_bound_with_mixed_locality(scenario, prefer_locality):
    senders, receivers, link = scenario
    pieces, _ = build_pieces(senders, receivers)
    bound = lower_bound(pieces, senders, receivers, link)
    options = PlanOptions(min_chunk_bytes=256, chunks_per_receiver=4, prefer_locality=prefer_locality)
    tables = [plan(senders, receivers, link, options),
              tables_from_assignment(seed_greedy_assignment(pieces, senders), senders, receivers)]
    if all(0 in p.cands for p in pieces):  # (else the broadcast sends what the bound says it cannot)
        tables.append(tables_from_assignment(broadcast_assignment(pieces, senders), senders, receivers))
    for routing in tables:
        assert makespan(routing.senders, senders, receivers, link) >= bound * (1 - 1e-9)


def test_a_receiver_fed_over_two_classes_at_once_has_a_bound_below_one_class():
    """A receiver on a sender's GPU, with a second sender on another GPU of its host: both ports can
    work at once, so the bound is the bytes over both bandwidths, not over the faster one alone."""
    link = LinkModel(host_bw=1e9, local_bw=3e9, per_transfer_s=0.0)
    senders = [participant(0, [tensor("w", (4096, 64))], host="h", device="cuda:0"),
               participant(1, [tensor("w", (4096, 64))], host="h", device="cuda:1")]
    receivers = [participant(0, [tensor("w", (4096, 64))], host="h", device="cuda:0")]
    pieces, _ = build_pieces(senders, receivers)
    assert lower_bound(pieces, senders, receivers, link) == pytest.approx(4096 * 64 * 4 / 4e9)


def test_the_bound_counts_the_gather_some_candidate_must_make():
    """A row-parallel slice (dim 1) of a tensor two FSDP ranks hold by rows, cast on the way (a transform
    needs the whole slice on one rank): whoever sends it gathers the other rank's half first, over its
    inbound host port, before the slice can leave; with a slow host port that pull starts the bound
    (and the makespan is not below it)."""
    link = LinkModel(host_bw=1e6)
    senders = [participant(r, [tensor("w", (64, 256), shard=(0, 32 * r, 32 * r + 32), gatherable=True)], host="t")
               for r in range(2)]
    receivers = [participant(0, [tensor("w", (64, 256), dtype="float16", shard=(1, 0, 128))], host="i")]
    pieces, _ = build_pieces(senders, receivers)
    half = 32 * 256 * 4  # the other rank's rows, served once
    assert lower_bound(pieces, senders, receivers, link) == pytest.approx(half / link.host_bw + 64 * 128 * 2 / link.net_bw)
    routing = plan(senders, receivers, link)
    assert makespan(routing.senders, senders, receivers, link) >= lower_bound(pieces, senders, receivers, link)


def test_a_row_parallel_slice_of_fsdp_rows_goes_as_blocks_without_a_gather():
    """The same slice without a transform: each FSDP rank sends its own rows of it (a block: dim-1 columns
    0:128, its dim-0 rows), landing back to back in the receiver's slice; nothing is gathered, so the
    bound and the makespan are the receiver's bytes, and a split block keeps its columns."""
    link = LinkModel(net_bw=1e6, per_transfer_s=0.0)
    senders = [participant(r, [tensor("w", (64, 256), shard=(0, 32 * r, 32 * r + 32), gatherable=True)], host="t")
               for r in range(2)]
    receivers = [participant(0, [tensor("w", (64, 256), shard=(1, 0, 128))], host="i")]
    pieces, _ = build_pieces(senders, receivers)
    block = 32 * 128 * 4  # the receiver's one network port takes both blocks
    assert [(p.slice, p.offset, p.nbytes, p.cands) for p in pieces] == [
        (Slice(1, 0, 128, 0, 32), 0, block, (0,)), (Slice(1, 0, 128, 32, 64), block, block, (1,))]
    assert lower_bound(pieces, senders, receivers, link) == pytest.approx(2 * block / link.net_bw)
    routing = plan(senders, receivers, link)
    rows = {(s.rank, t.slice, t.dst_offset) for s in routing.senders.values() for t in s.transfers}
    assert rows == {(0, Slice(1, 0, 128, 0, 32), 0), (1, Slice(1, 0, 128, 32, 64), block)}
    assert makespan(routing.senders, senders, receivers, link) == pytest.approx(2 * block / link.net_bw, rel=1e-6)
    head, tail = pieces[1].split(8 * 128 * 4)
    assert (head.slice, head.offset, tail.slice, tail.offset) == (
        Slice(1, 0, 128, 32, 40), block, Slice(1, 0, 128, 40, 64), block + 8 * 128 * 4)


@pytest.mark.parametrize("rows,cut", [(512, True), (384, False)])
def test_fp8_parts_of_fsdp_rows_are_cut_where_shards_fall_on_whole_blocks(rows, cut):
    """Two FSDP ranks, an FP8 receiver: with 256-row shards every cut falls on a 128-row block, so each
    rank quantizes and sends its own weight rows and scale rows (no gather); with 192-row shards a block
    spans both ranks and the part is gathered by one holder."""
    from weightsync.engine.plan.mapping import FP8

    half = rows // 2
    senders = [participant(r, [tensor("w", (rows, 256), "bfloat16", shard=(0, half * r, half * r + half),
                                      gatherable=True)]) for r in range(2)]
    receivers = [participant(0, [tensor("w", (rows, 256), FP8), tensor("w_scale_inv", (rows // 128, 2))])]
    pieces, _ = build_pieces(senders, receivers)
    got = sorted(((p.dst_name, p.slice, p.offset - (0 if p.dst_name == "w" else rows * 256), p.nbytes, p.cands)
                  for p in pieces), key=lambda x: (x[0], x[2]))
    if cut:
        assert got == [("w", Slice(0, 0, 256), 0, 256 * 256, (0,)), ("w", Slice(0, 256, 512), 256 * 256, 256 * 256, (1,)),
                       ("w_scale_inv", Slice(0, 0, 256), 0, 2 * 2 * 4, (0,)),
                       ("w_scale_inv", Slice(0, 256, 512), 2 * 2 * 4, 2 * 2 * 4, (1,))]
    else:
        assert [(n, s, nbytes) for n, s, _, nbytes, _ in got] == [("w", Slice(0, 0, rows), rows * 256),
                                                                  ("w_scale_inv", Slice(0, 0, rows), 3 * 2 * 4)]


@pytest.mark.parametrize("gatherable", [True, False], ids=["fsdp", "expert-parallel"])
def test_fp8_stacks_of_expert_matrices_are_quantized_matrix_by_matrix(gatherable):
    """Fused experts [E, R, C] in block FP8: each matrix on its own grid, scales [E, R/128, C/128]. Two
    FSDP (or expert-parallel) ranks hold three experts each: any cut between experts is one between grids, so each rank
    quantizes and sends its own experts' weights and scales, for an expert-parallel slice (experts 2:6)
    and for a slice inside every expert (rows 128:256 of dim 1) alike, in a large FSDP group too;
    nothing is gathered."""
    from weightsync.engine.plan.mapping import FP8

    full, m = (6, 256, 256), 256 * 256  # (one expert's FP8 bytes)
    senders = [participant(r, [tensor("experts", full, "bfloat16", shard=(0, 3 * r, 3 * r + 3), gatherable=gatherable)])
               for r in range(2)]
    ep = participant(0, [tensor("experts", full, FP8, shard=(0, 2, 6)), tensor("experts_scale_inv", (4, 2, 2))])
    inside = participant(1, [tensor("experts", full, FP8, shard=(1, 128, 256)), tensor("experts_scale_inv", (6, 1, 2))])
    pieces, _ = build_pieces(senders, [ep, inside])
    got = {(p.receiver, p.dst_name, p.slice, p.offset - (0 if p.dst_name == "experts" else 4 * m if p.receiver == 0
                                                         else 6 * m // 2), p.nbytes, p.cands, p.transform)
           for p in pieces}
    assert got == {
        (0, "experts", Slice(0, 2, 3), 0, m, (0,), "fp8w:128"), (0, "experts", Slice(0, 3, 6), m, 3 * m, (1,), "fp8w:128"),
        (0, "experts_scale_inv", Slice(0, 2, 3), 0, 16, (0,), "fp8s:128"),
        (0, "experts_scale_inv", Slice(0, 3, 6), 16, 48, (1,), "fp8s:128"),
        (1, "experts", Slice(1, 128, 256, 0, 3), 0, 3 * m // 2, (0,), "fp8w:128"),
        (1, "experts", Slice(1, 128, 256, 3, 6), 3 * m // 2, 3 * m // 2, (1,), "fp8w:128"),
        (1, "experts_scale_inv", Slice(1, 128, 256, 0, 3), 0, 24, (0,), "fp8s:128"),
        (1, "experts_scale_inv", Slice(1, 128, 256, 3, 6), 24, 24, (1,), "fp8s:128")}
    check_coverage(plan(senders, [ep, inside]), [ep, inside])
    # a block may not span two matrices: rows (dim 1) not whole blocks are refused, naming the parameter
    ragged = participant(0, [tensor("experts", (6, 192, 256), FP8), tensor("experts_scale_inv", (6, 2, 2))])
    src = [participant(0, [tensor("experts", (6, 192, 256), "bfloat16")])]
    with pytest.raises(errors.BadTiling, match="whole 128-row blocks") as err:
        build_pieces(src, [ragged])
    assert err.value.param == "experts"
    # a large FSDP group (12 ranks, an expert each, 1 MiB in FP8): each rank still sends its own expert
    big = [participant(r, [tensor("experts", (12, 1024, 1024), "bfloat16", shard=(0, r, r + 1), gatherable=True)])
           for r in range(12)]
    ep = participant(0, [tensor("experts", (12, 1024, 1024), FP8, shard=(0, 4, 10)),
                         tensor("experts_scale_inv", (6, 8, 8))])
    pieces, _ = build_pieces(big, [ep])
    assert sorted((p.dst_name, p.slice.start, p.nbytes, p.cands) for p in pieces) == [
        *(("experts", e, 1 << 20, (e,)) for e in range(4, 10)), *(("experts_scale_inv", e, 256, (e,)) for e in range(4, 10))]
    flat = participant(0, [tensor("experts", full, FP8, shard=(0, 2, 6)), tensor("experts_scale_inv", (8, 2))])
    with pytest.raises(errors.ManifestMismatch, match=r"block scales must be float32 \[4, 2, 2\]"):
        build_pieces(senders, [flat])


@pytest.mark.parametrize("trainers", ["fsdp", "ep", "replicas"])
def test_a_share_inside_every_expert_of_a_fused_stack_comes_from_the_ranks_that_hold_the_experts(trainers):
    """vLLM's w13 under TP without EP (``qwen3_moe``'s ``stack_split``): rank 1 of 2 holds, expert after
    expert, rows 8:16 of the gate (0:16) and 24:32 of the up (16:32): the ``share`` transform of the
    whole stack, which each FSDP or expert-parallel trainer rank applies to its own experts (no gather),
    or a replica to all; tables cover the receiver."""
    full, mapping = (4, 32, 8), "qwen3_moe"
    dst = "layers.0.mlp.experts.routed_experts.w13_weight"
    src = "layers.0.mlp.experts.gate_up_proj"
    if trainers == "replicas":
        senders = [participant(r, [tensor(src, full)]) for r in range(2)]
    else:
        senders = [participant(r, [tensor(src, full, shard=(0, 2 * r, 2 * r + 2), gatherable=trainers == "fsdp")])
                   for r in range(2)]
    receiver = participant(0, [tensor(dst, full, shard=(1, 16, 32))])
    pieces, _ = build_pieces(senders, [receiver], mapping=mapping)
    expert = 16 * 8 * 4  # (one expert's share: 16 rows of 8 float32)
    want = ([(None, 0, 4 * expert, (0, 1))] if trainers == "replicas" else
            [(Slice(0, 2 * r, 2 * r + 2), 2 * r * expert, 2 * expert, (r,)) for r in range(2)])
    assert [(p.slice, p.offset, p.nbytes, p.cands) for p in sorted(pieces, key=lambda p: p.offset)] == want
    assert {p.transform for p in pieces} == {"share:2.1.2"}
    check_coverage(plan(senders, [receiver], mapping=mapping), [receiver])
    torn = participant(0, [tensor(dst, full, shard=(1, 12, 24))])
    with pytest.raises(errors.BadTiling, match="not one of equal tensor-parallel shards of each component"):
        build_pieces(senders, [torn], mapping=mapping)
    # a large FSDP group (12 ranks, an expert of 1 MiB each): one write from a rank that gathers, not one per rank
    big = [participant(r, [tensor(src, (12, 512, 512), shard=(0, r, r + 1), gatherable=True)]) for r in range(12)]
    pieces, _ = build_pieces(big, [participant(0, [tensor(dst, (12, 512, 512), shard=(1, 256, 512))])], mapping=mapping)
    assert [(p.slice, p.nbytes, p.transform) for p in pieces] == [(None, 12 << 19, "share:2.1.2")]


def test_colocated_receivers_get_local_nvlink_and_network_bytes_at_once():
    """FSDP trainers on two hosts of 8 GPUs, each with an inference rank on its GPU needing whole
    tensors: its own rows come by a local copy, its host mates' by NVLink, the other host's by the NIC,
    all at once (each class's share of the bytes in proportion to its bandwidth)."""
    link = LinkModel(per_transfer_s=0.0)
    model = {f"w{i}": (1024, 4096) for i in range(8)}  # 64 rows (1 MiB) per rank
    where = [(h, f"cuda:{d}") for h in "ab" for d in range(8)]
    senders = [participant(r, [tensor(k, s, shard=(0, 64 * r, 64 * r + 64), gatherable=True) for k, s in model.items()],
                           host=h, device=d) for r, (h, d) in enumerate(where)]
    receivers = [participant(r, [tensor(k, s) for k, s in model.items()], host=h, device=d)
                 for r, (h, d) in enumerate(where)]
    routing = plan(senders, receivers, link)
    check_coverage(routing, receivers)
    pieces, _ = build_pieces(senders, receivers)
    bound = lower_bound(pieces, senders, receivers, link)
    assert makespan(routing.senders, senders, receivers, link) <= 1.02 * bound


def test_a_senders_lanes_run_at_once_in_the_model():
    """The engine runs a sender's table as one lane per receiver, all at once: sender 1's write to
    receiver 1 does not wait behind its write to receiver 0, whose port sender 0 holds. Replayed as
    one queue per sender (each write waiting for its port in table order) it would end at 3 n/B."""
    link = LinkModel(net_bw=1e9, per_transfer_s=0.0)
    shape = (1024, 256)  # n = 1 MiB in float32
    senders = [participant(0, [tensor("a", shape)], host="s0"),
               participant(1, [tensor("b", shape), tensor("c", shape)], host="s1")]
    receivers = [participant(0, [tensor("a", shape), tensor("b", shape)], host="r0"),
                 participant(1, [tensor("c", shape)], host="r1")]
    pieces, _ = build_pieces(senders, receivers)
    by_name = {p.dst_name: p for p in pieces}
    tables = tables_from_assignment({0: [by_name["a"]], 1: [by_name["b"], by_name["c"]]}, senders, receivers)
    n = 1024 * 256 * 4
    assert makespan(tables.senders, senders, receivers, link) == pytest.approx(2 * n / link.net_bw)
    assert lower_bound(pieces, senders, receivers, link) == pytest.approx(2 * n / link.net_bw)


@pytest.mark.parametrize("n_recv, every_holder", [(2, True), (16, False)])
def test_gathers_that_fit_keep_every_holder_and_others_are_designated(n_recv, every_holder):
    """A 16-rank FSDP group's small parts are gathered (no shard-to-shard). Two receivers of whole
    tensors leave the senders room for a gather per receiver of every tensor: every holder stays a
    candidate. Sixteen receivers of column halves fill the senders' ports: each tensor goes from few
    designated holders (2: a tensor's sends over a fair share of all bytes), since every holder that
    sends it would first gather it."""
    model = {f"w{i}": (256, 256) for i in range(8)}  # 16 rows (16 KiB) per rank
    senders = [participant(r, [tensor(k, s, shard=(0, 16 * r, 16 * r + 16), gatherable=True) for k, s in model.items()],
                           host=f"s{r}") for r in range(16)]
    half = (lambda r: (1, 128 * (r % 2), 128 * (r % 2) + 128)) if n_recv == 16 else (lambda r: None)
    receivers = [participant(r, [tensor(k, s, shard=half(r)) for k, s in model.items()], host=f"r{r}")
                 for r in range(n_recv)]
    pieces, _ = build_pieces(senders, receivers)
    senders_of = {len(p.cands) for p in pieces}
    assert senders_of == ({16} if every_holder else {2})
    routing = plan(senders, receivers, LinkModel())
    check_coverage(routing, receivers)
    if not every_holder:
        for name in model:
            assert len({s for s, t in routing.senders.items() for tr in t.transfers if tr.name == name}) == 2


def test_a_flexible_piece_goes_to_the_candidate_without_forced_work_left():
    """Receiver 1 (the most work left, so it chooses first) may take y from sender 0 or 1, both idle
    and unloaded; only sender 0 can send receiver 0's x. Counting the forced work each candidate still
    has, y goes to sender 1 and both receivers are served at once (2 n/B); by load so far alone the tie
    goes to sender 0 and x waits behind y (3 n/B)."""
    link = LinkModel(net_bw=1e9, per_transfer_s=0.0)
    n = 1024 * 256 * 4  # (1024, 256) float32
    senders = [participant(0, [tensor("x", (1024, 256)), tensor("y", (2048, 256))], host="s0"),
               participant(1, [tensor("y", (2048, 256))], host="s1")]
    receivers = [participant(0, [tensor("x", (1024, 256))], host="r0"),
                 participant(1, [tensor("y", (2048, 256))], host="r1")]
    routing = plan(senders, receivers, link)
    assert [t.name for t in routing.senders[1].transfers] == ["y"]
    assert makespan(routing.senders, senders, receivers, link) == pytest.approx(2 * n / link.net_bw)


def test_forced_work_goes_round_the_receivers():
    """Each of 4 senders alone holds a quarter of w's rows (a non-gatherable shard), and 4 receivers on
    other hosts need all of w: every piece has one candidate. Placed in bulk, receiver i takes its
    senders from sender i on, so each sender's table starts with a different receiver (and not all
    with receiver 0, whose port would be the only one busy while every other lane waits to be issued):
    every step is a matching, and the round ends at the bound."""
    link = LinkModel(net_bw=1e9, per_transfer_s=1e-6)
    shape = (4 * 256, 256)
    senders = [participant(s, [tensor("w", shape, shard=(0, 256 * s, 256 * s + 256))], host=f"s{s}")
               for s in range(4)]
    receivers = [participant(r, [tensor("w", shape)], host=f"r{r}") for r in range(4)]
    routing = plan(senders, receivers, link)
    check_coverage(routing, receivers)
    for s in range(4):  # receiver r has sender r first, r + 1 next, ...: sender s serves s, s - 1, ...
        assert [t.dst_rank for t in routing.senders[s].transfers] == [(s - k) % 4 for k in range(4)]
    pieces, _ = build_pieces(senders, receivers)
    bound = lower_bound(pieces, senders, receivers, link)
    assert makespan(routing.senders, senders, receivers, link) == pytest.approx(bound, rel=1e-3)


def test_a_busy_senders_flexible_work_is_levelled_onto_its_idle_candidate():
    """Sender 0 alone holds a (10 units, for receiver 1), sender 1 alone holds y (4 units each for
    receivers 2 and 3); both hold x (5 units, for receiver 0). Forced work first: sender 1 frees at 8
    units, sender 0 at 10, so the list schedule gives x to sender 1, the one free first, which ends at
    13. Levelling hands the last 1.5 units of x (rows, cut where the two meet) to sender 0: 11.5 each,
    the lower bound (23 units over two ports)."""
    link = LinkModel(net_bw=1e9, per_transfer_s=0.0)
    unit = 256 * 256 * 4  # 256 rows of 256 float32
    a, x, y = tensor("a", (10 * 256, 256)), tensor("x", (5 * 256, 256)), tensor("y", (4 * 256, 256))
    senders = [participant(0, [a, x], host="s0"), participant(1, [x, y], host="s1")]
    receivers = [participant(0, [x], host="r0"), participant(1, [a], host="r1"),
                 participant(2, [y], host="r2"), participant(3, [y], host="r3")]
    options = PlanOptions(min_chunk_bytes=unit, chunks_per_receiver=1)  # (x whole, then cut where it levels)
    pieces, _ = build_pieces(senders, receivers)
    bound = lower_bound(pieces, senders, receivers, link)
    assert bound == pytest.approx(11.5 * unit / link.net_bw)
    unlevelled = plan(senders, receivers, link, PlanOptions(min_chunk_bytes=unit, chunks_per_receiver=1, level=False))
    assert [(t.name, t.dst_rank) for t in unlevelled.senders[1].transfers] == [("y", 2), ("y", 3), ("x", 0)]
    routing = plan(senders, receivers, link, options)
    check_coverage(routing, receivers)
    x_from = sorted((t.slice.start, t.slice.stop, s) for s, tab in routing.senders.items()
                    for t in tab.transfers if t.name == "x")
    assert x_from == [(0, 896, 1), (896, 1280, 0)]
    assert makespan(unlevelled.senders, senders, receivers, link) == pytest.approx(13 * unit / link.net_bw)
    assert makespan(routing.senders, senders, receivers, link) == pytest.approx(11.5 * unit / link.net_bw)


def test_levelling_moves_the_tail_of_a_segment_cut_at_a_row():
    """Sender 0 has 12 units for receiver 0 and 4 for receiver 1, both also sendable by sender 1, which
    has 4 units of its own: 16 against 4. Levelling hands sender 1 the last 6 units of receiver 0's
    segment (rows cut where the two meet), 10 and 10, the moved rows right after the kept ones."""
    from weightsync.engine.plan.levelling import balance
    from weightsync.engine.plan.work import Schedule, Segment
    from weightsync.engine.plan.sources import Piece

    link, row = LinkModel(net_bw=1e9, per_transfer_s=0.0), 1024  # bytes per row; a unit is 256 rows

    def seg(receiver, rows, sender, cands):
        p = Piece(receiver, "w", "w", Slice(0, 0, rows), rows * row, 0, 0, row, "", tuple(sorted(cands)))
        flexible = frozenset(cands) if len(cands) > 1 else frozenset()
        return Segment(receiver, LinkClass.NET, [p], sender, rows * row, flexible)

    segments = [seg(0, 12 * 256, 0, {0, 1}), seg(1, 4 * 256, 0, {0, 1}), seg(2, 4 * 256, 1, {1})]
    balance(Schedule.of(segments, link), link, PlanOptions(min_chunk_bytes=row))
    load = {s: sum(g.nbytes for g in segments if g.sender == s) // (256 * row) for s in (0, 1)}
    assert load == {0: 10, 1: 10}
    to_r0 = sorted((p.slice.start, p.slice.stop, g.sender) for g in segments if g.receiver == 0 for p in g.pieces)
    assert to_r0 == [(0, 6 * 256, 0), (6 * 256, 12 * 256, 1)]
    moved = next(g for g in segments if g.receiver == 0 and g.sender == 1)
    assert moved.start == pytest.approx(6 * 256 * row / link.net_bw)  # after the kept part


def _flexible_segment(receiver, units, sender, cands, start=0.0):
    from weightsync.engine.plan.work import Segment
    from weightsync.engine.plan.sources import Piece

    n = units << 20
    piece = Piece(receiver, f"w{receiver}.{units}.{start}", "w", None, n, 0, 0, 0, "", tuple(sorted(cands)))
    seg = Segment(receiver, LinkClass.NET, [piece], sender, n, frozenset(cands) if len(cands) > 1 else frozenset())
    seg.start = start
    return seg


def test_spreading_moves_a_receivers_second_segment_to_a_sender_with_no_lane_to_it():
    """Sender 0 has two flexible segments for receiver 0 (3 and 1 units), which senders 1 and 2 could
    also send; sender 1 already sends receiver 0 a unit of its own, sender 2 nothing. The smaller
    segment moves to sender 2: receiver 0's largest lane is then 3 units, not 4, and no port is busier
    than sender 0 was. The moved segment keeps its start."""
    from weightsync.engine.plan.levelling import spread
    from weightsync.engine.plan.work import Schedule

    link = LinkModel(net_bw=1e9, per_transfer_s=0.0)
    segments = [_flexible_segment(0, 3, 0, {0, 1, 2}), _flexible_segment(0, 1, 0, {0, 1, 2}, start=0.5),
                _flexible_segment(0, 1, 1, {1})]
    sched = Schedule.of(segments, link)
    assert spread(sched, link) == 1
    assert [(g.sender, g.nbytes >> 20, g.start) for g in segments] == [(0, 3, 0.0), (2, 1, 0.5), (1, 1, 0.0)]
    assert sched.sending == {(0, LinkClass.NET): pytest.approx(3 * 2**20 / 1e9),
                             (1, LinkClass.NET): pytest.approx(2**20 / 1e9), (2, LinkClass.NET): pytest.approx(2**20 / 1e9)}


def test_spreading_never_makes_a_lane_or_a_port_larger():
    """As above, but sender 2 already sends receiver 0 three units of its own (a lane as large as
    sender 0's would become) and sender 1 would end busier than sender 0 was: nothing moves."""
    from weightsync.engine.plan.levelling import spread
    from weightsync.engine.plan.work import Schedule

    link = LinkModel(net_bw=1e9, per_transfer_s=0.0)
    segments = [_flexible_segment(0, 3, 0, {0, 1, 2}), _flexible_segment(0, 1, 0, {0, 1, 2}, start=0.5),
                _flexible_segment(1, 4, 1, {1}), _flexible_segment(0, 3, 2, {2})]
    sched = Schedule.of(segments, link)
    assert spread(sched, link) == 0
    assert [g.sender for g in segments] == [0, 0, 1, 2]


def test_levelling_never_cuts_what_cannot_be_cut():
    """A segment of one piece that cannot be split (no row size) either moves whole or stays, even with
    no floor on a part's size: 3 units against 0 moves nothing (whole, it would end at 3 too)."""
    from weightsync.engine.plan.levelling import balance
    from weightsync.engine.plan.work import Schedule, Segment
    from weightsync.engine.plan.sources import Piece

    link, n = LinkModel(net_bw=1e9, per_transfer_s=0.0), 3 << 20
    piece = Piece(0, "w", "w", None, n, 0, 0, 0, "", (0, 1))
    segments = [Segment(0, LinkClass.NET, [piece], 0, n, frozenset({0, 1})),
                Segment(1, LinkClass.NET, [Piece(1, "v", "v", None, 1, 0, 0, 0, "", (0,))], 0, 1)]
    balance(Schedule.of(segments, link), link, PlanOptions(min_chunk_bytes=0))
    assert [(g.sender, g.nbytes) for g in segments] == [(0, n), (0, 1)]


def test_the_engines_gather_windows_are_timed_beside_each_senders_own_pulls():
    """Two FSDP ranks gather for a cast row-parallel slice: rank 1 parameters a and b, rank 0 c. Each
    pulls its own back to back (``gather_s``); the engine's ``Gatherer`` pulls in windows, one after
    another (``windowed_gather_s``), the smallest first: with room for all three, (a, b), then c
    (three times a's size: another size class); with a budget of a byte, each rank one parameter a
    window: (a), then (b, c). Gathering in the windows (``gathering="windows"``), a transfer waits for
    its window's end."""
    link = LinkModel(host_bw=1e6, per_transfer_s=0.0)
    shapes = {"a": (64, 256), "b": (128, 256), "c": (192, 256)}
    senders = [participant(r, [tensor(n, s, shard=(0, s[0] // 2 * r, s[0] // 2 * (r + 1)), gatherable=True)
                               for n, s in shapes.items()], host="t") for r in range(2)]
    receivers = [participant(0, [tensor(n, s, dtype="float16", shard=(1, 0, 128)) for n, s in shapes.items()],
                             host="i")]
    pieces, _ = build_pieces(senders, receivers)
    assert {p.src_name: p.cands for p in pieces} == {"a": (1,), "b": (1,), "c": (0,)}  # (designated by bytes)
    routing = tables_from_assignment({s: [p for p in pieces if p.cands == (s,)] for s in (0, 1)}, senders, receivers)
    pull = {n: s[0] // 2 * 256 * 4 / link.host_bw for n, s in shapes.items()}  # the other rank's half
    for budget, windowed in ((1 << 30, sum(pull.values())), (1, pull["a"] + max(pull["b"], pull["c"]))):
        stats: dict = {}
        queues = makespan(routing.senders, senders, receivers, link, stats, gather_budget=budget)
        assert stats["gather_s"] == pytest.approx(max(pull["a"] + pull["b"], pull["c"]))
        assert stats["windowed_gather_s"] == pytest.approx(windowed)
        windows = makespan(routing.senders, senders, receivers, link, gather_budget=budget, gathering="windows")
        assert windows >= windowed and queues >= stats["gather_s"]  # (the last transfer follows its gather)
        assert (windows > queues) == (windowed > stats["gather_s"])
