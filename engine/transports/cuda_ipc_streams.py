"""cuda_ipc's copy streams and delivery-proof events, per sender device and connection lane.

How this works. Each connection of a sender copies on a *lane*: a pair of streams on every device it
copies from (``LANES`` lanes, shared round robin beyond), so the copies to a colocated receiver and to
one on another GPU run at once instead of one queued behind the other (docs/TRANSPORTS.md, "Two copies
at once"); bytes that kernels store in place are tracked on one more stream per device. ``seal`` proves
delivery of everything queued on a lane: its first stream waits for the second and for the kernels'
stream, and an interprocess CUDA event of that lane (made once, re-recorded by each seal) is recorded
behind them; the proof is (pid, device, event handle). ``_OWN_EVENTS`` keeps this process's own events
by handle (CUDA will not reopen them in the process that made them).
"""

from __future__ import annotations

import os
import struct

import torch

PROOF = struct.Struct("<4sII64s")  # PROOF_MAGIC, pid, device, interprocess event handle
PROOF_MAGIC = b"cipc"
LANES = 4  # connections of one sender copy on streams of their own, up to this many (then they share)
_OWN_EVENTS: dict[bytes, torch.cuda.Event] = {}  # handle -> our own proof events (CUDA will not reopen them here)


class CopyStreams:
    """A sender's copy streams (two per device and lane), its kernels' streams and its proof events."""

    def __init__(self) -> None:
        self.streams: dict[int, list[torch.cuda.Stream]] = {}  # device -> its copy streams, two per lane
        self.written: dict[int, torch.cuda.Stream] = {}  # device -> the stream tracking bytes kernels stored
        self.lanes = 0  # connections made (each copies on the two streams of lane ``n % LANES``)
        self.proof_events: dict[tuple[int, int], tuple[torch.cuda.Event, bytes]] = {}  # (device, lane) -> (event, handle)
        self.marks: dict[tuple, torch.cuda.Event] = {}  # (device, lane, what) -> an event re-recorded to order streams

    def __repr__(self) -> str:
        return f"<CopyStreams lanes={self.lanes} devices={sorted(self.streams)} proof_events={len(self.proof_events)}>"

    def new_lane(self) -> int:
        """The lane of a new connection: its copies queue on streams of their own (``LANES`` lanes,
        shared round robin beyond), so a connection's launches never wait behind another's."""
        self.lanes += 1
        return (self.lanes - 1) % LANES

    def stream(self, device: int, lane: int, index: int) -> torch.cuda.Stream:
        """Copy stream ``index`` (round robin over two) of ``lane`` on ``device``; index -1: the stream that
        tracks bytes stored by kernels (``submit_written``, one per device)."""
        if index < 0:
            written = self.written.get(device)
            if written is None:
                written = self.written[device] = torch.cuda.Stream(device=device)
            return written
        streams = self.streams.setdefault(device, [])
        while len(streams) < 2 * (lane + 1):
            streams.append(torch.cuda.Stream(device=device))
        return streams[2 * lane + index % 2]

    def partner(self, device: int, stream: torch.cuda.Stream) -> torch.cuda.Stream:
        """The other copy stream of ``stream``'s lane."""
        streams = self.streams[device]
        return streams[streams.index(stream) ^ 1]

    def order_after_producer(self, device: int, lane: int) -> None:
        """The lane's copy streams on ``device`` (and the kernels' stream) wait for the work queued so far
        on its current stream: one event of the lane, recorded there and waited on by each (``wait_stream``
        would make and record an event per stream; a wait holds the record it was queued behind, so
        recording the same event again next round leaves it alone)."""
        event = self._mark((device, lane, "producer"), torch.cuda.current_stream(device))
        for index in (0, 1, -1):
            self.stream(device, lane, index).wait_event(event)

    def _mark(self, key: tuple, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """The event kept for ``key``, recorded on ``stream`` now."""
        event = self.marks.get(key)
        if event is None:
            event = self.marks[key] = torch.cuda.Event()
        event.record(stream)
        return event

    def seal(self, device: int, lane: int) -> bytes:
        """A proof of delivery of every copy queued so far on ``lane``'s copy streams of ``device`` and
        on its kernels' stream: an interprocess event of that lane (another lane's seal records its own)."""
        first, second = self.stream(device, lane, 0), self.stream(device, lane, 1)
        first.wait_event(self._mark((device, lane, "second"), second))
        if device in self.written:
            first.wait_event(self._mark((device, lane, "written"), self.written[device]))
        entry = self.proof_events.get((device, lane))
        if entry is None:
            with torch.cuda.device(device):
                event = torch.cuda.Event(interprocess=True)
                event.record(first)
                handle = bytes(event.ipc_handle())
            entry = self.proof_events[(device, lane)] = (event, handle)
            _OWN_EVENTS[handle] = event
        else:
            entry[0].record(first)
        return PROOF.pack(PROOF_MAGIC, os.getpid(), device, entry[1])

    def close(self) -> None:
        for _, handle in self.proof_events.values():
            _OWN_EVENTS.pop(handle, None)
        self.proof_events.clear()
        self.marks.clear()
