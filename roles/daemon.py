"""``weightsync daemon``: a standalone receiver that hands committed versions to a local inference engine.

How this works: the daemon owns a ``WeightReceiver`` (shadow mode by default), so receiving never
stops: every round the controller commits lands in the daemon's buffers. What the command socket
controls is the hand-over to the engine: a hook loaded by name (``module:function``, called as
``hook(version, [(name, tensor), ...])``, the shape of vLLM's ``load_weights``). While ``paused``, a
committed version waits as ``pending``; ``apply`` hands it over now, ``drop`` discards it, ``resume``
hands over what is pending and continues automatically. The command socket is a ZeroMQ ROUTER that
answers ``command_request`` / ``status_request`` with ``command_reply`` / ``status_reply`` from
``wire``; with an auth key only holders may command. ``shutdown`` (or SIGINT/SIGTERM via the CLI)
closes cleanly: a round in flight is aborted by the controller and never half-applied here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
from typing import Any, Callable, Mapping, Optional

import torch
import zmq

from weightsync.engine.aio import within
from weightsync.engine.errors import ConfigError
from weightsync.wire import Envelope, ShardSpec
from weightsync.wire import messages as m
from weightsync.wire.auth import Replayed, Unauthenticated
from weightsync.wire.errors import ProtocolError

from .channel import ControlChannel, check_auth_key, check_exposure
from .receiver import ReceiverOptions, WeightReceiver
from .worker import call_hook

log = logging.getLogger("weightsync")

Hook = Callable[[int, list], Any]


def load_hook(spec: str) -> Hook:
    """``package.module:function`` -> the function; a clear error otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError("hook", f"expected 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("hook", f"cannot load {spec!r}: {exc}") from exc
    if not callable(fn):
        raise ConfigError("hook", f"{spec!r} is not callable")
    return fn


@dataclasses.dataclass(frozen=True)
class DaemonOptions:
    command_bind: str = "tcp://127.0.0.1:0"
    receiver: ReceiverOptions = ReceiverOptions()
    auth_key: Optional[bytes] = None

    def __post_init__(self) -> None:
        check_auth_key(self.auth_key)
        check_exposure("command_bind", self.command_bind, self.auth_key)


class Daemon:
    def __init__(self, controller_addr: str, params: dict[str, torch.Tensor], *, rank: int,
                 hook: Optional[Hook] = None, options: DaemonOptions = DaemonOptions(),
                 shards: Mapping[str, ShardSpec] = {}) -> None:
        self.options = options
        self.hook = hook
        self.receiver = WeightReceiver(controller_addr, params, rank=rank, options=options.receiver,
                                       on_update=self._committed, shards=shards)
        self.paused = False
        self.pending: Optional[int] = None
        self.applied: Optional[int] = None
        self.handovers = 0
        self.command_address = ""
        self.stopped = asyncio.Event()
        self._chan: Optional[ControlChannel] = None
        self._serve_task: Optional[asyncio.Task] = None

    def __repr__(self) -> str:
        return (f"<Daemon {self.receiver.name} received=v{self.receiver.version} applied=v{self.applied} "
                f"pending={self.pending} paused={self.paused} handovers={self.handovers}>")

    async def __aenter__(self) -> "Daemon":
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def start(self) -> None:
        self._chan = ControlChannel(zmq.ROUTER, f"daemon/{self.receiver.rank}", auth_key=self.options.auth_key)
        try:
            self.command_address = self._chan.bind(self.options.command_bind)
            await self.receiver.start()
        except BaseException:
            self._chan.close()
            raise
        self._serve_task = asyncio.ensure_future(self._serve())

    async def close(self) -> None:
        if self._serve_task is not None:
            self._serve_task.cancel()
            await asyncio.gather(self._serve_task, return_exceptions=True)
        await self.receiver.close()
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        self.stopped.set()

    # --- hand-over --------------------------------------------------------------------------------

    async def _committed(self, version: int) -> None:
        if self.paused:
            self.pending = version
            return
        await self._hand_over(version)

    async def _hand_over(self, version: int) -> None:
        if self.hook is not None:
            await call_hook(self.hook, version, list(self.receiver.state_dict().items()))
        self.applied = version
        self.pending = None
        self.handovers += 1

    # --- commands ---------------------------------------------------------------------------------

    def status(self) -> dict:
        r = self.receiver
        return {"rank": r.rank, "mode": r.mode, "received_version": r.version, "applied_version": self.applied,
                "pending_version": self.pending, "paused": self.paused, "dirty": r.dirty,
                "rounds_committed": r.rounds_committed, "rounds_aborted": r.rounds_aborted,
                "handovers": self.handovers, "session": r.session.state.value, "device": str(r.device),
                "tensors": len(r.tensors), "bytes": r.nbytes}

    async def command(self, name: str, args: Any) -> Any:
        if name == "status":
            return self.status()
        if name == "pause":
            self.paused = True
        elif name == "resume":
            self.paused = False
            if self.pending is not None:
                await self._hand_over(self.pending)
        elif name == "apply":
            if self.pending is None:
                raise ConfigError("apply", "no pending version")
            await self._hand_over(self.pending)
        elif name == "drop":
            if self.pending is None:
                raise ConfigError("drop", "no pending version")
            self.pending = None
        elif name == "layout":
            return self.layout()
        elif name == "shutdown":
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.close()))
        else:
            raise ConfigError("command", f"unknown command {name!r} (status, pause, resume, apply, drop, layout, "
                                         f"shutdown)")
        return self.status()

    def layout(self) -> dict:
        """Where each tensor lives in the live buffer (for an engine that maps it, e.g. via CUDA IPC)."""
        r = self.receiver
        return {"device": str(r.device), "bytes": r.nbytes,
                "tensors": [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                             "offset": r.offsets[n], "shard": _shard_json(r.shards.get(n))}
                            for n, t in r.tensors.items()]}

    async def _serve(self) -> None:
        while True:
            try:
                peer, env = await self._chan.recv()
            except (Unauthenticated, Replayed) as exc:
                log.warning("daemon: dropped a command from %r: %s", getattr(exc, "peer", None), exc)
                continue
            except ProtocolError as exc:
                log.warning("daemon: undecodable command: %s", exc)
                continue
            await self._answer(peer, env)

    async def _answer(self, peer: bytes, env: Envelope) -> None:
        body = env.body
        if isinstance(body, m.StatusRequest):
            await self._chan.send(m.StatusReply(self.status()), to=peer, parent_id=env.msg_id)
            return
        if not isinstance(body, m.CommandRequest):
            await self._chan.send(m.CommandReply(False, None, f"{env.type} is not a command"), to=peer,
                                  parent_id=env.msg_id)
            return
        try:
            result = await self.command(body.command, body.args)
        except ConfigError as exc:
            await self._chan.send(m.CommandReply(False, None, str(exc)), to=peer, parent_id=env.msg_id)
            return
        await self._chan.send(m.CommandReply(True, result, ""), to=peer, parent_id=env.msg_id)


async def request(addr: str, body: m.Message, *, timeout_s: float = 10.0, auth_key: Optional[bytes] = None) -> Envelope:
    """One request/reply with a controller or daemon (the CLI's client side)."""
    chan = ControlChannel(zmq.DEALER, "cli", auth_key=auth_key)
    try:
        chan.connect(addr)

        async def ask() -> Envelope:
            await chan.send(body)
            return (await chan.recv())[1]
        return await within(ask(), timeout_s)
    finally:
        chan.close()


def _shard_json(shard: Optional[ShardSpec]) -> Optional[dict]:
    if shard is None:
        return None
    return {"dim": shard.dim, "start": shard.start, "stop": shard.stop, "full_shape": list(shard.full_shape)}
