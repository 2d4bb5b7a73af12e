"""The compiled kernels of ``engine.transforms.delta_cpu`` (numba, imported here: import this module
only through ``delta_cpu``, which works without numba). Module-level functions, so numba's cache
(``cache=True``) keeps them between processes.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

MOD = 65521  # fp64's weights repeat every MOD words (engine.datapath.checksums)
MAGIC = 0x57534431  # a packed delta's first four bytes (engine.transforms.delta.MAGIC)
OK, BAD = 0, 1
CHUNK_WORDS = 4096  # words ``encode`` compares a pass (their indices stay in the L1 cache)


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


@numba.njit(cache=True, nogil=True, inline="always")
def _record(i, b, a, prev, c, fg, fs, gaps, far_gaps, steps, far_steps, width):
    """``encode``'s change ``c``: value ``i`` from bit pattern ``b`` to ``a``, ``prev`` the last changed
    position; its gap and step, escaped where they do not fit a byte. The far counts after it."""
    g = i - prev
    if g < 256:
        gaps[c] = g
    else:
        gaps[c] = 0
        far_gaps[fg] = g
        fg += 1
    d = a - b
    if width < 8:
        half = np.int64(1) << (8 * width - 1)
        d = ((d + half) & (2 * half - 1)) - half  # (wrapped into the width, signed)
    if -128 < d < 128:
        steps[c] = d
    else:
        steps[c] = -128
        far_steps[fs] = d
        fs += 1
    return fg, fs


@numba.njit(cache=True, nogil=True)
def encode(base, new, base_words, new_words, gaps, far_gaps, steps, far_steps, width, limit):
    """The changes from ``base`` to ``new`` (``delta.encode``'s arrays), ``base`` brought to ``new``:
    (changes, far gaps, far steps, fp64 change), changes -1 past ``limit``. Compared 8 bytes a word
    (``*_words``: the same rows as words; empty where they do not start on 8 bytes) in two passes a
    chunk: the indices of the words that differ, gathered without a branch (most words are equal, and
    a branch a word mispredicts at every change); then, in each of those words, the values that
    changed, found from the xor of its two bit patterns (``_lanes``: a loop of as many turns as changed
    values, not a turn and an unpredictable branch a value). After the last chunk, the values after the
    last whole word one by one."""
    per = 8 // width
    c, fg, fs, prev, fp = 0, 0, 0, -1, np.int64(0)
    words = base_words.size
    found = np.empty(min(words, CHUNK_WORDS) + 1, np.int64)
    for start in range(0, max(words, 1), CHUNK_WORDS):
        stop = min(words, start + CHUNK_WORDS)
        k = 0
        for w in range(start, stop):
            found[k] = w
            k += base_words[w] != new_words[w]
        if stop == words:  # (the last chunk: then the values after the last whole word, -1)
            found[k] = -1
            k += 1
        for j in range(k):
            w = found[j]
            if w >= 0:
                lanes = _lanes(base_words[w] ^ new_words[w], width)
                while lanes != 0:
                    i = w * per + np.int64(trailing_zeros(lanes)) // (8 * width)
                    lanes &= lanes - np.uint64(1)
                    if c == limit:
                        return -1, 0, 0, fp
                    c, fg, fs, fp = _take(i, base, new, prev, c, fg, fs, fp, gaps, far_gaps, steps, far_steps, width)
                    prev = i
                continue
            for i in range(words * per, base.size):
                if base[i] == new[i]:
                    continue
                if c == limit:
                    return -1, 0, 0, fp
                c, fg, fs, fp = _take(i, base, new, prev, c, fg, fs, fp, gaps, far_gaps, steps, far_steps, width)
                prev = i
    return c, fg, fs, fp


@numba.njit(cache=True, nogil=True, inline="always")
def _take(i, base, new, prev, c, fg, fs, fp, gaps, far_gaps, steps, far_steps, width):
    """``encode``'s change ``c``, value ``i``: recorded (``_record``), its fingerprint change added and
    ``base[i]`` brought to ``new[i]``; the counts and the fingerprint change after it."""
    b, a = np.int64(base[i]), np.int64(new[i])
    fg, fs = _record(i, b, a, prev, c, fg, fs, gaps, far_gaps, steps, far_steps, width)
    base[i] = new[i]
    return c + 1, fg, fs, fp + share(i, b, a, width)


@numba.njit(cache=True, nogil=True, inline="always")
def _lanes(x, width):
    """One bit per value of ``width`` bytes that is not 0 in word ``x`` (the value's lowest bit, where
    little-endian words hold it), without a branch: each value's low bits carried into its top bit."""
    if width == 8:
        return np.uint64(1) if x != 0 else np.uint64(0)
    if width == 4:
        low, high = np.uint64(0x0000000100000001), np.uint64(0x7FFFFFFF7FFFFFFF)
    elif width == 2:
        low, high = np.uint64(0x0001000100010001), np.uint64(0x7FFF7FFF7FFF7FFF)
    else:
        low, high = np.uint64(0x0101010101010101), np.uint64(0x7F7F7F7F7F7F7F7F)
    top = ((x & high) + high) | x  # (each value's top bit: set where the value is not 0)
    return (top >> np.uint64(8 * width - 1)) & low


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


# Many rows a call (``delta_cpu.encode_many``, ``Applier``): rows given by address in an int64 table,
# each seen through a view of its width (``_encode_at``, ``_apply_at``) by the one-row kernels above.

def _pointer(item):
    """An intrinsic: a pointer to ``item`` values at an address (int64)."""
    @intrinsic
    def at(typingctx, addr):
        sig = types.CPointer(item)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(item)))
        return sig, codegen
    return at


_u8_at, _i16_at, _i32_at, _i64_at, _u64_at = (_pointer(t) for t in (types.uint8, types.int16, types.int32,
                                                                       types.int64, types.uint64))


@numba.njit(cache=True, nogil=True, inline="always")
def _store(raw, at, v, nbytes):
    """``v``'s low ``nbytes`` bytes at ``raw[at:]``, little-endian."""
    for k in range(nbytes):
        raw[at + k] = (v >> (8 * k)) & 0xFF


@numba.njit(cache=True, nogil=True)
def _encode_at(b, n, numel, width, gaps, far_gaps, steps, far_steps):
    """``encode`` of the row at addresses ``b`` (base) and ``n`` (new), through views of its width."""
    limit = max(0, (numel * width - 25) // 2)  # (2 bytes a change at least: a delta smaller than the row)
    words = numel * width // 8 if b % 8 == 0 and n % 8 == 0 else 0
    bw, nw = numba.carray(_u64_at(b), words), numba.carray(_u64_at(n), words)
    if width == 2:
        return encode(numba.carray(_i16_at(b), numel), numba.carray(_i16_at(n), numel), bw, nw, gaps, far_gaps,
                      steps, far_steps.view(np.int16), width, limit)
    if width == 4:
        return encode(numba.carray(_i32_at(b), numel), numba.carray(_i32_at(n), numel), bw, nw, gaps, far_gaps,
                      steps, far_steps.view(np.int32), width, limit)
    if width == 1:
        return encode(numba.carray(_u8_at(b), numel), numba.carray(_u8_at(n), numel), bw, nw, gaps, far_gaps,
                      steps, far_steps.view(np.int16), width, limit)
    return encode(numba.carray(_i64_at(b), numel), numba.carray(_i64_at(n), numel), bw, nw, gaps, far_gaps,
                  steps, far_steps.view(np.int64), width, limit)


@numba.njit(cache=True, nogil=True)
def encode_rows(table, out, gaps, far_gaps, steps, far_steps, results):
    """``encode`` of many rows: ``table[r]`` = (base address, new address, values, width, where its packed
    delta goes in ``out``: a slot of its row's bytes). ``results[r]`` = (the packed delta's bytes, or -1:
    the row goes whole; the values it changes; its fp64 change). Every base ends equal to its new bytes.
    Scratch for the most changes a row may have (``limit``): ``gaps`` (uint8), ``far_gaps`` (uint32),
    ``steps`` (int8) and ``far_steps`` (uint8, bytes for as many far steps of the widest)."""
    for r in range(table.shape[0]):
        numel, width, at = table[r, 2], table[r, 3], table[r, 4]
        nbytes = numel * width
        c, fg, fs, fp = _encode_at(table[r, 0], table[r, 1], numel, width, gaps, far_gaps, steps, far_steps)
        far = 2 if width <= 2 else width
        size = 24 + 2 * c + 4 * fg + far * fs
        if c < 0 or size >= nbytes:
            base, new = numba.carray(_u8_at(table[r, 0]), nbytes), numba.carray(_u8_at(table[r, 1]), nbytes)
            base[:] = new
            results[r, 0], results[r, 1], results[r, 2] = -1, 0, 0
            continue
        _store(out, at, MAGIC, 4)
        _store(out, at + 4, width, 4)
        _store(out, at + 8, c, 4)
        _store(out, at + 12, fg, 4)
        _store(out, at + 16, fs, 4)
        _store(out, at + 20, numel, 4)
        out[at + 24:at + 24 + c] = gaps[:c]
        out[at + 24 + c:at + 24 + 2 * c] = steps[:c].view(np.uint8)
        out[at + 24 + 2 * c:at + 24 + 2 * c + 4 * fg] = far_gaps[:fg].view(np.uint8)
        out[at + 24 + 2 * c + 4 * fg:at + size] = far_steps[:far * fs]
        results[r, 0], results[r, 1], results[r, 2] = size, c, fp


@numba.njit(cache=True, nogil=True)
def walk_rows(table, found):
    """``walk`` of many packed deltas: ``table[r]`` = (its address, changes, far gaps, far steps; the
    header's, whose sizes add up to its bytes). ``found[r]`` = (escaped gaps, escaped steps, the sum of
    its gaps, its least far gap): ``delta.verdict`` says what they mean."""
    for r in range(table.shape[0]):
        c, fg = table[r, 1], table[r, 2]
        raw = numba.carray(_u8_at(table[r, 0]), 24 + 2 * c + 4 * fg)
        eg, es, total, least = 0, 0, np.int64(0), np.int64(1) << 40
        for k in range(c):
            g = np.int64(raw[24 + k])
            if g == 0:
                if eg < fg:
                    for j in range(4):
                        g |= np.int64(raw[24 + 2 * c + 4 * eg + j]) << (8 * j)
                    least = min(least, g)
                eg += 1
            total += g
            if raw[24 + c + k] == 0x80:
                es += 1
        found[r, 0], found[r, 1], found[r, 2], found[r, 3] = eg, es, total, least


@numba.njit(cache=True, nogil=True)
def _apply_at(row, numel, width, gaps, far_gaps, steps, far_steps, sign):
    """``apply`` to the row at address ``row``, through a view of its width."""
    if width == 2:
        return apply(numba.carray(_i16_at(row), numel), gaps, far_gaps, steps, far_steps.view(np.int16), width, sign)
    if width == 4:
        return apply(numba.carray(_i32_at(row), numel), gaps, far_gaps, steps, far_steps.view(np.int32), width, sign)
    if width == 1:
        return apply(numba.carray(_u8_at(row), numel), gaps, far_gaps, steps, far_steps.view(np.int16), width, sign)
    return apply(numba.carray(_i64_at(row), numel), gaps, far_gaps, steps, far_steps.view(np.int64), width, sign)


@numba.njit(cache=True, nogil=True)
def apply_rows(table, sign, changes):
    """``apply`` of many checked deltas: ``table[r]`` = (packed address, row address, values, width,
    changes, far gaps, far steps). ``changes[r]``: its row's fp64 change. (Far gaps and steps lie
    unaligned after the one-byte arrays: copied out first; they are few.)"""
    most_fg, most_fs = 0, 0
    for r in range(table.shape[0]):
        most_fg, most_fs = max(most_fg, table[r, 5]), max(most_fs, table[r, 6])
    far_gaps, far_steps = np.empty(4 * most_fg, np.uint8), np.empty(8 * most_fs, np.uint8)
    for r in range(table.shape[0]):
        numel, width, c, fg, fs = table[r, 2], table[r, 3], table[r, 4], table[r, 5], table[r, 6]
        far = 2 if width <= 2 else width
        raw = numba.carray(_u8_at(table[r, 0]), 24 + 2 * c + 4 * fg + far * fs)
        far_gaps[:4 * fg] = raw[24 + 2 * c:24 + 2 * c + 4 * fg]
        far_steps[:far * fs] = raw[24 + 2 * c + 4 * fg:]
        changes[r] = _apply_at(table[r, 1], numel, width, raw[24:24 + c], far_gaps[:4 * fg].view(np.uint32),
                               raw[24 + c:24 + 2 * c].view(np.int8), far_steps[:far * fs], sign)
