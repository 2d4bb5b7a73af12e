"""An initiator's TCP connect, up to the target's challenge (``TcpTransport.connect`` then proves its key).

How this works: ``dial`` connects a fresh non-blocking socket (``TCP_NODELAY``; ``TCP_USER_TIMEOUT``
where Linux has it, so a partitioned peer fails the connection instead of hanging it). A connect the
target does not answer within ``TransportOptions.connect_attempt_s`` is closed and begun again on a
fresh socket: a SYN lost to a partition would otherwise go again only on the kernel's schedule (1, 2,
3 and 4 s after the first on kernels with ``tcp_syn_linear_timeouts``, then backing off
exponentially; older kernels 1, 3, 7 s), which can outlast the whole connect after a heal. Once
connected it reads the challenge frame. Everything shares one deadline, ``connect_timeout_s``; a
timeout says which wait ran out ("no connection within" or "no challenge within"). A refused or
unreachable connect fails at once.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Callable

from ..aio import within
from ..errors import ConnectionClosed, TransportError
from ..transport import TransportOptions
from .tcp_frames import HEADER, OP_CHALLENGE


def make_socket(host: str, options: TransportOptions) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # (Linux) a partitioned peer fails the connection, not hangs it
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(options.tcp_user_timeout_s * 1000))
    return sock


async def dial(address: str, peer: str, options: TransportOptions, retried: Callable[[], None]) -> tuple[socket.socket, bytes]:
    """A connected socket to ``address`` ("host:port") and the 16-byte challenge the target sent on it;
    ``retried()`` is called for each connect begun again. Raises ``TransportError`` naming ``peer``."""
    host, _, port = address.rpartition(":")
    target = (host.strip("[]"), int(port))
    loop = asyncio.get_running_loop()
    timeout = options.connect_timeout_s
    deadline = loop.time() + timeout
    waiting = "no connection"  # (then "no challenge": which of the two a timeout cut short)
    sock = None
    try:
        while sock is None:
            attempt = make_socket(host, options)
            try:
                await within(loop.sock_connect(attempt, target), min(options.connect_attempt_s, deadline - loop.time()))
            except asyncio.TimeoutError:
                attempt.close()
                if loop.time() >= deadline:
                    raise
                retried()
                continue
            except BaseException:
                attempt.close()
                raise
            sock = attempt
        waiting = "no challenge"
        return sock, await within(read_challenge(loop, sock, peer), max(0.0, deadline - loop.time()))
    except (OSError, asyncio.TimeoutError) as exc:
        if sock is not None:
            sock.close()
        why = f"{waiting} within {timeout}s" if isinstance(exc, asyncio.TimeoutError) else str(exc)
        raise TransportError(f"cannot connect to {address}: {why}", peer=peer) from exc
    except BaseException:
        if sock is not None:
            sock.close()
        raise


async def read_challenge(loop: asyncio.AbstractEventLoop, sock: socket.socket, peer: str) -> bytes:
    frame = b""
    while len(frame) < HEADER.size:
        try:
            chunk = await loop.sock_recv(sock, HEADER.size - len(frame))
        except OSError as exc:
            raise ConnectionClosed(f"no challenge from the target: {exc}", peer=peer) from exc
        if not chunk:
            raise ConnectionClosed("the target closed before its challenge", peer=peer)
        frame += chunk
    op, _, lo, hi, _ = HEADER.unpack(frame)
    if op != OP_CHALLENGE:
        raise TransportError(f"the target sent op {op} instead of a challenge (another version?)", peer=peer)
    return lo.to_bytes(8, "little") + hi.to_bytes(8, "little")
