"""A progress bar for interactive terminals (rounds and bytes); silent otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool, width: int = 30) -> None:
        self.total = total
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.nbytes = 0
        self.t0 = time.perf_counter()

    def round_done(self, report) -> None:
        self.done += 1
        self.nbytes += report.nbytes
        self._draw(report)

    def _draw(self, report) -> None:
        if not self.enabled:
            return
        if self.total:
            filled = int(self.width * min(self.done, self.total) / self.total)
            bar = "[" + "#" * filled + "." * (self.width - filled) + "] "
        else:  # open-ended (a standalone controller): just the counters
            bar = ""
        state = "ok" if report.ok else "ABORTED"
        total = f"/{self.total}" if self.total else ""
        sys.stderr.write(f"\r{bar}{self.done}{total} rounds, {self.nbytes / 1e9:.2f} GB moved, "
                         f"last v{report.version} {report.gbps:.2f} GB/s {state}   ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            sys.stderr.write("\n")
            sys.stderr.flush()
