"""The initiator's side of a UCCL connection: one-sided writes, their completions, the mailbox fence.

How this works: a write asks the target (over the side channel, once per destination range) for the
descriptor ``write_async`` needs, issues the write and polls its transfer id from the loop until done,
exactly once (a cancelled write keeps being polled by a shielded task holding its source). A compiled
table's rows go one ``write_async`` after another in one task. ``fence`` writes the next sequence number
into the target's mailbox behind every earlier write and waits for the target's echo
(``weightsync.engine.transports.uccl`` explains why that proves delivery). In UCCL's tcp mode one operation is in
flight per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ..cuda import cuda_rt
from ..errors import ConnectionClosed, RegistrationError, TransportError
from ..transport import Abilities, wait_after
from .uccl_frames import BLOB, CHUNK, FENCE_TIMEOUT_S, FRAME, OP_ADVERTISE, OP_FENCE, RDMA_DEPTH, REFUSED, ok as _ok

if TYPE_CHECKING:
    from ..datapath.compiled import CopyRow
    from .uccl import UcclTransport


class UcclConnection:
    def __init__(self, owner: "UcclTransport", conn_id: int, peer: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, mailbox: bytes) -> None:
        self.owner = owner
        self.conn_id = conn_id
        self.peer = peer
        self.blobs: dict[tuple[int, int, int], bytes] = {}
        self._reader, self._writer = reader, writer
        self._side = asyncio.Lock()  # side-channel requests are request/reply, one at a time
        self._mailbox = mailbox  # descriptor of the target's fence mailbox for this connection
        self._seq_src = torch.zeros(1, dtype=torch.int64, device=owner.options.device)
        self.closed = False
        self._seq = 0
        self._round = (-1, 0, 0)  # (epoch, writes, bytes) of the round being written
        self._ordered = -1
        self.sent_count = 0
        self.sent_bytes = 0
        self.pending: set[asyncio.Task] = set()
        # UCCL's tcp mode: one operation in flight per connection (see ``_one_at_a_time``)
        self._serial = asyncio.Lock() if owner.options.uccl_tcp else None
        device = frozenset({torch.device(owner.options.device).type})  # what sources it reads in place
        self.abilities = Abilities(devices=device, depth=1 if self._serial else RDMA_DEPTH, compiles=True,
                                   direct_devices=device, delta_auto=True)

    def _one_at_a_time(self):
        """In UCCL's tcp mode every operation is an NCCL send/recv pair matched in posting order, and
        uccl 0.1.1 posts large operations from its proxy thread but small ones from ``poll_async``: two
        in flight on one connection can be posted in another order than announced, and the target then
        lands one write's bytes in another's place (seen on the 2-GPU machine: checksum mismatches in
        rounds 2 and 3). So there, each operation completes before the next is issued."""
        return self._serial if self._serial is not None else contextlib.nullcontext()

    def __repr__(self) -> str:
        return (f"<UcclConnection to {self.peer} conn={self.conn_id} sent={self.sent_count}/{self.sent_bytes} "
                f"bytes descriptors={len(self.blobs)} polling={len(self.pending)}>")

    async def _request(self, frame: bytes, reply: int) -> bytes:
        async with self._side:
            try:
                self._writer.write(frame)
                return await self._reader.readexactly(reply)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                self.closed = True
                raise ConnectionClosed("the uccl side channel closed", peer=self.peer) from exc

    async def _blob(self, region: int, offset: int, size: int) -> bytes:
        """The target's descriptor of one destination range (asked once, then cached)."""
        key = (region, offset, size)
        blob = self.blobs.get(key)
        if blob is None:
            blob = await self._request(FRAME.pack(OP_ADVERTISE, region, offset, size, 0, 0), BLOB)
            if blob == REFUSED:
                raise RegistrationError(f"target refused region {region} bytes {offset}+{size} (out of bounds?)",
                                        peer=self.peer)
            self.blobs[key] = blob
        return blob

    async def _complete(self, tid: int, keep: torch.Tensor, what: str) -> None:
        """Poll ``tid`` until done, exactly once done; if we are cancelled, a shielded task keeps
        polling (and holds ``keep``, the memory UCCL still reads) so the id is neither leaked nor reused."""
        ep = self.owner.ep

        async def poll() -> None:
            since = time.perf_counter()
            while not _ok(ep.poll_async(tid), f"poll_async ({what})", self.peer):
                await cuda_rt.pause(since)
            del keep_alive[:]

        keep_alive = [keep]
        task = asyncio.ensure_future(poll())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        await asyncio.shield(task)

    async def _put(self, src: torch.Tensor, start: int, size: int, blob: bytes, what: str) -> None:
        """One ``write_async`` of ``size`` bytes of ``src`` from byte ``start`` to the range ``blob``
        names, polled to completion."""
        mr = self.owner.source_mr(src)
        async with self._one_at_a_time():
            tid = _ok(self.owner.ep.write_async(self.conn_id, mr, src.data_ptr() + start, size, blob),
                      f"write_async ({what})", self.peer)
            await self._complete(tid, src, what)

    async def write(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
                    after: Optional[torch.cuda.Event] = None) -> None:
        if self.closed:
            raise ConnectionClosed("write on a closed connection", peer=self.peer)
        await wait_after(after)  # UCCL's streams are its own: order on the host
        await self._put_row(src, dst_region, dst_offset, epoch)

    async def _put_row(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int) -> None:
        """One row's bytes, in pieces of at most ``CHUNK``, counted for the round's fence."""
        nbytes = src.numel() * src.element_size()
        if self._round[0] != epoch:
            self._round = (epoch, 0, 0)
        if nbytes:
            if self._ordered != epoch and src.is_cuda:  # once per round: the producer's queued work is done
                await cuda_rt.stream_done(src.device)
                self._ordered = epoch
            for start in range(0, nbytes, CHUNK):
                size = min(CHUNK, nbytes - start)
                await self._put(src, start, size, await self._blob(dst_region, dst_offset + start, size), "write")
        e, count, total = self._round
        self._round = (e, count + 1, total + nbytes)
        self.sent_count += 1
        self.sent_bytes += nbytes

    generation = 0  # the target's regions are fixed for the connection's life (a new plan connects anew)

    def compile(self, rows: Sequence[CopyRow]) -> list:
        """A plan's direct rows as (source, region, offset): the target checks bounds when it advertises
        each range (first replay; the descriptors are cached from then on)."""
        return [(row.src, row.region, row.offset) for row in rows]

    def replay(self, table: list, epoch: int) -> list[asyncio.Future]:
        """Every row of a compiled table, one ``write_async`` after another in one task (not a pipeline
        stage per row). Not ``writev_async``: UCCL 0.1.1's vector operations complete before the data
        lands (tcp) or land it at the wrong offsets (IPC), ../shared/notes/uccl-0.1.1.md."""
        if self.closed:
            raise ConnectionClosed("write on a closed connection", peer=self.peer)
        return [asyncio.ensure_future(self._replay(table, epoch))]

    async def _replay(self, table: list, epoch: int) -> None:
        for src, region, offset in table:
            await self._put_row(src, region, offset, epoch)

    async def fence(self) -> None:
        """Write the next sequence number into the target's mailbox, behind every earlier write on this
        connection, then report this round's counts: the target answers once it sees that number in
        its mailbox, that is once everything before it has landed."""
        if self.closed:
            raise ConnectionClosed("fence on a closed connection", peer=self.peer)
        self._seq += 1
        self._seq_src.fill_(self._seq)
        if self._seq_src.is_cuda:
            await cuda_rt.stream_done(self._seq_src.device)
        await self._put(self._seq_src, 0, 8, self._mailbox, "fence mailbox write")
        epoch, count, total = self._round
        frame = FRAME.pack(OP_FENCE, 0, self._seq, count, total, max(epoch, 0))
        echo = await self._request(frame, FRAME.size)
        if echo[4:] != frame[4:]:
            raise TransportError("fence echo does not match what was sent", peer=self.peer)
        if FRAME.unpack(echo)[1]:
            raise TransportError(f"the target did not see this connection's writes land within "
                                 f"{FENCE_TIMEOUT_S:.0f}s", peer=self.peer)

    async def close(self) -> None:
        self.closed = True
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)
        self._writer.close()
