"""Tables replayed over virtual time as flows sharing ports by bandwidth (the makespan model's engine).

How this works: the engine runs a sender's table as one lane per receiver, all lanes at once, each with
several writes in flight (``weightsync.engine.datapath.pipeline``), so a lane is a flow: its bytes move
back to back, in table order, at whatever rate its two ports give it. A port (a rank's sender or
receiver side of one link class) carries all its lanes at once and shares its bandwidth among them as
a NIC or a copy engine shares it among concurrent transfers: max-min fairly (``max_min_rates``: every
lane gets the same rate unless one of its ports is full, and a full port's spare is shared by its
other lanes). A lane cannot pass the start of a transfer before that transfer is released (issued by
the sender's one host thread, its gather done): its *cap*, the bytes up to the first transfer not yet
released, rises as time passes. Rates change only when the set of moving lanes does (a lane reaches
its cap, is released again, or ends), so the replay jumps from one such event to the next and
recomputes the rates there. Events within ``window`` of the first (a ten-thousandth of the busiest
port's time, at most) are taken together at the latest of them: a lane that reached its cap a little
earlier waits until then, and a lane released a little earlier starts then, which only delays work,
so the result is never below the exact replay's (and at most a few windows above it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def max_min_rates(sport: np.ndarray, rport: np.ndarray, cap_s: np.ndarray, cap_r: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows from sender port ``sport[i]`` to receiver port ``rport[i]`` (port
    capacities ``cap_s``, ``cap_r``), by progressive filling: every unfrozen flow grows at the same pace
    until a port fills, whose flows then freeze at that rate."""
    rate = np.zeros(len(sport))
    free_s, free_r = cap_s.astype(float), cap_r.astype(float)
    live = np.ones(len(sport), bool)
    level = 0.0
    while live.any():
        n_s = np.bincount(sport[live], minlength=len(cap_s))
        n_r = np.bincount(rport[live], minlength=len(cap_r))
        step = min((free_s[n_s > 0] / n_s[n_s > 0]).min(initial=np.inf),
                   (free_r[n_r > 0] / n_r[n_r > 0]).min(initial=np.inf))
        level += step
        free_s -= step * n_s
        free_r -= step * n_r
        full = live & ((n_s > 0) & (free_s <= 1e-12 * cap_s))[sport] | live & ((n_r > 0) & (free_r <= 1e-12 * cap_r))[rport]
        rate[full] = level
        live &= ~full
    return rate


class FluidReplay:
    """Lanes as flows with release barriers (see the module docstring). ``lanes``: per lane its sender
    port and receiver port (numbers into ``cap_s`` / ``cap_r``) and its transfers in table order as
    (release time, bytes)."""

    WINDOW = 1e-4  # events this close (relative to the busiest port's time) are taken together

    def __init__(self, sport: Sequence[int], rport: Sequence[int], transfers: Sequence[Sequence[tuple[float, int]]],
                 cap_s: Sequence[float], cap_r: Sequence[float]) -> None:
        self.sport, self.rport = np.asarray(sport, np.int64), np.asarray(rport, np.int64)
        self.cap_s, self.cap_r = np.asarray(cap_s, float), np.asarray(cap_r, float)
        # per lane: each transfer's release, as the lane sees it (no later transfer starts before an
        # earlier one: the running maximum), and the lane's bytes before each transfer
        self.release = [np.maximum.accumulate(np.fromiter((q for q, _ in items), float, len(items)))
                        for items in transfers]
        self.before = [np.concatenate(([0.0], np.cumsum([n for _, n in items], dtype=float)))
                       for items in transfers]
        self.total = np.fromiter((b[-1] for b in self.before), float, len(self.before))
        busiest = max((np.bincount(self.sport, self.total, len(self.cap_s)) / self.cap_s).max(initial=0.0),
                      (np.bincount(self.rport, self.total, len(self.cap_r)) / self.cap_r).max(initial=0.0))
        self.window = self.WINDOW * busiest

    def run(self) -> float:
        """When the last byte lands."""
        n = len(self.total)
        if n == 0:
            return 0.0
        done, cap, wake = np.zeros(n), np.zeros(n), np.full(n, np.inf)
        t, end = 0.0, 0.0

        def recap(k: int) -> None:  # lane k's cap and when it next rises, at time t
            j = int(np.searchsorted(self.release[k], t, side="right"))
            if j < len(self.release[k]):
                cap[k], wake[k] = self.before[k][j], self.release[k][j]
            else:
                cap[k], wake[k] = self.total[k], np.inf

        for k in range(n):
            recap(k)
        moving = done < cap
        rate = self._rates(moving)
        while True:
            with np.errstate(divide="ignore", invalid="ignore"):
                reach = np.where(moving, t + (cap - done) / rate, np.inf)
            at = np.minimum(reach, np.where(~moving & (done < self.total), wake, np.inf))  # each lane's next event
            first = at.min()
            if first == np.inf:
                return float(end)
            due = at <= first + self.window
            now = at[due].max()
            done = np.minimum(done + rate * (now - t), cap)
            t = now
            due |= moving & (cap - done <= 1e-9 * np.maximum(cap, 1.0))  # (reached it, but for rounding)
            for k in np.flatnonzero(due).tolist():
                if moving[k]:
                    done[k] = cap[k]
                recap(k)
            finished = due & (done >= self.total)
            if finished.any():
                end = t
            now_moving = done < cap
            if (now_moving != moving).any():
                moving = now_moving
                rate = self._rates(moving)

    def _rates(self, moving: np.ndarray) -> np.ndarray:
        rate = np.zeros(len(moving))
        rate[moving] = max_min_rates(self.sport[moving], self.rport[moving], self.cap_s, self.cap_r)
        return rate
