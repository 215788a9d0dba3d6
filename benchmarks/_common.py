"""Shared helpers of the benchmark scripts: machine facts, generated pytest sessions, Markdown.

Every measured pytest session runs in a subprocess on a suite generated into a temporary
folder (with its own ``pytest.ini``, so nothing of this repository's configuration leaks
in), timed from outside with ``time.perf_counter()``; per-test durations come from the
session's junit xml.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PYTHON = sys.executable

# Options of every generated session: no cache folder, one line per test kept out.
BASE_ARGS = ("-p", "no:cacheprovider", "-q", "--color=no")
PLUGIN_ARGS = ("--ddp-timeout=60",)
NO_PLUGIN_ARGS = ("-p", "no:ddphooks")

# Variables of the caller that would change what a generated session does.
_SCRUBBED = (
    "PYTEST_ADDOPTS",
    "PYTEST_PLUGINS",
    "PYTEST_XDIST_WORKER",
    "PYTEST_XDIST_WORKER_COUNT",
    "PYTEST_CURRENT_TEST",
)


# -- machine --------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def nproc() -> str:
    try:
        return subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(len(os.sched_getaffinity(0)))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> list[tuple[str, str]]:
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        ("nproc", nproc()),
        ("CPU", cpu_model()),
        ("torch", _version("torch")),
        ("Python", platform.python_version()),
        ("pytest", _version("pytest")),
        ("pytest-xdist", _version("pytest-xdist")),
        ("kernel", platform.release()),
        ("load average at start (1/5/15 min)", load),
    ]


def command_line() -> str:
    """How this script was started, as run from the repository root."""
    exe = os.path.relpath(PYTHON, ROOT) if PYTHON.startswith(str(ROOT)) else PYTHON
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return shlex.join([exe, script, *sys.argv[1:]])


# -- statistics -----------------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    data = list(values)
    return statistics.median(data) if data else float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs"


def sec(seconds: float) -> str:
    return f"{seconds:.2f} s"


def ratio(x: float) -> str:
    return f"{x:.1f}x"


def verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


# -- generated sessions ---------------------------------------------------------------------


@dataclass
class Case:
    """One test as the junit xml reports it."""

    name: str
    seconds: float
    outcome: str  # passed | failed | error | skipped
    message: str = ""


@dataclass
class Session:
    """One finished pytest subprocess."""

    args: list[str]
    wall: float
    returncode: int
    stdout: str
    stderr: str
    cases: list[Case] = field(default_factory=list)
    cpu: float = 0.0  # user + sys of the whole process tree (every process was reaped)

    def count(self, outcome: str) -> int:
        return sum(1 for c in self.cases if c.outcome == outcome)

    @property
    def bad(self) -> int:
        return self.count("failed") + self.count("error")

    def durations(self, contains: str = "") -> list[float]:
        return [c.seconds for c in self.cases if contains in c.name]

    def tail(self, lines: int = 40) -> str:
        text = (self.stdout + "\n" + self.stderr).strip().splitlines()
        return "\n".join(text[-lines:])


def _read_junit(path: Path) -> list[Case]:
    if not path.exists():
        return []
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = child.get("message", "")
                break
        name = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        cases.append(Case(name, float(tc.get("time", "0")), outcome, message))
    return cases


class Suite:
    """A folder of generated test files, run as pytest sessions in subprocesses."""

    def __init__(self, files: dict[str, str], *, keep: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ddphooks-bench-"))
        self.keep = keep
        self._runs = 0
        self.write({"pytest.ini": "[pytest]\n", **files})

    def write(self, files: dict[str, str]) -> None:
        for name, text in files.items():
            path = self.dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")

    def run(
        self,
        *args: str,
        plugin: bool = True,
        duration_report: str = "total",
        env: dict[str, str] | None = None,
        timeout: float = 1800.0,
    ) -> Session:
        """Run ``pytest *args`` here; ``plugin=False`` blocks pytest-ddphooks."""
        self._runs += 1
        junit = self.dir / f"junit-{self._runs}.xml"
        cmd = [
            PYTHON,
            "-m",
            "pytest",
            *BASE_ARGS,
            *(PLUGIN_ARGS if plugin else NO_PLUGIN_ARGS),
            f"--junitxml={junit}",
            "-o",
            f"junit_duration_report={duration_report}",
            *args,
        ]
        full_env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
        full_env.update(env or {})
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=self.dir, env=full_env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        session = Session(cmd[3:], wall, proc.returncode, proc.stdout, proc.stderr, _read_junit(junit), cpu)
        junit.unlink(missing_ok=True)
        return session

    def run_ok(
        self,
        *args: str,
        expect: int,
        plugin: bool = True,
        duration_report: str = "total",
        env: dict[str, str] | None = None,
    ) -> Session:
        """Run and insist that exactly ``expect`` tests passed and none failed (0: no tests)."""
        session = self.run(*args, plugin=plugin, duration_report=duration_report, env=env)
        passed = session.count("passed")
        if passed != expect or session.bad or session.returncode not in ((5,) if expect == 0 else (0,)):
            raise RuntimeError(
                f"pytest {shlex.join(session.args)} in {self.dir}: expected {expect} passed, got"
                f" {passed} passed, {session.bad} failed/error, exit code {session.returncode}\n{session.tail()}"
            )
        return session

    def close(self) -> None:
        if self.keep:
            print(f"kept {self.dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Suite:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def interleaved(repeats: int, names: Sequence[str]) -> list[tuple[int, str]]:
    """The order of measurements: every variant once per round, so drift hits all alike."""
    return [(r, n) for r in range(repeats) for n in names]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- report ---------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = [all(_numeric(r[i]) for r in cells[1:] if r[i] not in _PLACEHOLDERS) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return (
            "| "
            + " | ".join(c.rjust(w) if rt else c.ljust(w) for c, w, rt in zip(row, widths, right, strict=True))
            + " |"
        )

    sep = (
        "|"
        + "|".join(("-" * (w + 1) + ":") if rt else ("-" * (w + 2)) for w, rt in zip(widths, right, strict=True))
        + "|"
    )
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


_PLACEHOLDERS = ("", "-", "not run")


def _numeric(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or text[0] in "-+.") and not text.startswith("--")


class Report:
    """A Markdown page: a title, the machine and command, then sections; printed and saved."""

    def __init__(self, name: str, title: str, args: argparse.Namespace) -> None:
        self.name = name
        self.parts = [f"# {title}", ""]
        self.started = time.perf_counter()
        mode = "quick (small sizes, noisy: for checking the script only)" if args.quick else "full"
        self.parts += [
            f"Command (from the repository root): `{command_line()}`",
            "",
            f"Mode: {mode}; date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            "",
            table(["machine", ""], machine_info()),
            "",
        ]

    def section(self, heading: str, body: str = "", notes: Sequence[str] = ()) -> None:
        self.parts += [f"## {heading}", ""]
        if body:
            self.parts += [body, ""]
        for note in notes:
            self.parts += [textwrap.fill(note, 100, initial_indent="- ", subsequent_indent="  "), ""]

    def write(self) -> Path:
        elapsed = time.perf_counter() - self.started
        self.parts += [f"Benchmark wall time: {elapsed:.0f} s.", ""]
        text = "\n".join(self.parts)
        print(text)
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{self.name}.md"
        path.write_text(text, encoding="utf-8")
        progress(f"wrote {os.path.relpath(path, ROOT)}")
        return path


def parser(description: str, repeats: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat: to check that the script works")
    p.add_argument("--repeats", type=int, default=None, help=f"repeats of each measured session (default {repeats})")
    p.add_argument("--keep", action="store_true", help="keep the generated suites (their folder is printed)")
    p.set_defaults(default_repeats=repeats)
    return p


def repeats_of(args: argparse.Namespace) -> int:
    if args.repeats is not None:
        return max(1, int(args.repeats))
    return 1 if args.quick else int(args.default_repeats)
