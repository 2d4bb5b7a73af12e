"""Progress of rounds for the CLI and the demo, through tqdm: a live bar in a terminal, event lines always.

``RoundProgress.round_done`` advances the bar with the round's bytes and rate; ``say`` prints a line
without breaking the bar (``tqdm.write``), so the demo tells what it is doing as it happens whether or
not stderr is a terminal.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class RoundProgress:
    def __init__(self, total: int, enabled: bool, quiet: bool = False) -> None:
        self.quiet = quiet
        self.nbytes = 0
        self.bar = tqdm(total=total or None, unit="round", file=sys.stderr, disable=not enabled or quiet,
                        dynamic_ncols=True, leave=False)

    def __repr__(self) -> str:
        return f"<RoundProgress {self.bar.n} rounds {self.nbytes / 1e9:.2f} GB>"

    def say(self, line: str) -> None:
        if not self.quiet:
            tqdm.write(line, file=sys.stderr)

    def round_done(self, report: Any) -> None:
        self.nbytes += report.nbytes
        self.bar.set_postfix_str(f"{self.nbytes / 1e9:.2f} GB moved, v{report.version} {report.gbps:.2f} GB/s "
                                 f"{'ok' if report.ok else 'ABORTED'}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
