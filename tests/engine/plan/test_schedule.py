"""The list schedule (``engine/plan/schedule.py``) against plain versions of its rules: each port's busy
time as its work sums, forced work placed chunk by chunk, and flexible work by a list schedule that
tries every free receiver at every event."""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.engine.plan import LinkClass, LinkModel, PlanOptions, build_pieces, link_class
from weightsync.engine.plan.planner import group_by_locality
from weightsync.engine.plan.schedule import _ClassSchedule, _Stream, schedule
from weightsync.engine.plan.sources import Piece, ranges
from weightsync.wire import Slice
from plan_helpers import mixed_locality


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_locality(), st.integers(1, 64), st.booleans())
def test_the_schedule_keeps_each_ports_busy_time_as_its_work_sums(scenario, min_chunk, prefer):
    """Levelling reads each port's busy time from the schedule, which sums it as it places work:
    exactly what summing its forced runs and segments in their order gives (as ``Schedule.of``)."""
    senders, receivers, link = scenario
    pieces, _ = build_pieces(senders, receivers)
    options = PlanOptions(min_chunk_bytes=min_chunk * 16, chunks_per_receiver=4)
    sched = schedule(group_by_locality(pieces, senders, receivers, prefer, link), link, options)
    sender_of, receiver_of = {p.rank: p for p in senders}, {p.rank: p for p in receivers}
    sending, receiving = defaultdict(float), defaultdict(float)
    forced = [(start, s, r, pieces) for runs in sched.forced
              for start, r, s, pieces in zip(runs.start.tolist(), runs.receiver.tolist(), runs.sender.tolist(),
                                             runs.pieces)]
    flexible = [(g.start, g.sender, g.receiver, g.pieces) for g in sched.segments]
    for sums, port, work in ((sending, 1, forced), (receiving, 2, sorted(forced, key=lambda w: (w[2], w[0]))),
                             (sending, 1, flexible), (receiving, 2, flexible)):  # (in the order placed)
        for w in work:
            s, r, pieces = w[1:]
            cls = link_class(sender_of[s], receiver_of[r]) if prefer else LinkClass.NET
            sums[w[port], cls] += sum(p.nbytes for p in pieces) / link.bandwidth(cls, s, r)
    assert {k: v for k, v in sched.sending.items() if v} == dict(sending)
    assert {k: v for k, v in sched.receiving.items() if v} == dict(receiving)


def _forced_chunk_by_chunk(one):
    """The forced placement as a plain loop, chunk by chunk (``_ClassSchedule._place_forced``'s rule):
    (runs as (start, receiver, sender, pieces), each port's busy time, when each port frees)."""
    by_r: dict[int, dict[int, list]] = {}
    for r, s, pieces in zip(one.forced_r.tolist(), one.forced_s.tolist(),
                                 ranges(one.pool, one.forced_first, one.forced_count)):
        by_r.setdefault(r, {})[s] = list(pieces)
    load, received = dict.fromkeys(one.senders, 0.0), dict.fromkeys(one.receivers, 0.0)
    runs, free_at = [], {}
    for i, r in enumerate(one.receivers):
        if r not in by_r:
            continue
        ranks, t, bw_r = sorted(by_r[r]), 0.0, one.bw_r[r]
        for s in ranks[i % len(ranks):] + ranks[:i % len(ranks)]:
            st = _Stream(frozenset((s,)), by_r[r][s])
            while not st.empty:
                pieces, nbytes = st.take(one.quantum[r], one.options.min_chunk_bytes)
                data = nbytes / min(one.bw_s[s], bw_r)
                load[s] += data
                received[r] += data
                runs.append((t, r, s, pieces))
                t += max(data, len(pieces) * one.link.per_transfer_s)
        free_at[(-1, r)] = t
    free_at.update(((s, -1), t) for s, t in load.items() if t)
    return runs, load, received, free_at


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_locality(), st.integers(1, 64), st.sampled_from([0.0, 1e-6]))
def test_forced_work_is_placed_on_columns_as_chunk_by_chunk(scenario, min_chunk, per_transfer):
    """``_place_forced`` works on columns (numpy): every run, its start, and every port's busy time
    and free time are exactly those of placing the forced streams chunk by chunk, streams longer than
    a receiver's chunk cut as ``_Stream.take`` cuts them (a small ``min_chunk`` makes such cuts), and
    receivers in any order (spread receivers come after the others in ``groups``)."""
    senders, receivers, link = scenario
    link = dataclasses.replace(link, per_transfer_s=per_transfer)
    options = PlanOptions(min_chunk_bytes=min_chunk * 16, chunks_per_receiver=4)
    pieces, _ = build_pieces(senders, receivers)
    for cls, groups in group_by_locality(pieces, senders, receivers, True, link).items():
        want = _forced_chunk_by_chunk(_ClassSchedule(cls, groups, link, options))
        one = _ClassSchedule(cls, groups, link, options)
        runs, free_at = one._place_forced()
        got = list(zip(runs.start.tolist(), runs.receiver.tolist(), runs.sender.tolist(), runs.pieces))
        assert (got, one.load, one.received, free_at) == want


# --- property: the flexible list schedule is the plain one -------------------------------------------


@st.composite
def contended(draw):
    """One link class's streams, as ``group_by_locality`` gives them (receiver -> candidate tuple ->
    pieces), with few senders for many receivers, candidates that overlap, sizes that tie (events at
    the same time), splittable and whole pieces, and forced streams among the flexible ones."""
    senders = sorted(draw(st.sets(st.integers(0, 11), min_size=1, max_size=6)))
    groups = {}
    for r in draw(st.sets(st.integers(0, 11), min_size=1, max_size=7)):
        streams: dict[tuple[int, ...], list[Piece]] = {}
        for _ in range(draw(st.integers(0, 5))):
            cands = tuple(sorted(draw(st.sets(st.sampled_from(senders), min_size=1, max_size=len(senders)))))
            for k in range(draw(st.integers(1, 3))):
                row, rows = draw(st.sampled_from([0, 16, 48])), draw(st.integers(1, 6))
                nbytes = row * rows if row else draw(st.sampled_from([32, 96, 160]))
                piece = Piece(r, f"d{len(streams)}.{k}", "src", Slice(0, 0, rows) if row else None, nbytes, 0, 0,
                              row, "", cands)
                streams.setdefault(cands, []).append(piece)
        groups[r] = streams
    link = LinkModel(net_bw=draw(st.sampled_from([16.0, 48.0])), per_transfer_s=draw(st.sampled_from([0.0, 0.5])))
    return groups, link


def _plain_list_schedule(one):
    """Flexible work as the rule says, without the schedule's shortcuts (who is woken by whom, senders
    as bits): at every event each free receiver with flexible work left, most work left first, takes of
    its largest stream with a free candidate the candidate with the least work, and its next chunk.
    Segments as (start, sender, receiver, pieces, bytes), and each port's busy time."""
    forced, free_at = one._place_forced()
    events = [(t, s, r) for (s, r), t in free_at.items()]
    heapq.heapify(events)
    free_s = {s for s in one.senders if (s, -1) not in free_at}
    busy_r = {r for (s, r) in free_at if s == -1}
    out, now = [], 0.0
    while True:
        for r in sorted((r for r in one.flex if one.flex[r] and r not in busy_r), key=lambda r: (-one.left[r], r)):
            streams = one.flex[r]
            st_ = next((st_ for st_ in streams if st_.cands & free_s), None)
            if st_ is None:
                continue
            s = min(st_.cands & free_s, key=lambda s: (one.load[s], s))
            pieces, nbytes = st_.take(one.quantum[r], one.options.min_chunk_bytes)
            streams.remove(st_)
            if not st_.empty:
                streams.append(st_)
                streams.sort(key=lambda x: (-x.nbytes, x.seq))
            data = nbytes / min(one.bw_s[s], one.bw_r[r])
            one.load[s] += data
            one.received[r] += data
            one.left[r] -= nbytes / one.bw_r[r]
            out.append((now, s, r, pieces, nbytes))
            free_s.discard(s)
            busy_r.add(r)
            heapq.heappush(events, (now + max(data, len(pieces) * one.link.per_transfer_s), s, r))
        if not events:
            return out, one.load, one.received
        now = events[0][0]
        while events and events[0][0] <= now:
            _, s, r = heapq.heappop(events)
            if s >= 0:
                free_s.add(s)
            busy_r.discard(r)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contended(), st.integers(1, 4), st.sampled_from([2, 8]))
def test_the_list_schedule_is_the_plain_one(instance, chunks, min_chunk):
    """The schedule retries a waiting receiver only when a sender its streams still name frees, and
    finds a stream's free candidates by integer bits: the same segments, starts and port sums as
    trying every free receiver against every stream at every event."""
    groups, link = instance
    options = PlanOptions(min_chunk_bytes=min_chunk, chunks_per_receiver=chunks)

    def fresh():  # (taking cuts a stream's pieces in place)
        return {r: {c: list(p) for c, p in g.items()} for r, g in groups.items()}

    want = _plain_list_schedule(_ClassSchedule(LinkClass.NET, fresh(), link, options))
    one = _ClassSchedule(LinkClass.NET, fresh(), link, options)
    segments, _ = one.run()
    got = [(g.start, g.sender, g.receiver, g.pieces, g.nbytes) for g in segments]
    assert (got, one.load, one.received) == want
