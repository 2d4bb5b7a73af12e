"""The processes of a benchmark over network namespaces (``bench/cluster.py``), both sides of them.

How this works: a driver starts children (``Fleet.start``: the script's ``child`` verb inside a host's
namespace) and reads their stdout, one JSON event a line (``emit``), into a backlog that ``expect``
takes events from by kind; it writes commands to their stdin, one a line (``say``; ``each_line`` on
the child's side handles them in turn), and closes stdin to ask a child to leave (``close``: workers
at once, then the controller; killed 30 s later). Nothing waits without a bound: a wait that runs
out makes every child print its stacks on stderr (SIGUSR1), and so does SIGTERM to the driver
(``until_terminated``), which then cancels the run so its ``finally`` blocks clean up.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import sys
import time

from weightsync.engine.aio import within

def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def lines() -> "asyncio.StreamReader":
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def each_line(handle) -> None:
    """``handle`` each line of stdin (split in words), one at a time, until stdin closes (the driver's
    word to leave), which cancels the one running: a push waiting on a round that cannot start does
    not keep the process."""
    reader, queue = await lines(), asyncio.Queue()

    async def run() -> None:
        while True:
            await handle(await queue.get())
    task = asyncio.ensure_future(run())
    try:
        while line := await reader.readline():
            queue.put_nowait(line.decode().split())
    finally:
        task.cancel()
        outcome, = await asyncio.gather(task, return_exceptions=True)
    if not isinstance(outcome, asyncio.CancelledError):
        raise outcome


FLEETS: set = set()  # the fleets with children now (SIGTERM makes them print their stacks)


class Fleet:
    """The children of one case, by name, each with its stdout read line by line into events."""

    def __init__(self, script: pathlib.Path, cluster, args, key_file: str) -> None:
        FLEETS.add(self)
        self.script, self.cluster, self.args, self.key_file = script, cluster, args, key_file
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.events: asyncio.Queue = asyncio.Queue()
        self.backlog: list[tuple[str, dict]] = []
        self.readers: list[asyncio.Task] = []

    async def start(self, name: str, host: str, role: str, *extra: str) -> None:
        c = self.cluster
        argv = [sys.executable, str(self.script), "child", role, "--addr", c.address(host),
                "--controller", c.address("c"), "--key-file", self.key_file, "--model", self.args.model_now,
                "--rate-bytes", str(self.args.rate_bytes), "--heartbeat", str(self.args.heartbeat),
                "--timeout", str(self.args.timeout), *extra]
        proc = await asyncio.create_subprocess_exec("ip", "netns", "exec", c.ns(host), *argv,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self.procs[name] = proc
        self.readers.append(asyncio.ensure_future(self._read(name, proc)))

    async def _read(self, name: str, proc) -> None:
        while line := await proc.stdout.readline():
            try:
                await self.events.put((name, json.loads(line)))
            except json.JSONDecodeError:
                pass
        await self.events.put((name, {"event": "exit", "code": await proc.wait()}))

    async def expect(self, event: str, n: int = 1, timeout: float = 120.0) -> list[tuple[str, dict]]:
        """The next ``n`` events of this kind; the others stay queued, in order, for later calls."""
        got, deadline = [], time.monotonic() + timeout
        while len(got) < n:
            match = next((item for item in self.backlog if item[1]["event"] == event), None)
            if match is not None:
                self.backlog.remove(match)
                got.append(match)
                continue
            if time.monotonic() > deadline:
                self.dump()
                said = sorted(name for name, _ in got)
                raise asyncio.TimeoutError(f"{len(got)} of {n} {event} within {timeout}s (from {said}); "
                                           f"the children's stacks are on stderr")
            await self.pump()
            failed = next((f"{name} exited with {ev['code']}" for name, ev in self.backlog
                           if ev["event"] == "exit" and ev["code"] != 0), None)
            if failed is not None and event != "exit":  # (a finished broadcast rank exits 0 before rank 0 says so)
                raise RuntimeError(f"{failed} while waiting for {event}")
        return got

    def dump(self) -> None:
        """The driver's tasks, then every live child's stacks, on stderr."""
        print_tasks()
        self.dump_children()

    def dump_children(self) -> None:
        """Every live child prints its stacks on stderr (SIGUSR1: see ``child``)."""
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGUSR1)

    async def pump(self) -> None:
        """Move what the children said into the backlog (waiting a tenth of a second at most: several
        coroutines read the backlog, so none may sit on the queue while another holds what it needs).
        Not ``wait_for``: on Python 3.11 it swallows a cancellation that arrives as the event does, and
        ``Pusher.stop`` would wait for ever."""
        getter = asyncio.ensure_future(self.events.get())
        try:
            await asyncio.wait([getter], timeout=0.1)
        finally:
            if getter.done() and not getter.cancelled():
                self.backlog.append(getter.result())
            else:
                getter.cancel()  # (an event not taken yet stays queued)
        while not self.events.empty():
            self.backlog.append(self.events.get_nowait())

    def say(self, name: str, text: str) -> None:
        self.procs[name].stdin.write(text.encode() + b"\n")

    async def close(self) -> None:
        """Workers leave first (all at once), then the controller (so none of them tries to join again)."""
        workers = [proc for name, proc in self.procs.items() if name != "controller"]
        await asyncio.gather(*(self._end(proc) for proc in workers))
        if "controller" in self.procs:
            await self._end(self.procs["controller"])
        FLEETS.discard(self)
        for task in self.readers:
            task.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)

    @staticmethod
    async def _end(proc) -> None:
        """Close the child's stdin (its signal to leave); killed if it has not exited 30 s later."""
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        try:
            await within(proc.wait(), 30)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


def print_tasks() -> None:
    """Every task of the running loop, with its stack, on stderr (where a stuck process waits)."""
    for each in asyncio.all_tasks():
        each.print_stack(file=sys.stderr)


async def until_terminated(coro):
    """SIGTERM: the driver's tasks and every child's stacks on stderr, then the run is cancelled (its
    ``finally`` blocks end the children and remove the namespaces)."""
    task = asyncio.ensure_future(coro)

    def on_term() -> None:
        print_tasks()
        for fleet in FLEETS:
            fleet.dump_children()
        task.cancel()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)
    return await task
