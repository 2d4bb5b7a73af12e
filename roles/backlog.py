"""What a worker's receive loop has still to handle: control messages delivered to the process, not read yet.

How this works. A caller that holds the event loop (a trainer's step: synchronous compute between two
pushes) leaves what the controller sent meanwhile (an arm, a commit) in the control channel's socket,
where the receive loop has not seen it. Before a decision that depends on such messages (a push: under
an arm, or the usual way), ``unread`` takes every message delivered by now from the socket
(``ControlChannel.delivered``) and, where some are not handled yet, says how many the loop must have
taken; ``read`` waits until it has taken that many and finished handling the last. The receive loop
marks each message it takes (``taking``) and each it is done with (``handled``). One backlog per
session's channel: ``close`` (its loop ended, the session is over) ends every wait on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from weightsync.engine.aio import Waiters

if TYPE_CHECKING:
    from .channel import ControlChannel


class Backlog:
    def __init__(self, channel: "Optional[ControlChannel]") -> None:
        self.channel = channel
        self.handling = False  # the receive loop is handling a message it took
        self.closed = channel is None
        self._waiters = Waiters()

    def __repr__(self) -> str:
        received = self.channel.received if self.channel is not None else 0
        return f"<Backlog received={received} handling={self.handling}{' closed' if self.closed else ''}>"

    def taking(self) -> None:
        self.handling = True

    def handled(self) -> None:
        self.handling = False
        self._waiters.wake()

    def close(self) -> None:
        self.closed, self.handling = True, False
        self._waiters.wake()

    def unread(self) -> Optional[int]:
        """The count of messages taken from the socket that the loop must have handled, or None where it
        has handled every one delivered by now."""
        if self.closed:
            return None
        delivered = self.channel.delivered()
        return delivered if delivered > self.channel.received or self.handling else None

    async def read(self, delivered: int) -> None:
        """Until the loop has taken ``delivered`` messages and handled the last, or the backlog closed."""
        await self._waiters.wait(lambda: self.closed or (self.channel.received >= delivered and not self.handling))
