"""What the pytest process asks for (a Job) and what each rank answers (a RankResult)."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    """One multirank run: ``world_size`` fresh rank processes running one test body."""

    test_id: str
    label: str  # what reports call it: the test's node id
    world_size: int
    nodes: int
    backend: str
    init_process_group: bool
    timeout: float  # seconds for the whole run across ranks
    run_dir: str  # this run's private folder: events, output, results, stacks
    env: dict[str, str]
    cwd: str
    payload: bytes = b""  # opaque to the launcher; the body factory decodes it
    group_timeout: float = 0.0  # the process group's own timeout; 0 derives it from timeout

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.nodes

    def path(self, rank: int, what: str) -> str:
        return os.path.join(self.run_dir, f"rank{rank}.{what}")


@dataclass
class RankResult:
    """How the test body went on one rank."""

    rank: int
    outcome: str  # "passed", "failed", "skipped", "xfailed"
    longrepr: str = ""  # the rank's own failure report, formatted where it happened
    message: str = ""  # one line: "AssertionError: assert 1 == 2"
    location: tuple[str, int] | None = None  # (path, line) of the failure or skip
    duration: float = 0.0
    leaks: list[tuple[int, str]] = field(default_factory=list)  # (pid, command) left running, killed
    harness_error: bool = False  # the failure came from setting the rank up, not the body
    extra: dict[str, Any] = field(default_factory=dict)
    warnings: list[dict[str, Any]] = field(default_factory=list)  # warning_relay's wire form

    def write(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(self, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)

    @staticmethod
    def read(path: str) -> RankResult | None:
        try:
            with open(path, "rb") as f:
                result = pickle.load(f)
        except (FileNotFoundError, EOFError, pickle.UnpicklingError):
            return None
        return result if isinstance(result, RankResult) else None


def read_text(path: str) -> str:
    """A file a rank or child wrote, or "" when it never wrote one."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""
