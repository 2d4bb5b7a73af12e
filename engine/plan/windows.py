"""FSDP gather windows (pure): which parameters the ranks of a mesh gather at once.

How this works: ``engine.transforms.gather.Gatherer`` gathers, per round, the full tensors that some
rank's routing table reads outside its own shard. Every rank of the mesh knows, after one exchange,
who needs which parameter (``Need``), which rows each rank holds and each rank's budget. From that
alone ``gather_windows`` cuts the parameters, in gather order (smallest first), into windows that the
ranks gather at once, so every rank cuts the same windows and their point-to-point operations match.
The makespan model (``model.makespan``) cuts the same windows to time the engine's gathers.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

GATHER_BUDGET_BYTES = 2 << 30  # a sender's default: bytes of gathered full tensors alive at once
SIZE_CLASS = 2  # a window's parameters are at most this many times the size of its first (its smallest)


@dataclasses.dataclass
class Need:
    """Who needs one parameter's full tensor this round (ranks of its mesh's group), which rows each
    rank holds and each rank's gather budget; ``me`` is this rank in that group."""

    group: object
    me: int
    ranks: list[int]
    rows: list[tuple[int, int]]
    budgets: list[int]  # (one list per group, shared by its parameters)


def gather_windows(names: Sequence[str], sizes: Mapping[str, int],
                   needs: Mapping[str, Optional[Need]]) -> list[tuple[str, ...]]:
    """``names`` (in gather order, the smallest first) cut into windows gathered at once: consecutive
    parameters of one group and one size class (at most ``SIZE_CLASS`` times the window's first: a
    window ends with its slowest pull, so a small gather never waits in one for a large), as many as
    fit half the budget of every rank that materializes some of them (so that the next window is
    posted while this one is taken; a parameter larger than that goes in a window where that rank
    has nothing else); a parameter every rank needs (or of a mesh gathered by ``full_tensor()``)
    alone. Pure, on what every rank of the group knows alike (the exchange): every
    rank cuts the same windows, so their point-to-point operations match."""
    out: list[tuple[str, ...]] = []
    window: list[str] = []
    load: dict[int, int] = {}
    group = None

    def close() -> None:
        if window:
            out.append(tuple(window))
            window.clear()
            load.clear()

    for name in names:
        need, n = needs[name], sizes[name]
        if need is None or len(need.ranks) == len(need.rows):  # a collective: alone
            close()
            out.append((name,))
            continue
        if (need.group is not group or (window and n > SIZE_CLASS * sizes[window[0]])
                or any(load.get(r, 0) and load[r] + n > need.budgets[r] // 2 for r in need.ranks)):
            close()
        group = need.group
        window.append(name)
        for r in need.ranks:
            load[r] = load.get(r, 0) + n
    close()
    return out


def window_ends(pulls: Mapping[tuple[int, str], float], sizes: Mapping[str, int],
                holders: Mapping[str, Sequence[int]], order: Mapping[str, int],
                budget: int) -> tuple[float, dict[str, float]]:
    """The gathers ``pulls`` ((sender, name) -> its pull's seconds) in the Gatherer's windows, every
    holder of a parameter (``holders``) one mesh with ``budget`` each, the smallest first (``sizes``:
    full tensors' bytes; ``order`` breaks ties), each window as long as its slowest rank's pulls in it,
    one after another: when the last ends, and when each parameter's window does (for every one of
    its gatherers)."""
    who: dict[str, list[int]] = {}
    for s, name in pulls:
        who.setdefault(name, []).append(s)
    meshes: dict[tuple[int, ...], tuple] = {}  # holders -> (the mesh, each one's index, budgets)
    needs: dict[str, Need] = {}
    for name, gatherers in who.items():
        ranks = tuple(sorted(holders[name]))
        mesh, index, budgets = meshes.get(ranks) or meshes.setdefault(
            ranks, (ranks, {r: i for i, r in enumerate(ranks)}, [budget] * len(ranks)))
        needs[name] = Need(mesh, -1, [index[s] for s in gatherers], [(0, 0)] * len(ranks), budgets)
    total, ends = 0.0, {}
    for window in gather_windows(sorted(needs, key=lambda n: (sizes[n], order[n])), sizes, needs):
        took: dict[int, float] = {}
        for name in window:
            for s in who[name]:
                took[s] = took.get(s, 0.0) + pulls[s, name]
        total += max(took.values())
        ends.update(dict.fromkeys(window, total))
    return total, ends
