"""Child processes for end-to-end tests: each reports on its own pipe; every child is reaped."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
from multiprocessing.connection import wait

CTX = mp.get_context("spawn")
WATCHDOG = 60.0


async def bench_json(script: str, *argv: str, timeout: float = 240.0) -> tuple[int, dict]:
    """Run ``bench/<script> ... --json`` as a process; its exit status and the JSON of its last line. Its
    stderr is the test's (pytest shows it with a failure). Past ``timeout`` it gets SIGTERM (a bench that
    handles it prints where it waits and cleans up), then SIGKILL 45 s later, and the test fails (within
    the 300 s those tests allow)."""
    import json
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / script
    proc = await asyncio.create_subprocess_exec(sys.executable, str(path), *argv, "--json", stdout=asyncio.subprocess.PIPE)
    communicate = asyncio.ensure_future(proc.communicate())
    done, _ = await asyncio.wait([communicate], timeout=timeout)
    if not done:
        proc.terminate()
        try:
            await asyncio.wait_for(asyncio.shield(communicate), 45)
        except asyncio.TimeoutError:
            proc.kill()
            await communicate
        raise TimeoutError(f"bench/{script} {' '.join(argv)} still running after {timeout}s (stderr: where it waited)")
    out, _ = communicate.result()
    lines = out.decode().strip().splitlines()
    if not lines:
        raise RuntimeError(f"bench/{script} {' '.join(argv)} exited {proc.returncode} printing nothing (stderr: why)")
    return proc.returncode, json.loads(lines[-1])


def free_port() -> int:
    """A loopback port that was free a moment ago (for a child's own listener or rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Children:
    """Child processes, each reporting on its own pipe; every child is reaped on exit."""

    def __init__(self) -> None:
        self.procs: dict[tuple[str, int], mp.Process] = {}
        self.pipes: dict[tuple[str, int], object] = {}
        self.backlog: list = []

    def start(self, role: str, rank: int, target, *args, **kwargs) -> None:
        reader, writer = CTX.Pipe(duplex=False)
        p = CTX.Process(target=target, args=(*args[:3], writer, *args[3:]), kwargs=kwargs, daemon=True)
        p.start()
        writer.close()
        self.procs[(role, rank)] = p
        self.pipes[(role, rank)] = reader

    def _next(self):
        ready = wait(list(self.pipes.values()), WATCHDOG)
        if not ready:
            raise AssertionError(f"no report within {WATCHDOG}s")
        for conn in ready:
            try:
                self.backlog.append(conn.recv())
            except EOFError:  # that child exited (or was killed): stop listening to it
                self.pipes = {k: c for k, c in self.pipes.items() if c is not conn}
        return None

    async def expect(self, kind: str, n: int = 1) -> list:
        """The next n reports of this kind; reports of other kinds stay queued, in order, for later
        calls (children run concurrently). A child's error fails the test at once."""
        got = []
        loop = asyncio.get_running_loop()
        while len(got) < n:
            for item in self.backlog:
                if item[0] == "error":
                    raise AssertionError(f"{item[1]} {item[2]} failed:\n{item[3]}")
            match = next((item for item in self.backlog if item[0] == kind), None)
            if match is None:
                await loop.run_in_executor(None, self._next)
                continue
            self.backlog.remove(match)
            got.append(match)
        return got

    def kill(self, role: str, rank: int) -> None:
        p = self.procs.pop((role, rank))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        self.pipes.pop((role, rank)).close()

    def close(self) -> None:
        for p in self.procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.pipes.values():
            conn.close()


