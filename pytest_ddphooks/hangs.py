"""What happens when a run hangs: stacks from every rank, and a diagnosis that says where.

Stacks come from ``faulthandler`` in each rank, dumped on SIGUSR1 from inside the signal
handler, so a rank stuck in native code (a gloo wait, ``time.sleep``, a lock) or spinning in
Python answers alike. Where each rank is comes from its recorded events: the hook or
instrumented call it is in, the collective it waits in, and which members never entered
that collective. The stuck line of user code is the innermost frame outside torch, the
standard library, pytest and this plugin.
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
from typing import TYPE_CHECKING, Any, TypeVar

from .recorder import collectives, events
from .recorder.clocks import collective_key

if TYPE_CHECKING:
    from .launch.job import Job
    from .launch.run import RunReport
    from .recorder.timeline import Span, Timeline

K = TypeVar("K")
_THREAD = re.compile(r"^(Current thread|Thread) 0x([0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


@dataclass
class Frame:
    path: str
    line: int
    function: str

    def source(self) -> str:
        return linecache.getline(self.path, self.line).strip()


@dataclass
class ThreadStack:
    ident: int
    current: bool
    frames: list[Frame] = field(default_factory=list)  # innermost first, as faulthandler writes


@dataclass
class Stacks:
    threads: list[ThreadStack] = field(default_factory=list)
    raw: str = ""


def parse_stacks(text: str) -> Stacks:
    out = Stacks(raw=text)
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
    stacks; read them once they stop growing, or after ``wait`` seconds."""
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
        for key, (_, path) in targets.items():
            try:
                size = os.path.getsize(path)
            except OSError:
                size = 0
            if size and sizes.get(key) == size:
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


def collect_stacks(live: Mapping[int, int], job: Job, wait: float = 1.0) -> dict[int, Stacks]:
    """Every live rank's stacks (rank -> pid)."""
    return dump_stacks({rank: (pid, job.path(rank, "stacks")) for rank, pid in live.items()}, wait)


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


def user_frame(stack: ThreadStack) -> Frame | None:
    """The innermost frame of user code: where the rank is stuck, as the user wrote it."""
    for frame in stack.frames:
        if not is_library(frame.path):
            return frame
    return None


def format_stack(stack: ThreadStack, name: str) -> list[str]:
    lines = [f"{name} (most recent call last):"]
    for frame in reversed(trim_harness(stack.frames)):
        lines.append(f'  File "{_rel(frame.path)}", line {frame.line}, in {frame.function}')
        src = frame.source()
        if src:
            lines.append(f"    {src}")
    return lines


def _seconds(ns: int) -> str:
    return f"{ns / 1e9:.1f} s"


def _main_stack(stacks: Stacks | None, main_ident: int | None) -> ThreadStack | None:
    if stacks is None or not stacks.threads:
        return None
    for t in stacks.threads:
        if main_ident is not None and t.ident == main_ident:
            return t
    return stacks.threads[-1]


def _open_collective(spans: list[Span]) -> Span | None:
    for s in reversed(spans):
        if s.kind in (events.COLLECTIVE, events.P2P, events.WAIT) and s.start.lane == 0:
            return s
    return None


class DesyncWatch:
    """Follows the ranks' events as they are written, and says when ranks sit in collectives
    that can never match: at the same place of a group's sequence, each inside a different
    call. Each look costs what was recorded since the last one, never the whole run again."""

    def __init__(self) -> None:
        self._issued: dict[int, dict[int, dict[str, Any]]] = {}  # rank -> call id -> async call's info
        self._inside: dict[int, dict[int, dict[str, Any]]] = {}  # rank -> call id -> the collective it is in
        self._counts: dict[int, int] = {}

    def feed(self, rank: int, records: list[events.RawEvent]) -> None:
        issued = self._issued.setdefault(rank, {})
        inside = self._inside.setdefault(rank, {})
        count = self._counts.get(rank, 0)
        for call_id, _, _, kind, phase, _, info in records:
            if kind == events.META:
                continue
            count += 1
            if kind == events.COLLECTIVE and info and info.get("seq") and info.get("effective", True):
                if phase == events.START:
                    inside[call_id] = info
                    if info.get("async"):
                        issued[call_id] = info  # where it completes is its wait
                else:
                    inside.pop(call_id, None)
            elif kind == events.WAIT:
                if phase == events.START:
                    waited = issued.pop(int((info or {}).get("of", 0)), None)
                    if waited is not None:
                        inside[call_id] = waited
                else:
                    inside.pop(call_id, None)
        self._counts[rank] = count

    def stuck(self) -> tuple[object, ...] | None:
        """The first collective that ranks are inside with calls that cannot match, with how
        many events those ranks had recorded (to tell a stuck state from progress); else None."""
        at: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = {}
        for rank, calls in self._inside.items():
            for info in calls.values():
                at.setdefault(collective_key(info), {})[rank] = info
        for key in sorted(at, key=lambda k: (int(k[2]), str(k[1]))):
            ranks = at[key]
            ops = {r: str(info.get("op")) for r, info in ranks.items()}
            if len(ranks) < 2 or len({collectives.comparable(ops[r], info) for r, info in ranks.items()}) < 2:
                continue
            calls = tuple(sorted((r, collectives.signature(ops[r], info)) for r, info in ranks.items()))
            return (key[1], key[2], calls, tuple(self._counts.get(r, 0) for r in sorted(ranks)))
        return None


def _hooks(spans: list[Span]) -> str:
    names = [s.start.info.get("qualname") or s.name for s in spans if s.kind in (events.CALL, events.BARRIER)]
    return " > ".join(str(n) for n in names)


def _rel(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def rank_status(report: RunReport, rank: int, now_ns: int) -> list[str]:
    """Where one rank is: finished, stuck in a collective (and who never came), or running."""
    timeline = report.timeline
    result = report.results.get(rank)
    if result is not None:
        waited = ", then waited for the other ranks" if rank in report.stopped else ""
        return [f"rank {rank}: finished the test body ({result.outcome}){waited}"]
    if rank not in report.stopped:
        ex = report.exits.get(rank)
        return [f"rank {rank}: died ({ex.describe() if ex else 'no exit status'})"]
    spans = timeline.open_spans(rank) if timeline is not None else []
    hooks = _hooks(spans)
    where = f", in {hooks}" if hooks else ""
    blocked = _open_collective(spans)
    stack = _main_stack(report.stacks.get(rank), report.thread_idents.get((rank, 0)))
    frame = user_frame(stack) if stack is not None else None
    stuck = report.stuck
    head = f"rank {rank}: " if stuck else f"rank {rank}: {report.stopped[rank]}; it was "
    lines = []
    if blocked is not None:
        info = blocked.start.info
        op = info.get("op", blocked.name)
        waited = _seconds(max(now_ns - blocked.start.t_ns, 0))
        what = f"the wait of {op}" if blocked.kind == events.WAIT else op
        if info.get("sync") in (collectives.SEND, collectives.RECV):
            peer = info.get("dst") if info.get("sync") == collectives.SEND else info.get("src")
            lines.append(f"{head}blocked in {what} (peer {peer}) for {waited}{where}")
        elif not info.get("effective", True):
            lines.append(f"{head}blocked in {op} without a process group for {waited}{where}")
        else:
            label = collectives.group_label(str(info.get("group")), info.get("ranks"))
            lines.append(f"{head}blocked in {what} #{info.get('seq')} on {label} for {waited}{where}")
            if timeline is not None:
                inst = timeline.instances.get(collective_key(info))
                if inst is not None:
                    missing = [m for m in inst.members if m not in inst.starts]
                    if missing:
                        who = ", ".join(str(m) for m in missing)
                        lines.append(f"  ranks that never entered {op} #{info.get('seq')}: {who}")
    else:
        lines.append(f"{head}{'still running' if stuck else 'running'}{where}")
    if frame is not None:
        verb = "stuck at" if stuck else "at"
        lines.append(f"  {verb} {_rel(frame.path)}:{frame.line} in {frame.function}: {frame.source()}")
    return lines


def fatal_error(stderr: str) -> list[str]:
    """A rank's "Fatal Python error" (SIGSEGV and the like), with the test's frames only."""
    at = stderr.find("Fatal Python error:")
    if at < 0:
        return []
    block = stderr[at:]
    first = block.splitlines()[0]
    stacks = parse_stacks(block)
    lines = [first]
    for t in stacks.threads:
        if t.current or len(stacks.threads) == 1:
            lines.extend(format_stack(t, "in the thread that crashed"))
    return lines


def diagnose(report: RunReport) -> list[str]:
    """The lines a hang report opens with: the limit, then where every rank is."""
    job = report.job
    now = report.stopped_at_ns or time.time_ns()
    if report.desynced:
        lines = [
            f"hang: the ranks were stopped after {report.duration:.1f} s, not at the {job.timeout:g} s limit:"
            " they are blocked in collectives that can never match"
        ]
    else:
        lines = [f"hang: the test did not finish within {job.timeout:g} s ({job.world_size} ranks)"]
    for rank in range(job.world_size):
        lines.extend("  " + line for line in rank_status(report, rank, now))
    return lines


def stack_sections(report: RunReport) -> list[str]:
    """Every stopped rank's Python stacks, all threads, main thread first."""
    lines: list[str] = []
    timeline: Timeline | None = report.timeline
    for rank in sorted(report.stacks):
        if rank in report.results:
            continue  # it had finished the body: its stack is the harness waiting
        stacks = report.stacks[rank]
        lines.append("")
        if not stacks.threads:
            lines.append(f"rank {rank}: no stack (the rank did not answer)")
            continue
        main = report.thread_idents.get((rank, 0))
        ordered = sorted(stacks.threads, key=lambda t: t.ident != main)
        names = {}
        if timeline is not None:
            for (r, lane), ident in report.thread_idents.items():
                if r == rank:
                    names[ident] = timeline.lanes.get((r, lane), "")
        for t in ordered:
            label = names.get(t.ident) or ("MainThread" if t.ident == main else f"thread 0x{t.ident:x}")
            lines.extend(format_stack(t, f"rank {rank} stack, {label}"))
    return lines
