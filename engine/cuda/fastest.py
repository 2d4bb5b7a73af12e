"""The faster of several ways to copy one link's rows, measured on the rounds themselves.

How this works. Rows from one GPU into another GPU's memory can be copied by the copy engines
(``cudaMemcpyBatchAsync``, or a ``cudaMemcpy2DAsync`` per pitched block) or by a kernel on the
sender's GPU storing straight into the peer's mapped memory (``copy_kernel``). Which is faster depends
on the link (NVLink or PCIe), the rows' shapes and what else the GPU runs, so cuda_ipc does not guess:
a compiled table's rows for one link become a ``FastestLaunch`` holding every way to copy them. Each
replay launches one of them between two timing events; its cost is the longer of that time and the
host's time to issue it (``cost``). ``Trials`` (pure) picks the way with the fewest timings so far,
drops each way's first timing (it can include a kernel's JIT compile), and once every way has
``samples`` timings keeps the one of the lowest median for good; the tables of one set of rows over a
link share one ``Trials`` (the transport keeps them by link and rows). Timings are read when they are
ready (``Event.query`` at the next replay: never a host wait). Every way writes the same bytes to the
same places, so a round is correct whichever runs; the choice and the timings are kept
(``FastestLaunch.choice``) for the transport's ``repr`` and the benchmarks.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Mapping, Optional

SAMPLES = 2  # timings per way, after the first, before the choice


def cost(device_s: float, host_s: float) -> float:
    """What a way costs a round: its copies take ``device_s`` on the GPU, and issuing them takes ``host_s``
    of the sender's thread (a ``cudaMemcpy2DAsync`` per row adds up), during which the GPU already
    copies; the round waits for the longer of the two."""
    return max(device_s, host_s)


class Trials:
    """Which of ``names`` to run next, from their timings so far (pure)."""

    def __init__(self, names: tuple[str, ...], samples: int = SAMPLES) -> None:
        if not names or samples < 1:
            raise ValueError("Trials needs at least one way and one sample")
        self.names, self.samples = names, samples
        self.seconds: dict[str, list[float]] = {n: [] for n in names}
        self._seen = collections.Counter()
        self.chosen: Optional[str] = names[0] if len(names) == 1 else None

    def __repr__(self) -> str:
        times = {n: [round(s * 1e3, 3) for s in t] for n, t in self.seconds.items()}
        return f"<Trials chosen={self.chosen} ms={times}>"

    def next(self) -> str:
        if self.chosen is not None:
            return self.chosen
        return min(self.names, key=lambda n: (self._seen[n], self.names.index(n)))

    def record(self, name: str, seconds: float) -> None:
        """One timing of ``name`` (its first one is dropped); chooses once every way has enough."""
        self._seen[name] += 1
        if self._seen[name] == 1 or self.chosen is not None:
            return
        self.seconds[name].append(seconds)
        if all(len(t) >= self.samples for t in self.seconds.values()):
            self.chosen = min(self.names, key=lambda n: (statistics.median(self.seconds[n]), self.names.index(n)))


class FastestLaunch:
    """One link's rows with several launches that copy them; ``launch(stream)`` runs one, as ``trials``
    says (timed until the choice is made; tables of one link may share their ``Trials``: a shadow
    receiver's two landing slots are two tables)."""

    def __init__(self, ways: Mapping[str, object], link: str, trials: Optional[Trials] = None) -> None:
        self.ways = dict(ways)
        self.link = link
        self.trials = trials if trials is not None else Trials(tuple(self.ways))
        if self.trials.names != tuple(self.ways):
            raise ValueError(f"trials of {self.trials.names} for ways {tuple(self.ways)}")
        self._pending: collections.deque = collections.deque()  # (way, start event, end event, host seconds)

    def __repr__(self) -> str:
        return f"<FastestLaunch {self.link} {self.trials!r}>"

    @property
    def choice(self) -> Optional[str]:
        return self.trials.chosen

    def launch(self, stream) -> None:
        import torch

        self._collect()
        way = self.trials.next()
        if self.trials.chosen is not None:
            self.ways[way].launch(stream)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        issued = time.perf_counter()
        self.ways[way].launch(stream)
        host_s = time.perf_counter() - issued
        end.record(stream)
        self._pending.append((way, start, end, host_s))

    def _collect(self) -> None:
        while self._pending and self._pending[0][2].query():
            way, start, end, host_s = self._pending.popleft()
            self.trials.record(way, cost(start.elapsed_time(end) / 1e3, host_s))
            if self.trials.chosen is not None:
                self._pending.clear()
                return
