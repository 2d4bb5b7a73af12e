"""FSDP gather windows: which parameters the ranks of a mesh gather at once (pure)."""

from weightsync.engine.plan.windows import Need, gather_windows


def _need(group, ranks, budgets, world=3):
    return Need(group, 0, list(ranks), [(0, 1)] * world, budgets)


def test_windows_fill_each_ranks_budget_keep_sizes_alike_and_collectives_alone():
    g, h = object(), object()
    budgets = [200, 200, 600]  # (a window takes at most half: 100, 100, 300)
    needs = {"a": _need(g, [0], budgets), "b": _need(g, [1], budgets), "c": _need(g, [0], budgets),
             "d": _need(g, [2], budgets), "e": _need(g, [0, 1, 2], budgets), "f": _need(g, [2], budgets),
             "g": _need(g, [0], budgets), "x": None, "h": _need(h, [1], budgets)}
    sizes = {"a": 30, "b": 30, "c": 40, "d": 55, "e": 58, "f": 60, "g": 110, "x": 115, "h": 116}
    order = list(sizes)  # (the smallest first, as the Gatherer takes them)
    # a + c are rank 0's 70 of 100; e (every rank) alone; g is over rank 0's half budget, so alone on
    # rank 0 but with f of rank 2 (and within twice f's size); x (another mesh: full_tensor) alone; h
    # of another group apart
    assert gather_windows(order, sizes, needs) == [("a", "b", "c", "d"), ("e",), ("f", "g"), ("x",), ("h",)]
    budgets[0] = 140  # rank 0's half: 70
    sizes["c"] = 41  # 30 + 41 > 70
    assert gather_windows(order, sizes, needs)[:2] == [("a", "b"), ("c", "d")]
    sizes["c"], sizes["d"] = 40, 61  # more than twice the window's first (30): a window ends with its slowest
    assert gather_windows(order, sizes, needs)[:2] == [("a", "b", "c"), ("d",)]
    sizes["d"], sizes["f"] = 200, 100  # rank 2's own budget (300) holds d + f (300 bytes); 101 would not
    assert gather_windows(["d", "f"], sizes, needs) == [("d", "f")]
    sizes["f"] = 101
    assert gather_windows(["d", "f"], sizes, needs) == [("d",), ("f",)]
    assert gather_windows([], sizes, needs) == []
