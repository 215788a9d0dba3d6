"""The run's store connects without asking DNS for the name of a loopback address."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pytest_ddphooks.launch import rendezvous


def test_stderr_written_while_a_store_connects_is_kept_but_the_unnamed_peer_warning(capfd) -> None:
    with rendezvous.no_reverse_lookups():
        os.write(2, b"first line\n")
        os.write(2, b"[W1204 socket.cpp:207] [c10d] " + rendezvous.UNNAMED_PEER_WARNING + b". err=-3\n")
        os.write(2, b"last line, no newline")
    assert capfd.readouterr().err == "first line\nlast line, no newline"


def test_the_resolver_options_are_restored_as_they_were(monkeypatch) -> None:
    monkeypatch.setenv("RES_OPTIONS", "ndots:2")
    with rendezvous.no_reverse_lookups():
        assert os.environ["RES_OPTIONS"] == "ndots:2 attempts:0"
    assert os.environ["RES_OPTIONS"] == "ndots:2"
    monkeypatch.delenv("RES_OPTIONS")
    with pytest.raises(RuntimeError), rendezvous.no_reverse_lookups():
        raise RuntimeError("the store failed")
    assert "RES_OPTIONS" not in os.environ


def test_a_store_connects_and_serves_with_nothing_on_stderr(capfd) -> None:
    dist = pytest.importorskip("torch.distributed")
    listener = rendezvous.listener()
    port = listener.getsockname()[1]
    server = rendezvous.store(0, 2, port, listener.fileno(), timeout=10)
    client = rendezvous.store(1, 2, port, None, timeout=10)
    client.set("key", b"value")
    assert server.get("key") == b"value"
    assert isinstance(server, dist.TCPStore)
    assert capfd.readouterr().err == ""


def test_a_store_reached_by_name_keeps_the_resolver_it_needs(monkeypatch, capfd) -> None:
    monkeypatch.delenv("RES_OPTIONS", raising=False)
    with rendezvous.no_reverse_lookups("master-node.cluster"):
        assert "RES_OPTIONS" not in os.environ
        os.write(2, rendezvous.UNNAMED_PEER_WARNING + b"\n")
    assert capfd.readouterr().err == rendezvous.UNNAMED_PEER_WARNING.decode() + "\n"
    for address in ("10.1.2.3", "::1", "[::1]"):
        with rendezvous.no_reverse_lookups(address):
            assert os.environ["RES_OPTIONS"] == "attempts:0"


def test_without_a_descriptor_2_the_store_still_connects_without_dns() -> None:
    code = (
        "import os\n"
        "from pytest_ddphooks.launch import rendezvous\n"
        "os.close(2)\n"
        "with rendezvous.no_reverse_lookups():\n"
        "    print(os.environ['RES_OPTIONS'])\n"
        "print('RES_OPTIONS' in os.environ)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RES_OPTIONS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.split() == ["attempts:0", "False"]
