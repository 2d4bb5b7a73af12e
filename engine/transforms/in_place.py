"""Block-FP8 quantizations written straight into the receiver: which may be, and launching them.

How this works. Where the pipeline can name the receiver's memory for a row (``TransformSet.begin``'s
``resolve``: a connection whose target is addressable from the source's device, cuda_ipc; a round with no
checksums or ``fp64`` ones), a quantization whose outputs go to exactly one weight row and one scale row
is *written directly* (``_key_dests``): the launch stores the FP8 weight and its scales straight into the
receiver's tensors (over NVLink on another GPU) instead of into a buffer that is then copied, so those
rows cost no copy and no memory (``written`` rows; ``TransformSet.run`` returns ``None`` with the
launch's event). A group goes direct only whole (``_direct``). A compiled round's written rows launch
together (``write_all``: one ``Quantizer.many`` per source device, dtype and block size, their groups
merged, since they hold no buffer). With ``fingerprint`` (an ``fp64`` round) the launch also fingerprints
what it writes: ``prints`` holds, per launch, its ``fp8.Prints`` and each tensor's (weight row, scales
row) table indexes. ``InPlace`` is a part of ``TransformSet`` (``core``), whose state it reads.
"""

from __future__ import annotations

from typing import Optional

import torch

from weightsync.wire import Transfer

from ..errors import StagingError
from .steps import parse, quant_matrix


class InPlace:
    """``TransformSet``'s rows written in place (mixed in: it reads the set's round state)."""

    def writes_directly(self, t: Transfer) -> bool:
        """Whether row ``t``'s bytes are written into the receiver by its quantization's launch."""
        return "fp8" in t.transform and t.transform not in self.custom and self._direct(self._key(t)) is not None

    def _direct(self, key) -> Optional[tuple[int, int]]:
        """(weight address, scales address) where quantization ``key`` is written this round, or None.
        Decided for its whole group at once: a launch writes all its outputs one way."""
        if self._resolve is None or not isinstance(key, int):
            return None
        if key not in self._dests:
            keys = self._group_keys(key)
            dests = [self._key_dests(k) for k in keys]
            if None in dests:
                dests = [None] * len(keys)
            self._dests.update(zip(keys, dests))
        return self._dests[key]

    def _key_dests(self, key: int) -> Optional[tuple[int, int]]:
        """Where quantization ``key`` can be written: it has one weight row and one scale row, both of
        the sizes its source makes, both addressable from the source's device."""
        rows = self._rows_of.get(key, [])
        ops = [parse(r.transform)[-1][0] for r in rows]
        if sorted(ops) != ["fp8s", "fp8w"]:
            return None  # (two receivers want it, or only one of its outputs is wanted: a buffer it is)
        weight, scales = (rows[0], rows[1]) if ops[0] == "fp8w" else (rows[1], rows[0])
        view = self._view_of(weight)
        if view is None or view.dim() not in (2, 3) or not self.quantizer.writes_to(view.device):
            return None
        if self.moves_to_device(weight, view):
            return None  # (quantized on another device than the source's: through a buffer)
        block = int(parse(weight.transform)[-1][1])
        rows_, cols = view.shape[-2:]
        if view.dim() == 3:  # a stack of matrices, quantized as its 2-D view (``as_matrix``)
            if rows_ % block:
                return None  # (the round raises a typed error for it on the buffered path)
            rows_ *= view.shape[0]
        elif sum(op == "t" for op, _ in parse(weight.transform)) % 2:
            rows_, cols = cols, rows_
        if weight.nbytes != rows_ * cols or scales.nbytes != 4 * -(-rows_ // block) * -(-cols // block):
            return None  # (the round raises a typed error for it on the buffered path)
        q_at, s_at = self._resolve(weight, view.device), self._resolve(scales, view.device)
        return None if q_at is None or s_at is None else (q_at, s_at)

    def write_all(self, rows) -> dict[torch.device, Optional[torch.cuda.Event]]:
        """Run the quantizations of ``rows`` (rows whose bytes this round's launches write into the
        receiver: ``writes_directly``), each once: every one of a source device, dtype and block size in
        one ``Quantizer.many`` (its groups merged: written in place, they hold no buffer, so nothing bounds
        a launch but the kernel's table; a launch per 64 tensors and class, instead of one per group: the
        host's cost of a round of written rows was its launches). The rows are not staged
        (``weightsync.engine.datapath.compiled``), so nothing is kept for them. What the launches take
        (tensors, destinations) is worked out once per ``rows`` object and token (``_written_batches``:
        a compiled round passes the same rows every round). -> per source device, the event after its
        launches (None on the CPU: written on return). Blocking on the CPU."""
        batches, launched = self._written_batches(rows)
        last: dict[torch.device, Optional[torch.cuda.Event]] = {}
        for (device, dtype, block), batch in batches.items():
            if device.type == "cuda":
                stream = self._side_stream(device)
                self._after_producer(stream, device)
                with torch.cuda.stream(stream):
                    last[device] = self._write_batch(batch, device, dtype, block)
            else:
                last[device] = self._write_batch(batch, device, dtype, block)
        for k in launched:
            self.kept.pop(k, None)
        return last

    def _written_batches(self, rows) -> tuple[dict, tuple]:
        """``rows``' quantizations by (source device, dtype, block): each batch's keys, source matrices,
        destinations and (weight, scales) table indexes; and every key launched. Kept per ``rows`` object
        and token (the sources are a plan's fixed views; the token names the destinations)."""
        kept = self._written_by_token.get(self._token)
        if kept is not None and kept[0] is rows:
            return kept[1], kept[2]
        self.batchings += 1
        batches: dict[tuple, tuple[list, list, list, list]] = {}  # (device, dtype, block) -> keys, xs, dests, pairs
        launched: set = set()
        for t in rows:
            key = self._key(t)
            if key in launched:
                continue
            view = self._view_of(t)
            if view is None or self._direct(key) is None:
                raise StagingError(t.name, "compiled as written in place, but its quantization no longer is")
            block = int(parse(t.transform)[-1][1])
            group = self.groups.get(key)
            members = ([(self._key(row), self._head(row, v)) for row, v in group] if group is not None
                       else [(key, quant_matrix(t, self._head(t, view), block))])
            for k, x in members:
                keys, xs, dests, pairs = batches.setdefault((view.device, x.dtype, block), ([], [], [], []))
                keys.append(k)
                xs.append(x)
                dests.append(self._dests[k])
                pairs.append(self._pair_of(k))
            launched.update(k for k, _ in members)
        frozen = {where: (keys, xs, tuple(dests), pairs) for where, (keys, xs, dests, pairs) in batches.items()}
        self._written_by_token[self._token] = (rows, frozen, tuple(launched))
        return frozen, tuple(launched)

    def _write_batch(self, batch: tuple, device: torch.device, dtype: torch.dtype, block: int):
        """One ``Quantizer.many`` storing the batch's outputs at its destinations (fingerprinted in
        ``fp64`` rounds: ``prints``); its event on CUDA (queued on the current stream: the side stream)."""
        keys, xs, dests, pairs = batch
        fingerprint = self.fingerprint
        prints = self.quantizer.many(xs, block, reuse=("written", device, dtype, block), dests=dests,
                                     fingerprint=fingerprint)
        if fingerprint:
            self.prints.append((prints, pairs))
        self.written += 2 * len(keys)
        self.quantized += len(keys)
        if device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def _pair_of(self, key: int) -> tuple[int, int]:
        """The table indexes of quantization ``key``'s weight row and scales row (``_key_dests`` made sure
        it has exactly those two)."""
        rows = self._rows_of[key]
        weight = next(r for r in rows if parse(r.transform)[-1][0] == "fp8w")
        scales = next(r for r in rows if parse(r.transform)[-1][0] == "fp8s")
        return weight.index, scales.index
