"""TCP frames: the wire format both ends of ``weightsync.engine.transports.tcp`` speak, and a compiled table's frames.

How this works: every frame starts with a 29-byte header ``<BIQQQ`` (op, a, b, c, epoch); the target
answers a FENCE with an ACK ``<BQQQH`` and error text (and a delivery proof, ``PROOF``, names a
connection and counts for the target to wait on). ``Frames`` turns a plan's direct rows into ready
WRITE / WRITE_RUN frames (runs of rows that land back to back go as one frame) grouped into chunks of
whole frames, each one ``sendmsg``; a round only stamps its epoch into the headers. docs/TRANSPORTS.md
("TCP") has the table of frames.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Sequence

import torch

from ..datapath.tensors import byte_view

if TYPE_CHECKING:
    from ..datapath.compiled import CopyRow

HEADER = struct.Struct("<BIQQQ")
ACK = struct.Struct("<BQQQH")
OP_HELLO, OP_WRITE, OP_FENCE, OP_ACK, OP_CHALLENGE, OP_WRITE_RUN = 0, 1, 2, 3, 4, 5
MAGIC = 0x57535443_0003  # "WSTC", version 3 (authenticated hello, runs of writes)
# A delivery proof (``TcpConnection.seal``; it travels in ``writes_done``, not on this stream): the
# connection's challenge nonce and the writes and bytes issued on it so far. A target that checks them
# advertises PROOF_TAG in its TransportInfo.data.
PROOF = struct.Struct("<4s16sQQ")
PROOF_MAGIC = b"tcpp"
PROOF_TAG = b"proofs:tcp"
RUN_SHIFT = 48  # WRITE_RUN: b = offset | rows << RUN_SHIFT
OFFSET_MASK = (1 << RUN_SHIFT) - 1
MAX_RUN_ROWS = (1 << (64 - RUN_SHIFT)) - 1
SCRATCH = 1 << 20
INTAKE = 256 << 10  # the target reads frames into this, many small ones per recv ...
DIRECT_MIN = 64 << 10  # ... and a payload with this much left straight into its region (recv_into)
CHUNK_IOVECS = 512  # a replay's sendmsg takes at most this many buffers (Linux IOV_MAX is 1024) ...
CHUNK_BYTES = 16 << 20  # ... and frames of at most about this many bytes (a bigger frame goes alone)


class Frames:
    """A compiled table for TCP. Rows that land back to back in one region form a *run*, sent as one
    frame (WRITE for one row, WRITE_RUN for several: one header, the rows' payloads one after another,
    received straight into the region); frames are grouped into chunks of at most ``CHUNK_IOVECS``
    buffers and about ``CHUNK_BYTES`` bytes, each one ``sendmsg`` when the socket takes it. The headers
    live in one buffer whose epoch column is stamped once per round."""

    def __init__(self, rows: Sequence[CopyRow]) -> None:
        runs = _runs(rows)
        self.rows = len(rows)
        self.headers = torch.zeros((len(runs), HEADER.size), dtype=torch.uint8)
        raw = byte_view(self.headers)
        self._epochs = self.headers.numpy()[:, HEADER.size - 8:].view("<u8")[:, 0]  # each header's epoch field
        frames = []
        for i, run in enumerate(runs):
            first, size = run[0], sum(r.nbytes for r in run)
            op, offset = (OP_WRITE, first.offset) if len(run) == 1 else (OP_WRITE_RUN, first.offset | len(run) << RUN_SHIFT)
            HEADER.pack_into(raw, i * HEADER.size, op, first.region, offset, size, 0)
            frames.append(([raw[i * HEADER.size:(i + 1) * HEADER.size]] + [byte_view(r.src) for r in run if r.nbytes],
                           len(run), size))
        self.chunks = chunked(frames)  # (buffers, rows, payload bytes)
        self.nbytes = sum(c[2] for c in self.chunks)
        self.epoch = 0

    def __repr__(self) -> str:
        return f"<TCP frames: {self.rows} rows in {len(self.headers)} frames, {len(self.chunks)} chunks>"

    def stamp(self, epoch: int) -> None:
        """Write ``epoch`` into every header (one assignment through a numpy view of their epoch fields)."""
        if epoch != self.epoch:
            self._epochs[:] = epoch  # (numpy: a torch tensor made and copied each round cost ~50 us)
            self.epoch = epoch


def chunked(frames) -> list[tuple[list, int, int]]:
    """Frames ``(buffers, rows, payload bytes)`` grouped, in order, into chunks of at most
    ``CHUNK_IOVECS`` buffers and about ``CHUNK_BYTES`` bytes, each one ``sendmsg``: (buffers, rows, payload
    bytes) a chunk."""
    chunks: list[tuple[list, int, int]] = []
    views: list = []
    count = nbytes = 0
    for frame, rows, size in frames:
        if views and (len(views) + len(frame) > CHUNK_IOVECS or nbytes + size > CHUNK_BYTES):
            chunks.append((views, count, nbytes))
            views, count, nbytes = [], 0, 0
        views += frame
        count += rows
        nbytes += size
    if views:
        chunks.append((views, count, nbytes))
    return chunks


def _runs(rows: Sequence[CopyRow]) -> list[list[CopyRow]]:
    """``rows`` cut into runs: consecutive rows of one region, each starting where the last ended; a run
    stays under ``CHUNK_BYTES`` and ``CHUNK_IOVECS`` buffers (and the row count a header can carry)."""
    runs: list[list[CopyRow]] = []
    size = 0
    for row in rows:
        last = runs[-1][-1] if runs else None
        if (last is not None and last.region == row.region and last.offset + last.nbytes == row.offset
                and size + row.nbytes <= CHUNK_BYTES and len(runs[-1]) < min(CHUNK_IOVECS - 1, MAX_RUN_ROWS)):
            runs[-1].append(row)
            size += row.nbytes
        else:
            runs.append([row])
            size = row.nbytes
    return runs
