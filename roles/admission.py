"""Admission: may this hello join? Pure checks, in the order the protocol specifies (docs/PROTOCOL.md).

How this works: ``admission_problem`` returns ``(None, "")`` to admit, or a reject code and a text
naming the culprit: another major protocol version, a rank outside the configured range, a rank that
is already joined and alive, or a manifest that disagrees with those already joined (checked by the
planner's own validation, so the same rules apply at join and at plan time, before any byte moves).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

from weightsync.engine.errors import PlanError
from weightsync.engine.plan import Mapping as NameMapping, Participant, build_pieces
from weightsync.wire import PROTOCOL_VERSION, Role
from weightsync.wire import messages as m


def participants(hellos: Iterable[m.Hello]) -> tuple[list[Participant], list[Participant]]:
    out: dict[Role, list[Participant]] = {Role.SENDER: [], Role.RECEIVER: []}
    for h in hellos:
        out[h.role].append(Participant(h.rank, h.manifest, h.transport))
    return out[Role.SENDER], out[Role.RECEIVER]


def admission_problem(hello: m.Hello, expected: Mapping[Role, int], joined: Mapping[tuple[Role, int], object],
                      senders: list[Participant], receivers: list[Participant],
                      mapping: "str | NameMapping" = "identity") -> tuple[Optional[m.RejectCode], str]:
    if hello.proto_major != PROTOCOL_VERSION[0]:
        return m.RejectCode.VERSION_MISMATCH, f"protocol {hello.proto_major}.{hello.proto_minor} is not compatible"
    limit = expected[hello.role]
    if hello.rank >= limit:
        return m.RejectCode.BAD_RANK, f"{hello.role.value} rank {hello.rank} is outside 0..{limit - 1}"
    if (hello.role, hello.rank) in joined:
        return m.RejectCode.DUPLICATE_RANK, f"{hello.role.value}/{hello.rank} is already joined (and alive)"
    newcomer = Participant(hello.rank, hello.manifest, hello.transport)
    if hello.role is Role.SENDER:
        senders = [*senders, newcomer]
    else:
        receivers = [*receivers, newcomer]
    try:
        if senders:
            build_pieces(senders, receivers, mapping=mapping)
    except PlanError as exc:
        return m.RejectCode.MANIFEST_MISMATCH, str(exc)
    return None, ""
