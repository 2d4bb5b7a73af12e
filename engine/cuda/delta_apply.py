"""The receiver's side of GPU deltas (Triton): many deltas checked, then applied, in a few launches.

The format is ``engine.transforms.delta``'s; the sender's encoder is ``engine.cuda.delta_kernel``.

Apply (``Applier``): each program takes ``BLOCK`` changes of one delta.

1. ``_tally``: per block, its escaped gaps and steps and the sum of its small gaps.
2. torch: where each block's escapes start (running sums per delta).
3. ``_sum``: per block, the sum of its gaps with escapes resolved, and its smallest far gap; then the
   checks, per delta on the device (escape counts as the header says, far gaps >= 1, the last position
   inside the row) and one copy of the verdicts to the host: a bad delta is refused before any byte is
   written.
4. ``_apply``: per block, positions (its start, a running sum of its gaps), steps added to the row's
   bit patterns in place (wrapping), and its share of the row's ``fp64`` change; one copy to the host.

Far gaps and steps lie unaligned after the one-byte arrays, so they are read byte by byte. The module
imports Triton at import time: import it only where it is.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from ..transforms import delta as codec
from . import delta_kernel as kernels
from .delta_kernel import _FAR, _INT, _MASK, _layout, _on, _owners, _segment_starts, _segment_totals, _share, _wrap


@triton.jit
def _changes(e, pid, BLOCK: tl.constexpr):
    """A program's changes of its delta: (packed bytes, index of each, in range, gap bytes, steps)."""
    src = tl.load(e + 0).to(tl.pointer_type(tl.uint8))
    c = tl.load(e + 4)
    j = (pid - tl.load(e + 3)) * BLOCK + tl.arange(0, BLOCK)
    mask = j < c
    gaps = tl.load(src + 24 + j, mask=mask, other=1).to(tl.int64)
    steps = tl.load(src.to(tl.pointer_type(tl.int8)) + 24 + c + j, mask=mask, other=0).to(tl.int64)
    return src, c, mask, gaps, steps


@triton.jit
def _far_gaps(src, c, gaps, mask, first):
    """Each change's gap with escapes resolved (``first``: the block's first far gap), and which escaped."""
    zero = (gaps == 0) & mask
    at = src + 24 + 2 * c + 4 * (first + tl.cumsum(zero.to(tl.int64), 0) - zero.to(tl.int64))
    far = tl.zeros_like(gaps)
    for k in tl.static_range(4):
        far += tl.load(at + k, mask=zero, other=0).to(tl.int64) << (8 * k)
    return tl.where(zero, far, gaps), zero


@triton.jit
def _tally(table, owner, out, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    e = table + tl.load(owner + pid).to(tl.int64) * 8
    src, c, mask, gaps, steps = _changes(e, pid, BLOCK)
    o = out + pid * 3
    tl.store(o + 0, tl.sum(((gaps == 0) & mask).to(tl.int64)))
    tl.store(o + 1, tl.sum(((steps == -128) & mask).to(tl.int64)))


@triton.jit
def _sum(table, owner, starts, out, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    e = table + tl.load(owner + pid).to(tl.int64) * 8
    src, c, mask, gaps, steps = _changes(e, pid, BLOCK)
    first = tl.load(starts + pid)  # the block's first far gap
    mask = mask & ~((gaps == 0) & (first + tl.cumsum((gaps == 0).to(tl.int64), 0) > tl.load(e + 5)))  # (past fg)
    full, zero = _far_gaps(src, c, gaps, mask, first)
    o = out + pid * 3
    tl.store(o + 0, tl.sum(tl.where(mask, full, 0)))
    tl.store(o + 1, tl.min(tl.where(zero, full, 1 << 40)))


@triton.jit
def _apply(table, owner, starts, out, BLOCK: tl.constexpr, W: tl.constexpr, IT: tl.constexpr, FS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    e = table + tl.load(owner + pid).to(tl.int64) * 8
    src, c, mask, gaps, steps = _changes(e, pid, BLOCK)
    s = starts + pid * 3  # the block's first far gap, first far step, and the position before its first change
    full, _ = _far_gaps(src, c, gaps, mask, tl.load(s + 0))
    position = tl.load(s + 2) + tl.cumsum(tl.where(mask, full, 0), 0)
    escaped = (steps == -128) & mask
    at = src + 24 + 2 * c + 4 * tl.load(e + 5) + FS * (tl.load(s + 1) + tl.cumsum(escaped.to(tl.int64), 0)
                                                        - escaped.to(tl.int64))
    far = tl.zeros_like(steps)
    for k in tl.static_range(FS):
        far += tl.load(at + k, mask=escaped, other=0).to(tl.int64) << (8 * k)
    far = tl.where(far >= (1 << (8 * FS - 1)), far - (1 << (8 * FS)), far)
    step = tl.where(escaped, far, steps)
    target = tl.load(e + 1).to(tl.pointer_type(IT))
    old = tl.load(target + position, mask=mask, other=0).to(tl.int64)
    if W == 1:
        new = (old + step) & 255
    else:
        new = _wrap(old + step, W)
    tl.store(target + position, new.to(IT), mask=mask)
    tl.store(out + pid, tl.sum(tl.where(mask, _share(position, old, new, W), 0)))


def headers(region: torch.Tensor, starts: Sequence[int]) -> list[tuple[int, ...]]:
    """The header fields of the deltas packed at ``starts`` of ``region`` (uint8), read in one copy."""
    if not starts:
        return []
    at = torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(codec.HEADER_BYTES)
    raw = region[at.to(region.device)].cpu().contiguous()
    return [tuple(r) for r in raw.view(torch.int32).view(-1, 6).tolist()]


class Applier:
    """Deltas checked, then applied, many in a few launches: each ``(packed, row, header)`` (``packed``
    a uint8 view of the delta's bytes whose header fields ``header`` gives, as ``headers`` reads them;
    ``row`` the 1-D values it applies to, of the header's width and count: the caller checks those)."""

    def __init__(self, deltas: Sequence[tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]]) -> None:
        self.deltas = list(deltas)
        self.device = self.deltas[0][1].device if self.deltas else torch.device("cpu")
        self.launches = []
        by_width: dict[int, list[int]] = {}
        for k, (_, _, head) in enumerate(self.deltas):
            by_width.setdefault(head[1], []).append(k)
        for width, members in by_width.items():
            self.launches.append(self._launch_for(width, members))
        self.checked: Optional[list] = None

    def _launch_for(self, width: int, members: list[int]) -> dict:
        blocks, firsts, programs = _layout([self.deltas[k][2][2] for k in members])  # (by changes)
        entries = []
        for k, first in zip(members, firsts):
            packed, row, (_, _, c, fg, fs, numel) = self.deltas[k]
            entries.append((packed.data_ptr(), row.data_ptr(), numel, first, c, fg, fs, 0))
        launch = {"width": width, "members": members, "programs": programs}
        if programs:
            launch["table"] = torch.tensor(entries, dtype=torch.int64).to(self.device)
            launch["owner"] = row = _owners(blocks, programs, self.device)  # (each block's delta)
            launch["firsts"] = torch.tensor(firsts, dtype=torch.int64, device=self.device)
            launch["blocks"] = torch.tensor(blocks, dtype=torch.int64, device=self.device)
            launch["first"] = launch["firsts"][row]
        return launch

    def check(self) -> list[Optional[str]]:
        """Per delta, why it does not fit its row (None: it does); nothing written. One wait."""
        with _on(self.device):
            return self._run_check()

    def _run_check(self) -> list[Optional[str]]:
        found = torch.zeros((len(self.deltas), 4), dtype=torch.int64)
        parts = []
        for launch in self.launches:
            if not launch["programs"]:
                continue
            table, owner, programs, first = (launch[k] for k in ("table", "owner", "programs", "first"))
            row = owner
            tally = torch.empty((programs, 3), dtype=torch.int64, device=self.device)
            _tally[(programs,)](table, owner, tally, BLOCK=kernels.BLOCK, num_warps=kernels.WARPS)
            escaped_gaps, escaped_steps = tally[:, 0], tally[:, 1]
            gaps_at, steps_at = _segment_starts(escaped_gaps, first), _segment_starts(escaped_steps, first)
            sums = torch.empty((programs, 3), dtype=torch.int64, device=self.device)
            _sum[(programs,)](table, owner, gaps_at.contiguous(), sums,
                              BLOCK=kernels.BLOCK, num_warps=kernels.WARPS)
            launch["starts"] = torch.stack((gaps_at, steps_at, _segment_starts(sums[:, 0], first) - 1), 1).contiguous()
            per = torch.empty((len(launch["members"]), 4), dtype=torch.int64, device=self.device)
            per[:, :3] = _segment_totals(torch.stack((escaped_gaps, escaped_steps, sums[:, 0]), 1),
                                         launch["firsts"], launch["blocks"])
            per[:, 3] = 1 << 40
            per[:, 3].scatter_reduce_(0, row, sums[:, 1], "amin")
            parts.append((launch["members"], per))
        for members, per in parts:
            found[members] = per.cpu()
        self.checked = [codec.verdict(head, *f) for (_, _, head), f in zip(self.deltas, found.tolist())]
        return self.checked

    def apply(self) -> list[int]:
        """Apply every delta (after ``check`` found them all good); each row's ``fp64`` change. One wait."""
        if self.checked is None or any(self.checked):
            raise codec.DeltaError("row", "apply before a check that every delta passed")
        with _on(self.device):
            return self._run_apply()

    def _run_apply(self) -> list[int]:
        changes = [0] * len(self.deltas)
        parts = []
        for launch in self.launches:
            if not launch["programs"]:
                continue
            width, programs = launch["width"], launch["programs"]
            shares = torch.empty(programs, dtype=torch.int64, device=self.device)
            _apply[(programs,)](launch["table"], launch["owner"], launch["starts"], shares, BLOCK=kernels.BLOCK, W=width,
                                IT=_INT[width], FS=_FAR[width], num_warps=kernels.WARPS)
            halves = _segment_totals(torch.stack((shares & 0xFFFFFFFF, shares >> 32), 1),
                                     launch["firsts"], launch["blocks"])
            parts.append((launch["members"], halves))
        for members, halves in parts:
            for k, (low, high) in zip(members, halves.cpu().tolist()):
                changes[k] = ((high << 32) + low) & _MASK
        return changes
