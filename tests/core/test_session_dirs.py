"""Where a session's folders go: run folders in memory when there is room, and what a killed
session left is removed by the next, wherever it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_ddphooks import session_dirs

HAS_ROOMY_SHM = session_dirs._is_tmpfs("/dev/shm") and os.statvfs("/dev/shm").f_bavail * os.statvfs(
    "/dev/shm"
).f_frsize >= (1 << 30)


@pytest.mark.skipif(not HAS_ROOMY_SHM, reason="this machine has no /dev/shm tmpfs with 1 GiB free")
def test_runs_go_to_a_memory_filesystem_with_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TMPDIR", raising=False)
    assert session_dirs.memory_parent() == "/dev/shm"


def test_no_memory_filesystem_when_tmpdir_says_where_or_there_is_no_room(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert session_dirs.memory_parent() is None
    monkeypatch.delenv("TMPDIR")
    monkeypatch.setattr(session_dirs, "MEMORY_ROOM", 1 << 62)
    assert session_dirs.memory_parent() is None
    monkeypatch.setattr(session_dirs, "MEMORY_ROOM", 0)
    monkeypatch.setattr(session_dirs, "MEMORY_FS", str(tmp_path))  # a disk, not tmpfs
    assert session_dirs.memory_parent() is None


def test_a_killed_session_s_run_folders_in_memory_are_removed_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    memory.mkdir()
    disk.mkdir()
    monkeypatch.setattr(session_dirs, "memory_parent", lambda: str(memory))
    monkeypatch.setattr(session_dirs.tempfile, "gettempdir", lambda: str(disk))
    dead = [memory / "ddphooks-999999999-runs", disk / "ddphooks-999999999-session"]
    for folder in dead:
        (folder / "run-1").mkdir(parents=True)
    alive = memory / f"ddphooks-{os.getpid()}-runs"
    alive.mkdir()
    removed = session_dirs.remove_stale()
    assert sorted(removed) == sorted(map(str, dead))
    assert not any(folder.exists() for folder in dead)
    assert alive.exists()
