"""The target side of a TCP connection: a ``BufferedProtocol`` state machine that lands WRITEs in place.

How this works: the agent reads headers and small payloads into a 256 KiB intake (many frames per
``recv``) and lands whole small WRITEs from it in one tight loop; a payload with ``DIRECT_MIN`` bytes or
more still to come is received straight into its region (``recv_into``). Before a HELLO whose proof
verifies (``weightsync.engine.dataauth``) any other frame closes the connection; after it, every WRITE is checked
against the guard and the region's bounds, else drained and reported at the next FENCE, never applied.
A write whose round or region closes while its payload is still arriving is drained from then on. The
front door: a
connection that has not proven a key within ``handshake_timeout_s`` is closed, and at most
``max_unauthenticated`` connections (``max_unauthenticated_per_address`` from one address) wait for
their proof at once: a newcomer over the cap evicts the oldest waiting one, so strangers can hold
neither the process's descriptors nor a planned sender's place.
Counts are per row (a WRITE_RUN counts as its rows) and cumulative per connection, what a FENCE's ACK
reports, and what a delivery proof waits on (``landed_by``: fulfilled once the connection has landed a
count and bytes, failed when it closes first).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Optional

from .. import dataauth
from ..errors import ConnectionClosed
from .tcp_frames import (ACK, DIRECT_MIN, HEADER, INTAKE, MAGIC, OFFSET_MASK, OP_ACK, OP_CHALLENGE, OP_FENCE,
                         OP_HELLO, OP_WRITE, OP_WRITE_RUN, RUN_SHIFT, SCRATCH)

if TYPE_CHECKING:
    from .tcp import TcpTransport


class AgentProtocol(asyncio.BufferedProtocol):
    """Target side of one connection: header -> payload (into the region) or drain -> header ..."""

    def __init__(self, owner: "TcpTransport") -> None:
        self.owner = owner
        self.header = bytearray(HEADER.size)
        self.scratch = bytearray(SCRATCH)
        self.intake = memoryview(bytearray(INTAKE))
        self.direct = False  # the last buffer handed out was the target itself (or scratch), not the intake
        self.dead = False
        self.target: memoryview = memoryview(self.header)
        self.pos = 0
        self.state = "header"
        self.drain_left = 0
        self.source = -1
        self.key: Optional[bytes] = None  # the pair key this connection proved (None: not authenticated)
        self.nonce = dataauth.new_nonce()
        self.proof = bytearray(dataauth.PROOF_BYTES)
        self.peer = "?"
        self.region = -1  # the region the payload in progress lands in
        self.rows = 1  # writes the frame in progress stands for (a WRITE_RUN: several rows back to back)
        self.epoch = 0
        self.landed_count = 0  # cumulative, per connection: what a FENCE acknowledges
        self.landed_bytes = 0
        self.errors: list[tuple[int, str]] = []  # (round, why): refused writes a fence reports while their round is open
        self.waiting: list[tuple[int, int, int, asyncio.Future]] = []  # delivery proofs: (source, count, bytes, fulfilled)
        self.transport: asyncio.Transport
        self.deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.owner.closing:  # accepted just as the transport closed
            transport.close()
            return
        self.peer = "%s:%s" % tuple(transport.get_extra_info("peername") or ("?", "?"))[:2]
        self.owner._agents.add(self)
        self.owner.door.arrived(self)
        self.deadline = asyncio.get_running_loop().call_later(self.owner.options.handshake_timeout_s, self._expired)
        lo, hi = int.from_bytes(self.nonce[:8], "little"), int.from_bytes(self.nonce[8:], "little")
        transport.write(HEADER.pack(OP_CHALLENGE, 0, lo, hi, 0))

    def connection_lost(self, exc) -> None:
        self.owner._agents.discard(self)
        self.owner.door.left(self)
        if self.deadline is not None:
            self.deadline.cancel()
        self._fail_waiting("closed")

    def landed_by(self, source: int, count: int, nbytes: int) -> asyncio.Future:
        """Fulfilled once this connection has proven ``source``'s key (its hello may still be on the way)
        and landed (or drained) ``count`` writes and ``nbytes`` bytes in all; failed with
        ``ConnectionClosed`` if it closes first (a hello that does not verify closes it)."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((source, count, nbytes, fut))
        if self.dead:
            self._fail_waiting("closed")
        self._wake()
        return fut

    def _wake(self) -> None:
        if not self.waiting:
            return
        still = []
        for source, count, nbytes, fut in self.waiting:
            if fut.done():
                continue
            proven = self.key is not None and self.source == source
            if proven and self.landed_count >= count and self.landed_bytes >= nbytes:
                fut.set_result(None)
            else:
                still.append((source, count, nbytes, fut))
        self.waiting = still

    def _fail_waiting(self, why: str) -> None:
        waiting, self.waiting = self.waiting, []
        for _, count, _, fut in waiting:
            if not fut.done():
                fut.set_exception(ConnectionClosed(f"the connection {why} after {self.landed_count} of the "
                                                   f"{count} writes a delivery proof counts", peer=self.peer))

    def _expired(self) -> None:
        if self.key is None and not self.dead:
            self.owner.guard.refuse(self.peer, f"no authenticated hello within "
                                    f"{self.owner.options.handshake_timeout_s}s", "handshake timeout")
            self.owner.door.expired(self)
            self._close()

    def get_buffer(self, sizehint: int) -> memoryview:
        """A large payload (or drain) is received in place; headers and small payloads, many per recv,
        into the intake, and copied from there (``_feed``)."""
        self.direct = True
        if self.state == "drain" and self.drain_left >= DIRECT_MIN:
            return memoryview(self.scratch)[: min(SCRATCH, self.drain_left)]
        if self.state == "payload" and len(self.target) - self.pos >= DIRECT_MIN:
            return self.target[self.pos:]
        self.direct = False
        return self.intake

    def buffer_updated(self, nbytes: int) -> None:
        if not self.direct:
            self._feed(nbytes)
        elif self.state == "drain":
            self.drain_left -= nbytes
            if self.drain_left == 0:
                self._expect_header()
        else:
            self.pos += nbytes
            if self.pos == len(self.target):
                self._complete()
        self._wake()

    def _feed(self, nbytes: int) -> None:
        """Consume ``nbytes`` of the intake: each state takes what it needs, in order."""
        data, at = self.intake, 0
        while at < nbytes and not self.dead:
            if self.state == "header" and self.pos == 0 and self.key is not None:
                at = self._writes(at, nbytes)  # the common case, whole small WRITEs, in one tight loop
                if at >= nbytes:
                    break
            if self.state == "drain":
                take = min(self.drain_left, nbytes - at)
                self.drain_left -= take
                at += take
                if self.drain_left == 0:
                    self._expect_header()
                continue
            take = min(len(self.target) - self.pos, nbytes - at)
            self.target[self.pos:self.pos + take] = data[at:at + take]
            self.pos += take
            at += take
            if self.pos == len(self.target):
                self._complete()

    def _writes(self, at: int, end: int) -> int:
        """Land the whole, small, acceptable WRITE frames at ``intake[at:end]`` in a row; return where
        the first other thing starts (a partial frame, a large payload, another op, anything refused:
        the general path takes it from there)."""
        data, owner, size = self.intake, self.owner, HEADER.size
        unpack, regions = HEADER.unpack_from, owner.regions
        accepted: set = set()  # regions this call found open (the guard's verdict holds within one call)
        counter, counted_epoch = None, -1
        count = nbytes = 0
        while end - at >= size:
            op, region_id, offset, length, epoch = unpack(data, at)
            if length >= DIRECT_MIN or end - at - size < length or epoch <= owner.closed_epoch:
                break
            rows = 1
            if op == OP_WRITE_RUN:
                rows, offset = offset >> RUN_SHIFT, offset & OFFSET_MASK
            elif op != OP_WRITE:
                break
            if region_id not in accepted:
                region = regions.get(region_id)
                if region is None or owner.guard.write_problem(self.source, self.key, region_id) is not None:
                    break
                accepted.add(region_id)
                owner._dirty.add(region_id)
            region = regions[region_id]
            if offset + length > len(region):
                break
            region[offset:offset + length] = data[at + size:at + size + length]
            at += size + length
            if epoch != counted_epoch:
                counter, counted_epoch = owner.count(self.source, epoch), epoch
            counter.count += rows
            counter.nbytes += length
            self.epoch = epoch
            count += rows
            nbytes += length
        self.landed_count += count
        self.landed_bytes += nbytes
        return at

    def _complete(self) -> None:
        """The buffer of the current state is full: a header, a proof or a payload."""
        if self.state == "header":
            self._on_header(*HEADER.unpack(self.header))
        elif self.state == "proof":
            self._on_proof()
        else:
            self._landed(len(self.target))
            self._expect_header()

    def _close(self) -> None:
        self.dead = True
        self.owner.door.left(self)  # (at once: the peer may see the close before ``connection_lost`` runs)
        self.transport.close()
        self._fail_waiting("was closed")

    def _expect_header(self) -> None:
        self.state, self.target, self.pos = "header", memoryview(self.header), 0

    def _landed(self, nbytes: int) -> None:
        self.landed_count += self.rows
        self.landed_bytes += nbytes
        if self.epoch > self.owner.closed_epoch:
            c = self.owner.count(self.source, self.epoch)
            c.count += self.rows
            c.nbytes += nbytes

    def _on_header(self, op: int, a: int, b: int, c: int, epoch: int) -> None:
        self.pos = 0
        if self.key is None:  # nothing but an authenticated hello before anything else
            if op == OP_HELLO and b == MAGIC and self.source < 0:
                self.source = a
                self.state, self.target = "proof", memoryview(self.proof)
                return
            self.owner.guard.refuse(self.peer, f"op {op} before an authenticated hello (magic {b:#x})", "bad hello")
            self._close()
            return
        if op in (OP_WRITE, OP_WRITE_RUN):
            self.rows = 1 if op == OP_WRITE else b >> RUN_SHIFT
            b &= OFFSET_MASK
            self.epoch = epoch
            if epoch <= self.owner.closed_epoch:  # a late write of a round that is over: drain it
                self._drain(c)
                return
            problem = self.owner.guard.write_problem(self.source, self.key, a)
            if problem is not None:
                self.owner.guard.refuse(self.peer, f"write of {c} bytes to region {a}: {problem}", "write refused")
                self._error(f"refused: {problem}")
                self._drain(c)
                return
            region = self.owner.regions.get(a)
            if region is None or b + c > len(region):
                size = "missing" if region is None else f"{len(region)} bytes"
                why = f"sender/{self.source}: write of {c} bytes at region {a} offset {b} is out of bounds (region {size})"
                self.owner.guard.refuse(self.peer, why, "out of bounds")
                self._error(why)
                self._drain(c)
                return
            if c == 0:
                self._landed(0)
                return
            self.owner._dirty.add(a)
            self.state, self.target, self.region = "payload", region[b:b + c], a
        elif op == OP_FENCE:  # (what was refused in rounds still open here: a closed round's are its own)
            closed = self.owner.closed_epoch
            text = "; ".join(t for e, t in self.errors if e > closed)[:1000].encode()
            self.errors = []
            self.transport.write(ACK.pack(OP_ACK, b, self.landed_count, self.landed_bytes, len(text)) + text)
        else:
            self.owner.guard.refuse(self.peer, f"sender/{self.source}: unknown frame op {op}; closing", "bad frame")
            self._error(f"unknown frame op={op} (or bad hello); closing")
            self._close()

    def stop_if_closed(self) -> None:
        if self.state != "payload":
            return
        guard = self.owner.guard
        if self.epoch > self.owner.closed_epoch and (guard.open is None or self.region in guard.open):
            return
        left = len(self.target) - self.pos
        self.landed_count += self.rows  # consumed (the initiator counts it), never completed
        self.landed_bytes += len(self.target)
        if self.epoch > self.owner.closed_epoch:  # (a late write of a round that is over is dropped quietly:
            #                                        reported, it would fail the next round's fence)
            self._error(f"write into region {self.region} stopped mid-payload: its region closed")
        self.pos = 0
        if left:
            self.state, self.drain_left = "drain", left
        else:
            self._expect_header()
        self._wake()

    def _on_proof(self) -> None:
        self._expect_header()
        self.key = self.owner.guard.admit(self.source, self.nonce, bytes(self.proof), self.peer)
        if self.key is None:
            self._close()
            return
        self.owner.door.proven(self)
        if self.deadline is not None:
            self.deadline.cancel()

    def _drain(self, nbytes: int) -> None:
        """Consume a write without applying it; it still counts as delivered for the fence."""
        self.landed_count += self.rows
        self.landed_bytes += nbytes
        if nbytes:
            self.state, self.drain_left = "drain", nbytes

    def _error(self, text: str) -> None:
        closed = self.owner.closed_epoch  # (a lane that seals early sends no fence: those of closed rounds go)
        self.errors = [(e, t) for e, t in self.errors if e > closed]
        self.errors.append((self.epoch, text))
        self.owner.count(self.source, self.epoch).errors.append(text)


class FrontDoor:
    """The connections still waiting to prove a key, oldest first, bounded overall and per address: a
    newcomer over either cap evicts the oldest waiting one (of its own address first)."""

    def __init__(self, limit: int, per_address: int) -> None:
        self.limit = limit
        self.per_address = per_address
        self.waiting: dict[AgentProtocol, str] = {}  # (insertion order: oldest first) -> its address
        self.evicted = 0
        self.timed_out = 0  # closed by the handshake timeout
        self.most = 0  # the most ever waiting at once (never above ``limit``)

    def __repr__(self) -> str:
        return (f"<FrontDoor waiting={len(self.waiting)} most={self.most} evicted={self.evicted} "
                f"timed_out={self.timed_out}>")

    def arrived(self, agent: AgentProtocol) -> None:
        address = agent.peer.rpartition(":")[0]
        same = [a for a, addr in self.waiting.items() if addr == address]
        if len(same) >= self.per_address:
            self._evict(same[0], f"over {self.per_address} unauthenticated connections from {address}")
        elif len(self.waiting) >= self.limit:
            self._evict(next(iter(self.waiting)), f"over {self.limit} unauthenticated connections")
        self.waiting[agent] = address
        self.most = max(self.most, len(self.waiting))

    def expired(self, agent: AgentProtocol) -> None:
        """``agent`` proved no key within the handshake timeout (it is being closed)."""
        if self.waiting.pop(agent, None) is not None:
            self.timed_out += 1

    def _evict(self, agent: AgentProtocol, why: str) -> None:
        self.evicted += 1  # (``_close`` takes it off the waiting list)
        agent.owner.guard.refuse(agent.peer, f"closed, not authenticated: {why}", "evicted")
        agent._close()

    def proven(self, agent: AgentProtocol) -> None:
        self.waiting.pop(agent, None)

    def left(self, agent: AgentProtocol) -> None:
        self.waiting.pop(agent, None)
