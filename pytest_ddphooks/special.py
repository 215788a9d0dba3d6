"""Running one test in a fresh interpreter of its own, watched like a multirank run.

The child is a new Python process in a session of its own (so its whole tree can be
killed), with its output in files. It reports through a file of JSON lines that it appends
to as it goes: a line when the test starts, one per test report or warning. Only that
interpreter writes there: a process the test starts that runs pytest again (a launcher
relaunching its own command line for another rank) is an ordinary child of it.

The watchdog gives the interpreter time to start and collect, then holds the test to its
limit, and once the test's last report is in, gives the interpreter ``EXIT_GRACE`` seconds
to end. On time-out the child's stacks are dumped (faulthandler on SIGUSR1) and its process
tree killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .files import read_text
from .launch import debugger, procs
from .stacks import Stacks, dump_stacks

STARTUP_LIMIT = 120.0  # seconds to start an interpreter and collect one test file
EXIT_GRACE = 30.0  # seconds to end the interpreter once the test's last report is in
# what the parent tells its child: where to write, and whose child it must be
MESSAGES_ENV = "DDPHOOKS_CHILD_MESSAGES"
STACKS_ENV = "DDPHOOKS_CHILD_STACKS"
PARENT_ENV = "DDPHOOKS_CHILD_PARENT"
BASETEMP_ENV = "DDPHOOKS_CHILD_BASETEMP"
TERMINAL_ENV = "DDPHOOKS_CHILD_TERMINAL"  # under -s: the parent's stdout and stderr descriptors
PHASES = ("setup", "call", "teardown")


@dataclass
class IsolatedRun:
    messages: list[dict[str, Any]] = field(default_factory=list)
    code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    started: bool = False
    lingered: bool = False  # the test had finished, the interpreter did not end
    exit_grace: float = EXIT_GRACE
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

    @property
    def finished(self) -> bool:
        """The test's teardown report came in."""
        return any(m.get("event") == "report" and m["report"].get("when") == "teardown" for m in self.messages)

    @property
    def ended_normally(self) -> bool:
        """pytest's own exit codes for a session that ran: tests passed (0) or failed (1)."""
        return self.signal is None and self.code in (0, 1)


def phase_output(folder: str, when: str) -> tuple[str, str]:
    """What the test's interpreter, and every process it started, printed during a phase."""
    return read_text(os.path.join(folder, f"{when}.out")), read_text(os.path.join(folder, f"{when}.err"))


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
    procs.kill_tree(pid, group=pid)


def run_isolated(
    command: list[str],
    env: dict[str, str],
    cwd: str,
    folder: str,
    limit: float,
    startup_limit: float = STARTUP_LIMIT,
    exit_grace: float = EXIT_GRACE,
    terminal: bool = False,
    basetemp: str | None = None,
    lend_terminal: Callable[[str, str], None] | None = None,
) -> IsolatedRun:
    """Run ``command`` (a pytest child) with its files in ``folder``; ``limit`` is the
    test's own time limit, counted from the child's "start" message. ``terminal``: the
    child also gets this process's stdout and stderr, for the test to print to live.
    ``basetemp``: the child's temporary folder (by default, one in ``folder``).
    ``lend_terminal(who, path)``: the child (or one of its ranks) wants a debugger listening
    at ``path``; the time spent there is not the test's (None: refused, as pdb is passed over
    where there is no terminal)."""
    messages = os.path.join(folder, "messages.jsonl")
    stacks = os.path.join(folder, "stacks.txt")
    basetemp = basetemp or os.path.join(folder, "basetemp")
    env = {**env, MESSAGES_ENV: messages, STACKS_ENV: stacks, PARENT_ENV: str(os.getpid()), BASETEMP_ENV: basetemp}
    out_path, err_path = os.path.join(folder, "stdout.txt"), os.path.join(folder, "stderr.txt")
    began = time.monotonic()
    shared = (os.dup(1), os.dup(2)) if terminal else ()
    if shared:
        env[TERMINAL_ENV] = ",".join(map(str, shared))
    try:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                pass_fds=shared,
            )
    finally:
        for fd in shared:
            os.close(fd)
    run = IsolatedRun(exit_grace=exit_grace)
    deadline = began + startup_limit
    lingering = False
    lent = 0  # the child's asks for a terminal answered so far
    try:
        while True:
            try:
                status = proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                status = None
            if status is not None:
                break
            if not lingering:
                run.messages = _read_messages(messages)
                asks = [m for m in run.messages if m.get("event") == "debug"]
                for ask in asks[lent:]:
                    held = time.monotonic()
                    if lend_terminal is None:
                        debugger.refuse(str(ask.get("path")))
                    else:
                        lend_terminal(str(ask.get("who")), str(ask.get("path")))
                    deadline += time.monotonic() - held
                lent = len(asks)
            if not run.started and any(m.get("event") == "start" for m in run.messages):
                run.started = True
                deadline = time.monotonic() + limit
            if run.started and not lingering and run.finished:
                lingering = True
                deadline = min(deadline, time.monotonic() + exit_grace)
            if time.monotonic() >= deadline:
                run.lingered = lingering
                run.timed_out = not lingering
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
