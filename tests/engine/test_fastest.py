"""engine.cuda.fastest.Trials: which way of copying a link's rows runs next, and which is kept."""

import pytest

from weightsync.engine.cuda.fastest import Trials
from weightsync.engine.errors import ConfigError
from weightsync.engine.transport import TransportOptions


def run(trials: Trials, seconds: dict[str, list[float]]) -> list[str]:
    """Drive ``trials`` as replays would, each way taking its next time from ``seconds``; the ways run."""
    ran, left = [], {n: list(t) for n, t in seconds.items()}
    while trials.chosen is None:
        way = trials.next()
        ran.append(way)
        trials.record(way, left[way].pop(0))
    return ran


def test_ways_alternate_first_timings_are_dropped_and_the_lowest_median_is_kept():
    trials = Trials(("kernel", "dma"), samples=2)
    # the kernel's first timing includes its compile (9 s): dropped; then 3 and 6 ms against 4 and 4
    ran = run(trials, {"kernel": [9.0, 0.003, 0.006], "dma": [0.001, 0.004, 0.004]})
    assert ran == ["kernel", "dma"] * 3
    assert trials.seconds == {"kernel": [0.003, 0.006], "dma": [0.004, 0.004]}
    assert trials.chosen == "dma"  # medians 4.5 ms against 4 ms
    assert trials.next() == "dma"
    trials.record("kernel", 0.0)  # timings after the choice change nothing
    assert trials.chosen == "dma"


def test_a_tie_keeps_the_first_way_named():
    trials = Trials(("kernel", "dma"), samples=1)
    run(trials, {"kernel": [1.0, 0.002], "dma": [1.0, 0.002]})
    assert trials.chosen == "kernel"


def test_the_faster_way_is_kept_whatever_its_order():
    for first, second in (("kernel", "dma"), ("dma", "kernel")):
        trials = Trials((first, second), samples=3)
        run(trials, {first: [0, 0.010, 0.011, 0.009], second: [0, 0.002, 0.030, 0.003]})
        assert trials.chosen == second  # median 3 ms against 10 ms (one slow outlier does not decide)


def test_one_way_is_chosen_at_once_and_no_way_is_refused():
    assert Trials(("dma",)).chosen == "dma"
    with pytest.raises(ValueError):
        Trials(())
    with pytest.raises(ValueError):
        Trials(("a", "b"), samples=0)


def test_an_unknown_peer_copies_mode_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="peer_copies"):
        TransportOptions(peer_copies="nvlink")
    assert TransportOptions().peer_copies == "fastest"


def test_a_way_costs_the_longer_of_its_device_time_and_its_host_issue_time():
    from weightsync.engine.cuda.fastest import cost

    assert cost(0.004, 0.001) == 0.004  # the copies outlast their issue
    assert cost(0.0005, 0.003) == 0.003  # a 2-D copy call per row: the host is the bottleneck


@pytest.mark.parametrize("grid", [(2.0,), (1.0, -1.0), (1.0, "4"), [2.0, 4.0], (True, 1.0)])
def test_a_bad_kernel_grid_is_a_config_error_naming_the_field(grid):
    with pytest.raises(ConfigError, match="kernel_grid"):
        TransportOptions(kernel_grid=grid)
    assert TransportOptions(kernel_grid=(0, 3.5)).kernel_grid == (0, 3.5)  # (0: a program per piece)


def test_copy_kernels_share_the_gpu_only_where_the_sender_copies_to_another_target_too():
    """A bounded grid (``kernel_grid`` programs per SM) lets a sender's copy into its own GPU and its copy
    into another run at once; with a single target, the kernel keeps a program per piece (a bound grid
    would only slow a lone copy)."""
    from weightsync.engine.transports.cuda_ipc_tables import grid_per_sm

    grid = (2.0, 4.0)
    assert grid_per_sm(0, 0, {0}, grid) == 0.0  # 1 -> 1 colocated
    assert grid_per_sm(0, 1, {1}, grid) == 0.0  # 1 -> 1 into another GPU
    assert grid_per_sm(0, 0, {0, 1}, grid) == 2.0  # 2 -> 2 colocated: the same GPU's share
    assert grid_per_sm(0, 1, {0, 1}, grid) == 4.0  # ... and the other GPU's
    assert grid_per_sm(0, 1, {1, 2}, grid) == 4.0  # two other GPUs at once
    assert grid_per_sm(0, 1, {0, 1}, (0.0, 0.0)) == 0.0  # (0: a program per piece, asked for)
