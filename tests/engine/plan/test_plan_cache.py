"""PlanCache: a replan with the same senders reuses their index and the receiver layouts resolved,
and its tables are exactly those of a plan made from scratch."""

from __future__ import annotations

import dataclasses

import pytest

from weightsync.engine import errors
from weightsync.engine.models.shapes import ParamShape
from weightsync.engine.plan import LinkModel, Participant, PlanCache, PlanOptions, plan
from weightsync.engine.plan.needs import Piece, Resolver, index_sources
from weightsync.engine.plan.trainer import TrainerLayout, holdings
from plan_helpers import check_coverage, participant, tensor

MODEL = {"embed": (256, 64), "w1": (128, 64), "w2": (64, 128), "experts": (16, 32, 32), "norm": (64,)}


def _senders(n=4, model=MODEL):
    """FSDP ranks (gatherable dim-0 shards) of the dense tensors; each holds its own experts alone."""
    out = []
    for r in range(n):
        ts = []
        for name, shape in model.items():
            rows = shape[0] // n
            ts.append(tensor(name, shape, shard=(0, rows * r, rows * r + rows), gatherable=name != "experts"))
        out.append(participant(r, ts, host=f"t{r}"))
    return out


def _receiver(rank, tp=2, model=MODEL, host=None):
    """TP ranks: w1 by rows, w2 by columns, experts by expert over EP = TP."""
    def part(dim, name):
        size = model[name][dim] // tp
        return (dim, size * (rank % tp), size * (rank % tp) + size)

    cut = {"w1": part(0, "w1"), "w2": part(1, "w2"), "experts": part(0, "experts")}
    return participant(rank, [tensor(name, shape, shard=cut.get(name)) for name, shape in model.items()],
                       host=host or f"i{rank}")


def test_a_replan_after_a_receiver_restarts_reuses_the_senders_and_layouts():
    senders, receivers = _senders(), [_receiver(r) for r in range(4)]
    cache, link = PlanCache(), LinkModel()
    first = plan(senders, receivers, link, cache=cache)
    assert first == plan(senders, receivers, link)
    layouts = cache.layouts
    receivers[3] = _receiver(3, host="t3")  # a new manifest object, the same layout, on a trainer's host
    again = plan(senders, receivers, link, cache=cache)
    assert again == plan(senders, receivers, link)
    check_coverage(again, receivers)
    assert (cache.hits, cache.misses) == (1, 1)
    assert cache.layouts == layouts  # nothing resolved again
    assert "hits=1 misses=1" in repr(cache)


def test_a_new_receiver_layout_is_resolved_once_and_kept():
    senders, cache, link = _senders(), PlanCache(), LinkModel()
    plan(senders, [_receiver(r, tp=2) for r in range(2)], link, cache=cache)
    before = cache.layouts
    wider = [_receiver(r, tp=4) for r in range(4)]  # layouts of TP 4 (ranks 2 and 3 are new)
    assert plan(senders, wider, link, cache=cache) == plan(senders, wider, link)
    assert cache.hits == 1 and cache.layouts > before


def test_a_sender_with_other_tensors_or_other_rules_index_again():
    senders, receivers, cache, link = _senders(), [_receiver(r) for r in range(4)], PlanCache(), LinkModel()
    plan(senders, receivers, link, cache=cache)
    senders[1] = participant(1, [*senders[1].manifest.tensors, tensor("extra", (8,))], host="t1")
    assert plan(senders, receivers, link, cache=cache) == plan(senders, receivers, link)
    assert (cache.hits, cache.misses) == (0, 2)
    plan(senders, receivers, link, cache=cache, transforms={("embed", "float32"): "cast"})
    assert cache.misses == 3


def test_a_failed_index_leaves_nothing_behind():
    """Senders that cannot be indexed (two ranks claim overlapping expert rows) raise, and the cache
    holds nothing of them: the next plan indexes again."""
    senders, receivers, cache = _senders(), [_receiver(r) for r in range(4)], PlanCache()
    bad = list(senders)
    bad[1] = participant(1, [tensor("experts", MODEL["experts"], shard=(0, 0, 8))], host="t1")
    with pytest.raises(errors.BadTiling):
        plan(bad, receivers, LinkModel(), cache=cache)
    assert plan(senders, receivers, LinkModel(), cache=cache) == plan(senders, receivers, LinkModel())
    assert (cache.hits, cache.misses) == (0, 2)


def _restarted(p, host=None, device=None, nbytes=None):
    """The same rank's new process: a new manifest object (equal tensors), a new address and region
    descriptors; optionally on another host or device, or with another region size."""
    regions = tuple(dataclasses.replace(r, descriptor=b"new", nbytes=nbytes or r.nbytes) for r in p.manifest.regions)
    manifest = dataclasses.replace(p.manifest, tensors=tuple(p.manifest.tensors), regions=regions)
    transport = dataclasses.replace(p.transport, address="h:1234", host=host or p.transport.host,
                                    device=device or p.transport.device)
    return Participant(p.rank, manifest, transport)


def test_a_restarted_receiver_the_planner_cannot_tell_apart_patches_the_last_plan():
    senders, receivers = _senders(), [_receiver(r) for r in range(4)]
    cache, link = PlanCache(), LinkModel()
    first = plan(senders, receivers, link, plan_id=1, cache=cache)
    receivers[2] = _restarted(receivers[2])
    again = plan(senders, receivers, link, plan_id=2, cache=cache)
    assert again == plan(senders, receivers, link, plan_id=2)  # what a plan from scratch makes
    assert cache.patched == 1 and (cache.hits, cache.misses) == (0, 1)
    assert again.plan_id == 2 and again.receivers == first.receivers
    for s, table in again.senders.items():
        names_it = any(p.rank == 2 for p in table.peers)
        assert (table is first.senders[s]) != names_it  # only the tables naming the restarted receiver change
        assert table.transfers is first.senders[s].transfers
    assert "patched=1" in repr(cache)


def test_a_restarted_sender_with_the_same_tensors_where_it_was_keeps_the_tables_and_the_index():
    senders, receivers = _senders(), [_receiver(r) for r in range(4)]
    cache, link = PlanCache(), LinkModel()
    first = plan(senders, receivers, link, plan_id=1, cache=cache)
    senders[1] = _restarted(_senders()[1])  # a new process: a new manifest object and address
    again = plan(senders, receivers, link, plan_id=2, cache=cache)
    assert again == plan(senders, receivers, link, plan_id=2)
    assert (cache.patched, cache.hits, cache.misses) == (1, 0, 1)
    assert all(again.senders[s] is first.senders[s] for s in again.senders) and again.plan_id == 2
    receivers[3] = _restarted(receivers[3], host="t3")  # onto a trainer's host (planned again: the index is kept)
    assert plan(senders, receivers, link, plan_id=3, cache=cache) == plan(senders, receivers, link, plan_id=3)
    assert (cache.patched, cache.hits, cache.misses) == (1, 1, 1)


def test_a_receiver_back_on_another_host_with_no_sender_on_either_patches_the_last_plan():
    """The planner reads where a receiver is only as each sender's link class to it: an inference worker
    that comes back on another inference host (another GPU there too) is reached as before."""
    senders, receivers = _senders(), [_receiver(r) for r in range(4)]
    cache, link = PlanCache(), LinkModel()
    first = plan(senders, receivers, link, plan_id=1, cache=cache)
    receivers[2] = _restarted(receivers[2], host="i-spare", device="cuda:5")
    again = plan(senders, receivers, link, plan_id=2, cache=cache)
    assert cache.patched == 1 and again == plan(senders, receivers, link, plan_id=2)
    assert again.receivers == first.receivers
    assert {p.transport.host for t in again.senders.values() for p in t.peers if p.rank == 2} == {"i-spare"}


def test_a_sender_back_on_another_host_with_no_receiver_on_either_keeps_the_tables():
    senders, receivers = _senders(), [_receiver(r) for r in range(4)]
    cache, link = PlanCache(), LinkModel()
    first = plan(senders, receivers, link, plan_id=1, cache=cache)
    senders[1] = _restarted(_senders()[1], host="t-spare")
    receivers[0] = _restarted(receivers[0], host="i-spare")  # (both at once: every pair's class is looked at)
    again = plan(senders, receivers, link, plan_id=2, cache=cache)
    assert (cache.patched, cache.hits, cache.misses) == (1, 0, 1)
    assert again == plan(senders, receivers, link, plan_id=2) and again.receivers == first.receivers
    senders[1] = _restarted(_senders()[1], host="i-spare")  # now on receiver 0's host: planned again
    assert plan(senders, receivers, link, plan_id=3, cache=cache) == plan(senders, receivers, link, plan_id=3)
    assert cache.patched == 1


@pytest.mark.parametrize("change", ["host", "device", "region size", "tensors", "options", "sender host",
                                    "sender tensors"])
def test_what_the_planner_reads_differently_plans_again(change):
    senders, receivers = _senders(), [_receiver(r) for r in range(4)]
    if change == "device":  # receiver 1 on sender 1's GPU (a local copy), until it comes back on another GPU
        senders[1] = _restarted(senders[1], device="cuda:1")
        receivers[1] = _restarted(_receiver(1, host="t1"), device="cuda:1")
    cache, link = PlanCache(), LinkModel()
    plan(senders, receivers, link, cache=cache)
    options = PlanOptions()
    if change == "host":
        receivers[1] = _restarted(receivers[1], host="t0")  # onto a trainer's host: sender 0 is now a host-mate
    elif change == "device":
        receivers[1] = _restarted(receivers[1], device="cuda:3")
    elif change == "region size":
        receivers[1] = _restarted(receivers[1], nbytes=receivers[1].manifest.regions[0].nbytes + 64)
    elif change == "tensors":
        receivers[1] = _receiver(1, tp=4)
    elif change == "options":
        options = PlanOptions(chunks_per_receiver=2)
    elif change == "sender host":
        senders[0] = _restarted(_senders()[0], host="i1")  # a restarted sender on receiver 1's host
    else:
        senders[0] = participant(0, [*senders[0].manifest.tensors, tensor("extra", (8,))], host="t0")
    again = plan(senders, receivers, link, options, cache=cache)
    assert cache.patched == 0
    assert again == plan(senders, receivers, link, options)


def _layered_senders():
    """8 trainer ranks in 2 pipeline stages (layers 0-1, 2-3), FSDP inside a stage (a scalar: replicated)
    and the fused experts split over EP 2: tensors of equal shapes that different ranks hold, or hold
    differently (the routers of a stage: the same ranks, cut at other rows)."""
    params = [ParamShape(f"model.layers.{i}.{kind}", shape, "float32") for i in range(4) for kind, shape in (
        ("self_attn.q_proj.weight", (64, 64)), ("self_attn.k_proj.weight", (64, 64)),
        ("self_attn.v_proj.weight", (64, 64)), ("mlp.experts.down_proj", (8, 32, 32)),
        ("mlp.down_proj.weight", (128, 128)), ("self_attn.scale", ()))]
    layout = TrainerLayout(8, pp=2, ep=2)
    cuts = ([0, 4, 8, 12, 16], [0, 2, 8, 14, 16])  # the router of odd layers is cut elsewhere, same holders
    return [participant(r, [*(tensor(p.name, p.shape, shard=None if shard is None else
                                     (shard.dim, shard.start, shard.stop), gatherable=gatherable)
                              for p, shard, gatherable in holdings(params, r, layout)),
                            *(tensor(f"model.layers.{i}.mlp.gate.weight", (16, 64), gatherable=True,
                                     shard=(0, cuts[i % 2][r % 4], cuts[i % 2][r % 4 + 1])) for i in range(4)
                              if i // 2 == r // 4)], host=f"t{r}")
            for r in range(8)]


def _layered_receiver(rank):
    """TP 2 with q, k and v fused (the llama rule: three sources a tensor), experts by EP, and the MLP's
    down_proj in block FP8 with its scales."""
    i = rank % 2
    out = []
    for layer in range(4):
        p = f"model.layers.{layer}."
        out += [tensor(p + "self_attn.qkv_proj.weight", (192, 64), shard=(0, 96 * i, 96 * i + 96)),
                tensor(p + "mlp.experts.down_proj", (8, 32, 32), shard=(0, 4 * i, 4 * i + 4)),
                tensor(p + "mlp.down_proj.weight", (128, 128), dtype="float8_e4m3fn", shard=(1, 64 * i, 64 * i + 64)),
                tensor(p + "mlp.down_proj.weight_scale_inv", (1, 1)), tensor(p + "self_attn.scale", ()),
                tensor(p + "mlp.gate.weight", (16, 64))]
    return participant(rank, out, host=f"i{rank}")


class _EachMadeAfresh(Resolver):
    """Every name its own kind: each tensor layout's templates made from its own sources, nothing taken
    from another name's."""

    def _kind(self, name):
        return name, self.rules.recipe(name)[1]


def test_tensors_alike_but_for_their_names_share_templates_and_the_pieces_are_those_made_afresh():
    senders, receivers = _layered_senders(), [_layered_receiver(r) for r in range(4)]
    shared = Resolver(index_sources(senders), mapping="llama")
    got = shared.pieces((p.rank, p.manifest) for p in receivers)
    afresh = _EachMadeAfresh(index_sources(senders), mapping="llama")
    want = afresh.pieces((p.rank, p.manifest) for p in receivers)

    assert got == want and len(got) > 0 and all(type(p) is Piece for p in got)
    # the two layers of a stage share (q, k, v and the scales too, not the routers); the stages hold them on
    # other ranks
    assert len(afresh.templates) == 40 and len(shared.templates) == 22
    assert {p.cands for p in got if ".layers.0." in p.src_name}.isdisjoint(
        {p.cands for p in got if ".layers.2." in p.src_name})


class _Walks(Resolver):
    """Counts the receivers whose facts by name are worked out (the others reuse those of the one before)."""

    walks = 0

    def _facts(self, *args):
        self.walks += 1
        return super()._facts(*args)


def _tied(p, name, to):
    """``p`` with tensor ``name`` tied to ``to`` (same names and dtypes: only the tie differs)."""
    tensors = [dataclasses.replace(t, tied_to=to, offset=0) if t.name == name else t for t in p.manifest.tensors]
    return participant(p.rank, tensors, host=p.transport.host)


def test_receivers_with_the_same_names_share_what_depends_on_names_and_get_the_pieces_made_alone():
    """A receiver whose tensors have the names, dtypes and ties of the one before reuses what was worked
    out by name (kind, sources, block scales' weight); one whose ties differ is walked again: its tied
    tensor moves under the name it is tied to, once. A receiver of a layout resolved before (receiver 3
    is receiver 1's TP rank, tied alike) takes that layout's rows: it is not walked at all."""
    senders = _layered_senders()
    gate = "model.layers.{}.mlp.gate.weight"
    receivers = [_layered_receiver(0), _layered_receiver(1), _tied(_layered_receiver(2), gate.format(1), gate.format(0)),
                 _layered_receiver(3)]
    index = index_sources(senders)
    shared = _Walks(index, mapping="llama")
    got = shared.pieces((p.rank, p.manifest) for p in receivers)
    want = [piece for p in receivers for piece in Resolver(index, mapping="llama").pieces([(p.rank, p.manifest)])]
    assert got == want
    assert shared.walks == 2  # receiver 1 is alike receiver 0 by name; receiver 2's tie differs; 3 is 1's layout
    assert not any(p.receiver == 2 and p.dst_name == gate.format(1) for p in got)
    assert any(p.receiver == 3 and p.dst_name == gate.format(1) for p in got)
