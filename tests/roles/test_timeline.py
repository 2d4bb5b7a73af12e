"""Round timelines (``roles.timeline``): marks merged on one clock, and many rounds' medians."""

from __future__ import annotations

import pytest

from weightsync.roles.timeline import Timeline, hops, medians, merge


def test_medians_take_each_event_over_the_rounds_it_appears_in_in_time_order():
    rounds = []
    for start, (push, heard, commit) in ((10.0, (0.001, 0.002, 0.004)), (20.0, (0.003, 0.001, 0.005)),
                                         (30.0, (0.002, 0.003, 0.009))):
        sender, controller = Timeline(), Timeline()
        sender.mark(7, "send:push", start + push)
        controller.mark(7, "recv:push", start + heard)
        sender.mark(7, "recv:commit", start + commit)
        sender.mark(7, "send:push", start + 1.0)  # (the first mark of an event wins)
        rounds.append(merge(start, {"sender": sender.of(7), "controller": controller.of(7)}))
    rounds.append([(3.0, "controller recv:push")])  # (a round that marked one event only)
    got = medians(rounds)
    assert [event for event, _ in got] == ["sender send:push", "controller recv:push", "sender recv:commit"]
    assert [ms for _, ms in got] == pytest.approx([2.0, 2.5, 5.0])
    assert [step for _, step in hops([(ms, event) for event, ms in got])] == pytest.approx([0.5, 2.5])


def test_push_wait_runs_from_the_push_armed_or_not_to_the_commit():
    from weightsync.roles.timeline import push_wait

    assert push_wait({"send:armed_push": 1.0, "recv:commit": 1.5}) == 0.5
    assert push_wait({"send:push": 2.0, "recv:begin": 2.1, "recv:commit": 2.75}) == 0.75
    assert push_wait({"recv:begin": 3.0, "recv:commit": 3.5}) == 0.0  # (a round it did not push for)
