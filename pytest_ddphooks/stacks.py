"""Python stacks of live processes, and the frames of them a user wants to read.

Stacks come from ``faulthandler`` in each process, dumped on SIGUSR1 from inside the signal
handler, so a process stuck in native code (a gloo wait, ``time.sleep``, a lock) or spinning
in Python answers alike. The stuck line of user code is the innermost frame outside torch,
the standard library, pytest and this plugin.
"""

from __future__ import annotations

import contextlib
import importlib.util
import linecache
import os
import re
import signal
import sysconfig
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from .launch import procs

K = TypeVar("K")
_THREAD = re.compile(r"^(Current thread|Thread) 0x([0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str

    def source(self) -> str:
        return linecache.getline(self.path, self.line).strip()

    def describe(self) -> str:
        """``test_x.py:12 in setup: dist.barrier()``"""
        return f"{rel_path(self.path)}:{self.line} in {self.function}: {self.source()}"


@dataclass
class ThreadStack:
    ident: int
    current: bool
    frames: list[Frame] = field(default_factory=list)  # innermost first, as faulthandler writes


@dataclass
class Stacks:
    threads: list[ThreadStack] = field(default_factory=list)

    def main(self, ident: int | None) -> ThreadStack | None:
        """The thread ``ident`` (a rank's main thread), else the last one faulthandler listed."""
        if not self.threads:
            return None
        for t in self.threads:
            if ident is not None and t.ident == ident:
                return t
        return self.threads[-1]


def parse_stacks(text: str) -> Stacks:
    out = Stacks()
    thread: ThreadStack | None = None
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            thread = ThreadStack(int(m.group(2), 16), m.group(1) == "Current thread")
            out.threads.append(thread)
            continue
        m = _FRAME.match(line)
        if m and thread is not None:
            thread.frames.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    return out


def dump_stacks(targets: Mapping[K, tuple[int, str]], wait: float = 1.0) -> dict[K, Stacks]:
    """Ask processes (key -> (pid, the file their faulthandler writes on SIGUSR1)) for their
    stacks; read them once they stop growing, or after ``wait`` seconds. A process stopped by
    SIGSTOP cannot answer: continuing it to ask would change what it is being asked about."""
    for _, path in targets.values():
        with contextlib.suppress(OSError):
            os.truncate(path, 0)
    for pid, _ in targets.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + wait
    sizes: dict[K, int] = {}
    steady: set[K] = set()
    while len(steady) < len(targets) and time.monotonic() < deadline:
        time.sleep(0.01)
        for key, (pid, path) in targets.items():
            if key in steady:
                continue
            try:
                size = os.path.getsize(path)
            except OSError:
                size = 0
            # a process that has ended writes nothing more: waiting for it would only hold
            # up the report (a peer that left as the harness came to stop it)
            if (size and sizes.get(key) == size) or not procs.is_running(pid):
                steady.add(key)
            sizes[key] = size
    out = {}
    for key, (_, path) in targets.items():
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                out[key] = parse_stacks(f.read())
        except FileNotFoundError:
            out[key] = Stacks()
    return out


def _library_roots() -> tuple[str, ...]:
    roots = [os.path.dirname(os.path.abspath(__file__))]
    for name in ("torch", "_pytest", "pluggy", "pytest", "pytest_timeout", "xdist", "execnet"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.extend(os.path.abspath(p) for p in spec.submodule_search_locations)
        elif spec is not None and spec.origin:
            roots.append(os.path.abspath(spec.origin))
    paths = sysconfig.get_paths()
    roots.append(os.path.abspath(paths["stdlib"]))
    return tuple(roots)


_ROOTS: tuple[str, ...] | None = None


def is_library(path: str) -> bool:
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _library_roots()
    if path.startswith("<"):
        return True
    full = os.path.abspath(path)
    return any(full == root or full.startswith(root + os.sep) for root in _ROOTS)


_HARNESS_BOUNDARY = (
    (os.path.join("_pytest", "python.py"), "pytest_pyfunc_call"),
    (os.path.join("pytest_ddphooks", "launch", "rank.py"), "rank_main"),
)
_HIDDEN = os.path.join("pytest_ddphooks", "recorder") + os.sep


def trim_harness(frames: list[Frame]) -> list[Frame]:
    """The frames of the test itself: drop the launcher and pytest below the test function,
    and the recorder's wrappers around torch.distributed calls."""
    for i, frame in enumerate(frames):
        if any(frame.path.endswith(path) and frame.function == fn for path, fn in _HARNESS_BOUNDARY):
            frames = frames[:i]
            break
    return [f for f in frames if _HIDDEN not in f.path]


def user_frame(stack: ThreadStack, *, outside_installed: bool = False) -> Frame | None:
    """The innermost frame of user code: where the process is stuck, as the user wrote it;
    ``outside_installed``: of the user's own project, outside every installed package (where
    it called Lightning's barrier from its hook)."""
    for frame in stack.frames:
        if not is_library(frame.path) and not (outside_installed and installed(frame.path)):
            return frame
    return None


def installed(path: str) -> bool:
    """A file of a package pip installed (site-packages, dist-packages)."""
    parts = os.path.abspath(path).split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts


def rel_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def format_stack(stack: ThreadStack, name: str) -> list[str]:
    lines = [f"{name} (most recent call last):"]
    for frame in reversed(trim_harness(stack.frames)):
        lines.append(f'  File "{rel_path(frame.path)}", line {frame.line}, in {frame.function}')
        src = frame.source()
        if src:
            lines.append(f"    {src}")
    return lines


def fatal_error(stderr: str) -> list[str]:
    """A process's "Fatal Python error" (SIGSEGV and the like), with the test's frames only;
    and what C++ said as it terminated (``terminate called ...`` / ``what(): ...``)."""
    at = stderr.find("Fatal Python error:")
    if at < 0:
        return []
    block = stderr[at:]
    first = block.splitlines()[0]
    cause = [
        ln.strip() for ln in stderr[:at].splitlines()[-6:] if ln.lstrip().startswith(("terminate called", "what():"))
    ]
    stacks = parse_stacks(block)
    lines = [first, *cause]
    crashed = [t for t in stacks.threads if t.current or len(stacks.threads) == 1]
    for t in crashed:
        lines.extend(format_stack(t, "in the thread that crashed"))
    if not crashed and stacks.threads:
        # it crashed in a thread Python does not know (gloo's, a C++ worker's): where the test was
        main = stacks.main(None)
        if main is not None and trim_harness(main.frames):
            lines.extend(format_stack(main, "it crashed in a native thread; the main thread was at"))
    return lines
