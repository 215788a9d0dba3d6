"""Python stacks of live processes, and the frames of them a user wants to read.

Stacks come from ``faulthandler`` in each process, dumped on SIGUSR1 from inside the signal
handler, so a process stuck in native code (a gloo wait, ``time.sleep``, a lock) or spinning
in Python answers alike. The stuck line of user code is the innermost frame outside torch,
the standard library, pytest and this plugin.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import linecache
import os
import re
import signal
import sys
import sysconfig
import threading
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from .launch import procs

K = TypeVar("K")
_THREAD = re.compile(r'^(Current thread|Thread) 0x([0-9a-fA-F]+)(?: "(.*)")?')
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
    cut: bool = False  # faulthandler writes 100 frames at most: the outermost (the test's) were left out
    name: str | None = None  # its threading name, where the process's own thread told it


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
            thread = ThreadStack(int(m.group(2), 16), m.group(1) == "Current thread", name=m.group(3))
            out.threads.append(thread)
            continue
        m = _FRAME.match(line)
        if m and thread is not None:
            thread.frames.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
        elif line.strip() == "..." and thread is not None:
            thread.cut = True
    return out


def write_python_stacks(path: str) -> None:
    """Every thread's whole stack, in faulthandler's format, to ``path`` (replaced at once):
    from a thread of the process, for stacks deeper than faulthandler writes."""
    lines = []
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        name = names.get(ident)
        # faulthandler's header line, with the thread's name where threading knows it
        named = f' "{name}"' if name is not None and '"' not in name and "\n" not in name else ""
        lines.append(f"Thread 0x{ident:016x}{named} (most recent call first):")
        at: types.FrameType | None = frame
        while at is not None:
            lines.append(f'  File "{at.f_code.co_filename}", line {at.f_lineno} in {at.f_code.co_name}')
            at = at.f_back
        lines.append("")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)


def _deepened(stacks: Stacks, deeper: str, wait: float) -> Stacks:
    """``stacks`` with each thread faulthandler cut short taken whole from ``deeper`` (what a
    thread of the process wrote, once it could run), where it came within ``wait`` seconds,
    and the threads' names from it. No stacks at all (the code under test took the signal for
    a handler of its own, or ignores it): all of them from ``deeper``."""
    whole_needed = not stacks.threads or any(t.cut for t in stacks.threads)
    # for names alone a moment: a rank whose own thread cannot run (the GIL held) is not waited for
    answered = _answer(deeper, wait if whole_needed else min(wait, 0.2))
    if answered is None:
        return stacks
    if not stacks.threads:
        return answered
    whole = {t.ident: t for t in answered.threads}
    for t in stacks.threads:
        found = whole.get(t.ident)
        if found is None:
            continue
        t.name = t.name or found.name
        if t.cut and len(found.frames) > len(t.frames):
            t.frames, t.cut = found.frames, False
    return stacks


def _answer(path: str, wait: float) -> Stacks | None:
    """The stacks a thread of the process wrote to ``path``, once there within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_stacks(f.read())
    except OSError:
        return None


def dump_stacks(
    targets: Mapping[K, tuple[int, str]],
    wait: float = 1.0,
    deeper: Mapping[K, tuple[str, str]] | None = None,
) -> dict[K, Stacks]:
    """Ask processes (key -> (pid, the file their faulthandler writes on SIGUSR1)) for their
    stacks; read them once they stop growing, or after ``wait`` seconds. A process stopped by
    SIGSTOP cannot answer: continuing it to ask would change what it is being asked about.
    ``deeper`` (key -> (the pipe a thread of it listens on, the file it writes)): asked too,
    for the whole of a stack deeper than faulthandler writes."""
    deeper = deeper or {}
    for key, (_, path) in targets.items():
        with contextlib.suppress(OSError):
            os.truncate(path, 0)
        if key in deeper:
            with contextlib.suppress(OSError):
                os.unlink(deeper[key][1])
    for key, (pid, _) in targets.items():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
        if key in deeper:
            ask(deeper[key][0], ASK_STACKS)
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
    for key, (pid, path) in targets.items():
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                out[key] = parse_stacks(f.read())
        except FileNotFoundError:
            out[key] = Stacks()
        if key in deeper:
            # only a stack cut short, or none from a process still there, waits for it
            running = bool(out[key].threads) or procs.is_running(pid)
            out[key] = _deepened(out[key], deeper[key][1], 2.0 if running else 0.0)
    return out


ASK_NATIVE = b"?"  # what native code issued meanwhile (from torch's flight recorder)
ASK_STACKS = b"s"  # every thread's whole stack


def ask(pipe: str, what: bytes) -> None:
    """Ask a process that listens on ``pipe`` (a FIFO); nothing when no one listens."""
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # no one listening (yet, or any more)
    with contextlib.suppress(OSError):
        os.write(fd, what)
    os.close(fd)


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


_BODY_BOUNDARY = (os.path.join("_pytest", "python.py"), "pytest_pyfunc_call")
_RANK_ENTRIES = (
    (os.path.join("pytest_ddphooks", "launch", "rank.py"), "rank_main"),
    (os.path.join("pytest_ddphooks", "launch", "rank.py"), "prepared_rank_main"),
)
_HIDDEN = os.path.join("pytest_ddphooks", "recorder") + os.sep


@dataclass(frozen=True)
class OwnFrames:
    """The frames of a stack that are the test's, innermost first; ``in_harness``: the stack
    holds no frame of the test's code (the rank is stuck in the harness itself), so ``frames``
    are the harness's own, from the rank's entry point."""

    frames: list[Frame]
    in_harness: bool = False


def _at(frame: Frame, spot: tuple[str, str]) -> bool:
    return frame.path.endswith(spot[0]) and frame.function == spot[1]


def _machinery(frame: Frame) -> bool:
    """A frame of what runs a test: this plugin, pytest, pluggy, ``python -m`` / a console script."""
    global _MACHINERY
    if _MACHINERY is None:
        _MACHINERY = _machinery_roots()
    if frame.path.startswith("<frozen"):
        return True
    full = os.path.abspath(frame.path)
    return any(full == root or full.startswith(root + os.sep) for root in _MACHINERY)


def _machinery_roots() -> tuple[str, ...]:
    roots = [os.path.dirname(os.path.abspath(__file__)), os.path.abspath(sysconfig.get_paths()["scripts"])]
    for name in ("_pytest", "pluggy", "pytest", "pytest_timeout", "xdist", "execnet", "runpy"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.extend(os.path.abspath(p) for p in spec.submodule_search_locations)
        elif spec is not None and spec.origin and os.path.isabs(spec.origin):
            roots.append(os.path.abspath(spec.origin))
    return tuple(roots)


_MACHINERY: tuple[str, ...] | None = None


def own_frames(frames: list[Frame]) -> OwnFrames:
    """The frames of the test itself (innermost first, as given): its body's from the test
    function in; else (a rank-side fixture's setup or teardown) from the first frame of user
    code past the plugin's and pytest's fixture machinery, keeping what that code calls
    (torch, the standard library). The recorder's wrappers around torch.distributed go."""
    frames = [f for f in frames if _HIDDEN not in f.path]
    outer = frames[::-1]
    # in a rank, what is outside its entry point is never the test's: pytest's main and the
    # fork server, which the rank was forked from (a console script's frame, an outer pytester
    # session's test among them)
    entry = next((i for i in range(len(outer) - 1, -1, -1) if any(_at(outer[i], e) for e in _RANK_ENTRIES)), None)
    start = entry if entry is not None else 0
    body = next((i for i in range(len(outer) - 1, start - 1, -1) if _at(outer[i], _BODY_BOUNDARY)), None)
    if body is not None:
        return OwnFrames(outer[body + 1 :][::-1])
    user = next(
        (i for i in range(start, len(outer)) if not is_library(outer[i].path) and not _machinery(outer[i])), None
    )
    if user is not None:
        # from just past the machinery that called it: a library's decorator around a fixture stays
        cut = max((i for i in range(start, user) if _machinery(outer[i])), default=start - 1)
        return OwnFrames(outer[cut + 1 :][::-1])
    if entry is not None:
        return OwnFrames(outer[entry:][::-1], in_harness=True)
    return OwnFrames(frames)


def trim_harness(frames: list[Frame]) -> list[Frame]:
    """The frames of the test itself: see :func:`own_frames`."""
    return own_frames(frames).frames


def user_frame(stack: ThreadStack, *, outside_installed: bool = False) -> Frame | None:
    """The innermost frame of user code: where the process is stuck, as the user wrote it;
    ``outside_installed``: of the user's own project, outside every installed package (where
    it called Lightning's barrier from its hook)."""
    for frame in stack.frames:
        if not is_library(frame.path) and not (outside_installed and installed(frame.path)):
            return frame
    return None


def raised_in_user_code(tb: types.TracebackType | None) -> Frame | None:
    """The innermost frame of user code an exception's traceback went through."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if not is_library(code.co_filename):
            found = Frame(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return found


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
    shown = own_frames(stack.frames)
    if shown.in_harness:  # said, rather than left for the reader to find in the plugin's frames
        lines.append("  (no frame of the test's code: the rank is in the harness itself, here from its start)")
    for frame, run in itertools.groupby(reversed(shown.frames)):
        told = [f'  File "{rel_path(frame.path)}", line {frame.line}, in {frame.function}']
        src = frame.source()
        if src:
            told.append(f"    {src}")
        same = len(list(run))
        if same > 3:  # as Python's tracebacks tell a recursion: the frame once, then how often
            lines.extend([*told, f"  [the same frame {same - 1} more times]"])
        else:
            lines.extend(told * same)
    if stack.cut:
        lines.append("  ... (the dump holds the innermost 100 frames: the outer ones are not known)")
    return lines


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def of_harness(path: str) -> bool:
    """A file of this plugin (its frames are the harness's, not the test's)."""
    return os.path.abspath(path).startswith(_PACKAGE + os.sep)


def without_harness_frames(stderr: str) -> str:
    """A process's stderr with the harness's frames left out of its fatal error dump (the
    dump is the harness's doing: the launcher, pytest and the recorder around the test's
    frames are not the test's; a thread of the harness alone goes entirely)."""
    at = stderr.find("Fatal Python error:")
    if at < 0:
        return stderr
    out: list[str] = []
    thread: list[str] = []
    frames: list[tuple[str, Frame]] = []

    def flush() -> None:
        trimmed = trim_harness([f for _, f in frames])
        kept = {id(f) for f in trimmed}
        lines = [line for line, f in frames if id(f) in kept]
        # a thread the harness started (its frames, below the test's, are still the plugin's)
        ours = any(of_harness(f.path) for f in trimmed)
        if thread and not ours and (lines or not frames):
            out.extend(thread + lines)
        thread.clear()
        frames.clear()

    for line in stderr[at:].split("\n"):
        if _THREAD.match(line):
            flush()
            thread.append(line)
        elif thread and (m := _FRAME.match(line)):
            frames.append((line, Frame(m.group(1), int(m.group(2)), m.group(3))))
        else:
            flush()
            out.append(line)
    flush()
    tidy = [line for i, line in enumerate(out) if line or i == 0 or out[i - 1]]  # one blank line where threads went
    return stderr[:at] + "\n".join(tidy)


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
