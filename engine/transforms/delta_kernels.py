"""The compiled kernels of ``engine.transforms.delta_cpu`` (numba, imported here: import this module
only through ``delta_cpu``, which works without numba). Module-level functions, so numba's cache
(``cache=True``) keeps them between processes.
"""

from __future__ import annotations

import numba
import numpy as np

MOD = 65521  # fp64's weights repeat every MOD words (engine.datapath.checksums)
OK, BAD = 0, 1


@numba.njit(cache=True, nogil=True, inline="always")
def share(p, b, a, width):
    """fp64 change of value ``p`` going from bit pattern ``b`` to ``a`` (as ``delta.apply`` gives them)."""
    if width == 8:
        bl, al = b & 0xFFFFFFFF, a & 0xFFFFFFFF
        bl = bl - (1 << 32) if bl >= (1 << 31) else bl
        al = al - (1 << 32) if al >= (1 << 31) else al
        return (al - bl) * ((2 * p) % MOD + 1) + ((a >> 32) - (b >> 32)) * ((2 * p + 1) % MOD + 1)
    shift = 2 if width == 1 else (1 if width == 2 else 0)  # values per word: 1 << shift
    slot = p & ((1 << shift) - 1)
    top = slot == (1 << shift) - 1
    if width == 1 and top:
        b = b - 256 if b >= 128 else b
        a = a - 256 if a >= 128 else a
    elif width == 2 and not top:
        b = b + 65536 if b < 0 else b
        a = a + 65536 if a < 0 else a
    return ((a - b) << (8 * width * slot)) * ((p >> shift) % MOD + 1)


@numba.njit(cache=True, nogil=True)
def encode(base, new, base_words, new_words, gaps, far_gaps, steps, far_steps, width, limit):
    per = 8 // width
    half = np.int64(1) << (8 * width - 1)
    c, fg, fs, prev, fp = 0, 0, 0, -1, np.int64(0)
    words = base_words.size
    for w in range(words + 1):
        if w < words:
            if base_words[w] == new_words[w]:
                continue
            lo, hi = w * per, w * per + per
        else:
            lo, hi = words * per, base.size
        for i in range(lo, hi):
            b, a = np.int64(base[i]), np.int64(new[i])
            if a == b:
                continue
            if c == limit:
                return -1, 0, 0, fp
            g = i - prev
            prev = i
            if g < 256:
                gaps[c] = g
            else:
                gaps[c] = 0
                far_gaps[fg] = g
                fg += 1
            d = a - b
            if width < 8:
                d = ((d + half) & (2 * half - 1)) - half  # (wrapped into the width, signed)
            if -128 < d < 128:
                steps[c] = d
            else:
                steps[c] = -128
                far_steps[fs] = d
                fs += 1
            fp += share(i, b, a, width)
            base[i] = new[i]
            c += 1
    return c, fg, fs, fp


@numba.njit(cache=True, nogil=True)
def walk(gaps, far_gaps, steps, far_steps, numel):
    """OK where the positions are strictly increasing, inside the row and the escapes add up."""
    fg, fs, pos = 0, 0, np.int64(-1)
    for k in range(gaps.size):
        g = np.int64(gaps[k])
        if g == 0:
            if fg == far_gaps.size:
                return BAD
            g = np.int64(far_gaps[fg])
            fg += 1
            if g < 1:
                return BAD
        pos += g
        if steps[k] == -128:
            fs += 1
    if fg != far_gaps.size or fs != far_steps.size or pos >= numel:
        return BAD
    return OK


@numba.njit(cache=True, nogil=True)
def apply(values, gaps, far_gaps, steps, far_steps, width, sign):
    fg, fs, pos, fp = 0, 0, np.int64(-1), np.int64(0)
    for k in range(gaps.size):
        g = np.int64(gaps[k])
        if g == 0:
            g = np.int64(far_gaps[fg])
            fg += 1
        pos += g
        s = np.int64(steps[k])
        if s == -128:
            s = np.int64(far_steps[fs])
            fs += 1
        b = np.int64(values[pos])
        values[pos] = b + sign * s  # (wraps in the values' width)
        fp += share(pos, b, np.int64(values[pos]), width)
    return fp

