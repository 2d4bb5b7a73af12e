"""Every transport's connections declare what they can do (``Abilities``) and do what they declare:
the data path reads the declaration and never probes, so a method left undeclared would never be
used and a flag without its methods would fail mid-round."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import fake_uccl
from transport_helpers import tcp_pair
from weightsync.engine.transport import (ABILITY_METHODS, Abilities, BACKENDS, Connection, TransportOptions,
                                         connect_authorized, create_transport, undeclared, unimplemented)
from weightsync.engine.transports.cuda_ipc import CudaIpcConnection
from weightsync.wire import PeerInfo


@contextlib.asynccontextmanager
async def pair(kind: str):
    if kind == "tcp":
        async with tcp_pair() as (_, _, conn):
            yield conn
        return
    make = {"memory": lambda: create_transport("memory"),
            "uccl": lambda: fake_uccl.FakeUcclTransport(TransportOptions())}[kind]
    src, dst = make(), make()
    info = await dst.start(1)
    await src.start(0)
    rinfo = dst.register(0, torch.zeros(64, dtype=torch.uint8))
    conn = await connect_authorized(src, dst, PeerInfo(1, info, (rinfo,)))
    try:
        yield conn
    finally:
        await conn.close()
        await src.close()
        await dst.close()


@pytest.mark.parametrize("kind", ["tcp", "memory", "uccl"])
async def test_a_connection_declares_what_it_implements_and_implements_what_it_declares(kind):
    async with pair(kind) as conn:
        assert isinstance(conn, Connection) and isinstance(conn.abilities, Abilities)
        assert unimplemented(conn) == [] and undeclared(conn) == [], (type(conn).__name__, conn.abilities)
        assert "cpu" in conn.abilities.devices


def test_cuda_ipc_connections_declare_what_they_implement():
    """(Its connections need two GPUs; its class states its abilities, checked here without them.)"""
    assert unimplemented(CudaIpcConnection) == [] and undeclared(CudaIpcConnection) == []
    assert CudaIpcConnection.abilities.seals and CudaIpcConnection.abilities.writes_in_place


def test_a_declaration_and_a_connection_that_disagree_are_named():
    class Liar:
        abilities = Abilities(submits=True, batch=4)

        def seal(self):
            return None

    assert unimplemented(Liar) == ["submit", "submit_many"] and undeclared(Liar) == ["seal"]
    assert {name for names in ABILITY_METHODS.values() for name in names} == {
        "compile", "replay", "submit", "submit_many", "seal", "address", "submit_written"}
    assert set(BACKENDS) >= {"tcp", "memory", "cuda_ipc", "uccl", "auto"}


def test_the_host_id_follows_the_network_namespace():
    """Namespaces share the hostname; the default host id must still tell them apart (and a process
    alone in the root namespace keeps one id)."""
    import shutil
    import subprocess
    import sys

    from weightsync.engine.transport import local_host_id

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    name = f"wstest-hostid-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        code = "from weightsync.engine.transport import local_host_id; print(local_host_id())"
        inside = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c", code], check=True,
                                capture_output=True, text=True).stdout.strip()
        outside = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)
    assert outside == local_host_id() and inside != outside
    assert inside.split("/")[:2] == outside.split("/")[:2]  # the same hostname and boot, another network
