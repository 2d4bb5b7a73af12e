"""Admission: may this hello join? Pure checks, in the order the protocol specifies (docs/PROTOCOL.md).

How this works: ``admission_problem`` returns ``(None, "")`` to admit, or a reject code and a text
naming the culprit: another major protocol version, a rank outside the configured range, a rank that
is already joined and alive, or a manifest that disagrees with those already joined (``Catalog``: the
planner's own rules, checked against what the joined members hold, in time that grows with the
newcomer's manifest only). A receiver asking for a name or rows no joined sender holds is rejected
only once every configured sender has joined: before that the holder may be one still to come.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

from weightsync.engine.errors import PlanError
from weightsync.engine.plan import Catalog, Participant
from weightsync.wire import PROTOCOL_VERSION, Role
from weightsync.wire import messages as m


def participants(hellos: Iterable[m.Hello]) -> tuple[list[Participant], list[Participant]]:
    out: dict[Role, list[Participant]] = {Role.SENDER: [], Role.RECEIVER: []}
    for h in hellos:
        out[h.role].append(Participant(h.rank, h.manifest, h.transport))
    return out[Role.SENDER], out[Role.RECEIVER]


def admission_problem(hello: m.Hello, expected: Mapping[Role, int], joined: Mapping[tuple[Role, int], object],
                      catalog: Catalog) -> tuple[Optional[m.RejectCode], str]:
    """Admit ``hello`` or say why not; an admitted newcomer is recorded in ``catalog`` (which must hold
    exactly the members in ``joined``: ``Catalog.sync``)."""
    if hello.proto_major != PROTOCOL_VERSION[0]:
        return m.RejectCode.VERSION_MISMATCH, f"protocol {hello.proto_major}.{hello.proto_minor} is not compatible"
    limit = expected[hello.role]
    if hello.rank >= limit:
        return m.RejectCode.BAD_RANK, f"{hello.role.value} rank {hello.rank} is outside 0..{limit - 1}"
    if (hello.role, hello.rank) in joined:
        return m.RejectCode.DUPLICATE_RANK, f"{hello.role.value}/{hello.rank} is already joined (and alive)"
    try:
        if hello.role is Role.SENDER:
            catalog.admit_sender(hello.rank, hello.manifest)
        else:
            catalog.admit_receiver(hello.rank, hello.manifest, len(catalog.senders) == expected[Role.SENDER])
    except PlanError as exc:
        return m.RejectCode.MANIFEST_MISMATCH, str(exc)
    return None, ""
