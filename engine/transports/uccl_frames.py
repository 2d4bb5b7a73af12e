"""The UCCL transport's side-channel frames and constants, and UCCL's return values made errors.

How this works: the side channel (a TCP connection beside UCCL's own, for pairing, descriptors and
fences) speaks fixed 36-byte frames (``FRAME``: op, a, b, c, d, e); ``ok`` turns UCCL's (ok, value)
tuples and bare bools into values or ``TransportError``. Both ends (``uccl`` the target and transport,
``uccl_connection`` the initiator) import them from here, as TCP's ends share ``tcp_frames``.
"""

from __future__ import annotations

import struct
from typing import Any, Optional

from ..errors import TransportError

FRAME = struct.Struct("<B3xIQQQQ")  # op, a, b, c, d, e
OP_HELLO, OP_ADVERTISE, OP_FENCE, OP_ACCEPTED, OP_CHALLENGE = 1, 2, 3, 4, 5
MAGIC = 0x5753_5543_0003  # "WSUC", version 3 (a challenge first, the hello proves the pair key)
BLOB = 64
REFUSED = b"\0" * BLOB
MAILBOX = 0xFFFFFFFF  # the region id that names a session's fence mailbox (one int64 at the target)
FENCE_TIMEOUT_S = 60.0  # how long a target waits for a fence's mailbox write to land
CHUNK = 1 << 30  # UCCL's sizes are u32 on its tcp path: larger writes go in pieces
PAIRING_TIMEOUT_S = 60.0
RDMA_DEPTH = 16  # writes in flight per connection over RDMA (unmeasured here: no NIC)


def ok(result: Any, what: str, peer: Optional[str] = None) -> Any:
    """UCCL returns (ok, value...) tuples or bare bools; turn failure into TransportError."""
    if isinstance(result, tuple):
        if not result[0]:
            raise TransportError(f"uccl {what} failed", peer=peer)
        return result[1] if len(result) == 2 else result[1:]
    if result is False:
        raise TransportError(f"uccl {what} failed", peer=peer)
    return result

