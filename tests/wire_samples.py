"""One fixed sample envelope per message type: the source of the golden byte vectors."""

from __future__ import annotations

import dataclasses

from weightsync.wire import (
    Envelope,
    ExpectedEntry,
    Manifest,
    PeerInfo,
    ReceiverTable,
    RegionInfo,
    SenderTable,
    ShardSpec,
    Slice,
    TensorSpec,
    Transfer,
    TransportInfo,
)
from weightsync.wire import messages as m

TRANSPORT = TransportInfo("tcp", "node-a", "127.0.0.1:40001", "cpu", b"")
REGION = RegionInfo(0, 4096, "cpu", b"\x00\x01region")
MANIFEST = Manifest(
    tensors=(
        TensorSpec("embed.weight", "bfloat16", (16, 8), 256, (8, 1), True, "cpu", 0, 0, None, None, False),
        TensorSpec("lm_head.weight", "bfloat16", (16, 8), 256, (8, 1), True, "cpu", 0, 0, None, "embed.weight", False),
        TensorSpec(
            "mlp.up.weight", "float32", (2, 8), 64, (8, 1), True, "cpu", 0, 256,
            ShardSpec((4, 8), 0, 2, 4), None, True,
        ),
        TensorSpec("step", "int64", (), 8, (), True, "cpu", None, 0, None, None, False),
    ),
    regions=(REGION,),
)
SENDER_TABLE = SenderTable(
    rank=0,
    transfers=(
        Transfer(0, "embed.weight", None, 1, "embed.weight", 0, 0, 256, ""),
        Transfer(1, "mlp.up.weight", Slice(0, 2, 4), 1, "mlp.up.weight", 0, 256, 64, "fp8_block128"),
    ),
    peers=(PeerInfo(1, TRANSPORT, (REGION,)),),
)
RECEIVER_TABLE = ReceiverTable(
    rank=1,
    entries=(
        ExpectedEntry("embed.weight", 0, 0, None, 0, 0, 256, ""),
        ExpectedEntry("mlp.up.weight", 0, 1, Slice(0, 2, 4), 0, 256, 64, "fp8_block128"),
    ),
)
SUMMARY = m.WriteSummary(1, 2, 320, (m.Checksum(0, 0xDEADBEEF), m.Checksum(1, 7)))

BODIES: dict[str, m.Message] = {
    "hello": m.Hello(m.Role.SENDER, 0, "node-a", "cpu", 4242, 1, 0, ("tcp", "checksum"), MANIFEST, TRANSPORT),
    "welcome": m.Welcome("s-1", 1, 0, 500, 5000, ("checksum", "pulse")),
    "reject": m.Reject(m.RejectCode.VERSION_MISMATCH, "major differs", 1, 0, 2, 3),
    "plan": m.Plan(9, SENDER_TABLE, None),
    "plan_ack": m.PlanAck(9, True, ""),
    "push": m.Push(3),
    "begin": m.UpdateBegin(3, 9, "crc32", (m.Slot(1, 1), m.Slot(2, 0))),
    "writes_done": m.WritesDone(3, 9, (SUMMARY,), 0.25, 1.5),
    "fence": m.Fence(3, (SUMMARY,)),
    "fence_ack": m.FenceAck(3, False, 320, ("mlp.up.weight",), "checksum mismatch"),
    "commit": m.Commit(3),
    "commit_ack": m.CommitAck(3, True, ""),
    "abort": m.Abort(3, m.AbortReason.PEER_LOST, "sender 0 missed heartbeats", "sender/0"),
    "heartbeat": m.Heartbeat(17),
    "leave": m.Leave("shutdown"),
    "error": m.Error(m.ErrorCode.TRANSPORT, "connection refused", "transport.address", 3),
    "status_request": m.StatusRequest(True),
    "status_reply": m.StatusReply({"version": 3, "paused": False, "links": [{"gbps": 1.5}], "x": None}),
    "command_request": m.CommandRequest("pause", {"reason": "maintenance"}),
    "command_reply": m.CommandReply(True, {"paused": True}, ""),
}
RECEIVER_PLAN = m.Plan(9, None, RECEIVER_TABLE)


def samples() -> dict[str, Envelope]:
    out = {}
    for i, (name, body) in enumerate(sorted(BODIES.items())):
        version = 3 if name in {"push", "begin", "writes_done", "fence", "fence_ack", "commit", "commit_ack", "abort"} else None
        out[name] = Envelope(body, msg_id=100 + i, sender="sender/0", parent_id=None if i % 2 else 99, version=version)
    out["plan_receiver"] = Envelope(RECEIVER_PLAN, msg_id=200, sender="controller", parent_id=None, version=None)
    out["fence_commit"] = Envelope(m.FenceCommit(3, (SUMMARY,)), msg_id=201, sender="controller", parent_id=99,
                                   version=3)  # added after the others: their vectors stay as they were
    out["writes_done_proof"] = Envelope(  # WriteSummary.proof (optional): absent above, present here
        m.WritesDone(3, 9, (dataclasses.replace(SUMMARY, proof=bytes(range(72))),), 0.25, 1.5),
        msg_id=202, sender="sender/0", parent_id=None, version=3)
    out["begin_ack"] = Envelope(m.BeginAck(3), msg_id=203, sender="receiver/0", parent_id=None, version=3)
    out["hello_rejoin"] = Envelope(  # Hello.committed and .landing (optional): a worker that saw v41 committed
        dataclasses.replace(BODIES["hello"], committed=41, landing=0, incarnation=bytes(range(8))), msg_id=204, sender="receiver/0",
        parent_id=None, version=None)
    out["welcome_committed"] = Envelope(dataclasses.replace(BODIES["welcome"], committed=41), msg_id=205,
                                        sender="controller", parent_id=None, version=None)
    out["welcome_stream"] = Envelope(dataclasses.replace(BODIES["welcome"], capabilities=("checksum", "pulse", "stream"),
                                                         stream_port=40123, stream_token=bytes(range(16))),
                                     msg_id=206, sender="controller", parent_id=None, version=None)
    out["plan_keys"] = Envelope(  # Plan.keys (optional): one data-plane key per peer of the table
        dataclasses.replace(BODIES["plan"], keys=(m.DataKey(1, bytes(range(32))),)), msg_id=206,
        sender="controller", parent_id=None, version=None)
    out["plan_committed"] = Envelope(  # Plan.committed (optional): the outcome a worker in doubt learns
        dataclasses.replace(BODIES["plan"], keys=(m.DataKey(1, bytes(range(32))),), committed=41), msg_id=207,
        sender="controller", parent_id=None, version=None)
    out["fence_ack_blame"] = Envelope(  # FenceAck.blame (optional): the sender a failed verification names
        dataclasses.replace(BODIES["fence_ack"], blame="sender/1"), msg_id=208, sender="receiver/0",
        parent_id=None, version=3)
    out["plan_ack_landing"] = Envelope(  # PlanAck.landing (optional): a two-slot receiver's next slot
        dataclasses.replace(BODIES["plan_ack"], landing=1), msg_id=209, sender="receiver/0", parent_id=None,
        version=None)
    out["begin_delta"] = Envelope(  # UpdateBegin.bases and .delta (optional): a delta round
        dataclasses.replace(BODIES["begin"], bases=(m.Base(1, 2), m.Base(2, 2)), delta="auto"), msg_id=210,
        sender="controller", parent_id=None, version=3)
    out["writes_done_delta"] = Envelope(  # WriteSummary.deltas (optional): rows that went as deltas
        m.WritesDone(3, 9, (dataclasses.replace(SUMMARY, nbytes=92, deltas=(m.DeltaRow(0, 60, 2**63 + 5, 18), m.DeltaRow(1, 32, 7, 4))),),
                     0.25, 1.5), msg_id=211, sender="sender/0", parent_id=None, version=3)
    out["writes_done_encode"] = Envelope(  # WritesDone.encode_s (optional): of stage_s, encoding deltas
        m.WritesDone(3, 9, (SUMMARY,), 0.25, 1.5, encode_s=0.125), msg_id=212, sender="sender/0", parent_id=None,
        version=3)
    out["fence_ack_times"] = Envelope(  # FenceAck.apply_s and .verify_s (optional): the verdict's work
        dataclasses.replace(BODIES["fence_ack"], apply_s=0.5, verify_s=0.25), msg_id=213, sender="receiver/0",
        parent_id=None, version=3)
    out["commit_ack_times"] = Envelope(  # CommitAck.apply_s and .verify_s (optional): a one-phase verdict's
        dataclasses.replace(BODIES["commit_ack"], apply_s=0.0625, verify_s=0.25), msg_id=214, sender="receiver/0",
        parent_id=None, version=3)
    out["arm"] = Envelope(  # the next round's parameters, before a one-phase round's commit
        m.Arm(5, 9, "fp64", (m.Slot(1, 0),), (m.Base(1, 3),), "auto"), msg_id=215, sender="controller",
        parent_id=None, version=3)
    out["armed_push"] = Envelope(m.ArmedPush(4, 5), msg_id=216, sender="sender/0", parent_id=None, version=4)
    out["commit_arm"] = Envelope(  # Commit.arm (optional, capability commit_arm): the next round's arm in the commit
        m.Commit(3, m.Arm(6, 9, "", (m.Slot(0, 1),), (), "")), msg_id=217, sender="controller", parent_id=None, version=3)
    return out
