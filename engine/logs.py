"""Log lines that an attacker or a flapping peer could repeat thousands of times, aggregated.

How this works: ``Repeats.log(key, text)`` logs the first event of each ``key`` (say, a peer's
address and what it did) at once; later events of that key within ``every_s`` are only counted, and
the next event after the window logs one line with the count ("... (and 3,485 more like it in the
last 10.0 s)"). ``flush`` logs what is still counted (at close). Keys are forgotten once their window
has passed with nothing counted, so the table stays as small as the set of recent offenders.
"""

from __future__ import annotations

import logging
import time
from typing import Hashable, Optional


class Repeats:
    def __init__(self, logger: logging.Logger, level: int = logging.WARNING, every_s: float = 10.0,
                 max_keys: int = 4096) -> None:
        self.logger = logger
        self.level = level
        self.every_s = every_s
        self.max_keys = max_keys
        self.window: dict[Hashable, tuple[float, int]] = {}  # key -> (window start, events counted since)
        self.total = 0

    def __repr__(self) -> str:
        return f"<Repeats total={self.total} keys={len(self.window)}>"

    def log(self, key: Hashable, text: str, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self.total += 1
        start, counted = self.window.get(key, (None, 0))
        if start is not None and now - start < self.every_s:
            self.window[key] = (start, counted + 1)
            return
        more = f" (and {counted} more like it in the last {now - start:.1f} s)" if counted else ""
        self.logger.log(self.level, "%s%s", text, more)
        if len(self.window) >= self.max_keys:
            self._forget(now)
        self.window[key] = (now, 0)

    def _forget(self, now: float) -> None:
        self.window = {k: v for k, v in self.window.items() if now - v[0] < self.every_s or v[1]}
        if len(self.window) >= self.max_keys:  # (a flood of distinct keys: keep the newest half)
            self.window = dict(list(self.window.items())[len(self.window) // 2:])

    def flush(self) -> None:
        for key, (start, counted) in self.window.items():
            if counted:
                self.logger.log(self.level, "%r: %d more event(s) since the last line", key, counted)
        self.window.clear()
