"""Running one test in a fresh interpreter of its own, watched like a multirank run.

The child is a new Python process in a session of its own (so its whole tree can be
killed), with its output in files. It reports through a file of JSON lines that it appends
to as it goes: a line when the test starts, one per test report. The watchdog gives the
interpreter time to start and collect, then holds the test to its limit; on time-out the
child's stacks are dumped (faulthandler on SIGUSR1) and its process tree killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from .hangs import Stacks, dump_stacks
from .launch import zygote
from .launch.job import read_text

STARTUP_LIMIT = 120.0  # seconds to start an interpreter and collect one test file


@dataclass
class IsolatedRun:
    messages: list[dict[str, Any]] = field(default_factory=list)
    code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    started: bool = False
    stacks: Stacks | None = None
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0

    def describe_exit(self) -> str:
        if self.signal is not None:
            try:
                return f"killed by {signal.Signals(self.signal).name}"
            except ValueError:
                return f"killed by signal {self.signal}"
        return f"exit code {self.code}"


def _read_messages(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line of a child that died mid-write
    except FileNotFoundError:
        pass
    return out


def _kill_session(pid: int) -> None:
    tree = [pid, *zygote.descendants_of(pid)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def run_isolated(
    command: list[str],
    env: dict[str, str],
    cwd: str,
    folder: str,
    limit: float,
    startup_limit: float = STARTUP_LIMIT,
) -> IsolatedRun:
    """Run ``command`` (a pytest child) with its files in ``folder``; ``limit`` is the
    test's own time limit, counted from the child's "start" message."""
    messages = os.path.join(folder, "messages.jsonl")
    stacks = os.path.join(folder, "stacks.txt")
    env = {**env, "DDPHOOKS_CHILD_MESSAGES": messages, "DDPHOOKS_CHILD_STACKS": stacks}
    out_path, err_path = os.path.join(folder, "stdout.txt"), os.path.join(folder, "stderr.txt")
    began = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
        )
    run = IsolatedRun()
    deadline = began + startup_limit
    try:
        while True:
            try:
                status = proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                status = None
            if status is not None:
                break
            if not run.started and any(m.get("event") == "start" for m in _read_messages(messages)):
                run.started = True
                deadline = time.monotonic() + limit
            if time.monotonic() >= deadline:
                run.timed_out = True
                run.stacks = dump_stacks({0: (proc.pid, stacks)})[0]
                _kill_session(proc.pid)
                proc.wait()
                break
    except BaseException:
        _kill_session(proc.pid)
        proc.wait()
        raise
    # whatever the child started and left behind goes with it
    _kill_session(proc.pid)
    code = proc.returncode
    if code is not None and code < 0:
        run.signal = -code
    else:
        run.code = code
    run.duration = time.monotonic() - began
    run.messages = _read_messages(messages)
    run.stdout, run.stderr = read_text(out_path), read_text(err_path)
    return run
