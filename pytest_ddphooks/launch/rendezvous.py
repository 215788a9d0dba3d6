"""Loopback-only rendezvous, private to one run.

The launcher binds a listening socket on 127.0.0.1 port 0 and keeps it open; rank 0 hands
its descriptor to a TCPStore (``master_listen_fd``), so the store never opens a port on
another interface and no other run can take the port between choosing and binding it.
Every rank, and code that initialises the group itself through ``env://``, connects to it
as a client (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun). Gloo binds to ``lo``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"

# Variables a launched rank sees, as torchrun sets them.
DIST_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def listener() -> socket.socket:
    """A socket listening on 127.0.0.1 with a port the kernel chose; kept open."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(256)
    return sock


def rank_env(
    rank: int, world_size: int, nodes: int, port: int, run_id: str, attempt: int = 0, max_restarts: int = 0
) -> dict[str, str]:
    local = world_size // nodes
    node = rank // local
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local),
        "LOCAL_WORLD_SIZE": str(local),
        "NODE_RANK": str(node),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def store(rank: int, world_size: int, port: int, listen_fd: int | None, timeout: float) -> Any:
    """The run's TCPStore: served by rank 0 from the launcher's socket, a client elsewhere."""
    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    with no_reverse_lookups():
        if rank == 0:
            return dist.TCPStore(
                LOOPBACK, port, world_size, True, wait, wait_for_workers=False, master_listen_fd=listen_fd
            )
        return dist.TCPStore(LOOPBACK, port, world_size, False, wait)


# what torch's socket code logs when the reverse lookup of a peer's name fails
UNNAMED_PEER_WARNING = b"The hostname of the client socket cannot be retrieved"


@contextlib.contextmanager
def no_reverse_lookups(host: str = LOOPBACK) -> Iterator[None]:
    """A TCPStore client names its connection with a reverse DNS lookup of the store's
    address as IPv6 (``::ffff:127.0.0.1``, which /etc/hosts does not list), only to log it.
    Where the DNS server drops the query, glibc waits at least 1 s (5 s, twice, by default):
    on this machine one connection in about sixty. While a store connects here the resolver
    sends no query at all (``attempts:0``: the name is then the address itself) and torch's
    warning about the unnamed peer is left out of stderr; anything else written to stderr
    meanwhile is kept. The test's environment is left as it was. A store reached by name
    (``host`` not an address: torchrun's MASTER_ADDR may be one) needs the resolver to find
    it, and nothing changes."""
    if not _is_address(host):
        yield
        return
    before = os.environ.get("RES_OPTIONS")
    os.environ["RES_OPTIONS"] = f"{before or ''} attempts:0".strip()
    try:
        with _stderr_without(UNNAMED_PEER_WARNING):
            yield
    finally:
        if before is None:
            os.environ.pop("RES_OPTIONS", None)
        else:
            os.environ["RES_OPTIONS"] = before


@contextlib.contextmanager
def _stderr_without(needle: bytes) -> Iterator[None]:
    """What is written to descriptor 2 meanwhile reaches it afterwards, but for the lines
    holding ``needle`` (nothing is held back where descriptor 2 is not open)."""
    with contextlib.suppress(ValueError, OSError):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    held = os.memfd_create("ddphooks-stderr", os.MFD_CLOEXEC)
    os.dup2(held, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        _replay_without(held, needle)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _replay_without(fd: int, needle: bytes) -> None:
    """What was written to ``fd`` goes to stderr, but for the lines holding ``needle``."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    kept = [line for line in b"".join(chunks).splitlines(keepends=True) if needle not in line]
    if kept:
        os.write(2, b"".join(kept))
