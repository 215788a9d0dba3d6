"""Lightning's own test suite, run without and with pytest-ddphooks: what changes?

The promise under test: loading the plugin into a real project's suite changes nothing but
what it promises (a leak report in the teardown of a test that leaves a process group, a
child process, a thread, a socket or a distributed environment variable behind). Target: no
outcome differs, or every difference is a genuine leak the report names correctly.

What it does (everything it builds lives in the work folder, never in this repository):

1. exports HEAD of Lightning's git directory (a bare mirror; blobs missing from it, such as
   a large gif or a submodule, are skipped and listed) into ``WORK/lightning``;
2. creates ``WORK/venv`` with ``--python`` (3.11) and installs, every pip call constrained by
   ``WORK/constraints.txt`` (torch pinned to this repository's ``ci/constraints.txt``, and
   torchvision made unresolvable, so nothing can pull a CUDA torch or torchvision): torch,
   this plugin editable (``pip install -e /work/main``: plugin edits are picked up without a
   reinstall), the unified ``lightning`` package editable from the export
   (``PACKAGE_NAME=lightning``, as Lightning's setup.py documents) and Lightning's test
   requirements (``requirements/pytorch/test.txt``, ``requirements/fabric/test.txt``,
   ``requirements/pytorch/extra.txt``); a line that fails to install is dropped and listed;
3. runs the subjects the way Lightning's CI runs them (``.github/workflows/ci-tests-*.yml``):
   from ``tests/tests_pytorch`` or ``tests/tests_fabric``, with the repository's
   pyproject.toml configuration and conftests, ``-v --timeout=90`` (pytorch) /
   ``--timeout=60`` (fabric), ``--junitxml`` with ``-o junit_family=legacy``, no xdist
   (Lightning's CI does not use it), no random order (so both variants run the same order),
   ``PL_RUN_STANDALONE_TESTS`` and the other selection variables unset. One session per
   tests root (``tests_pytorch``, ``tests_fabric``) per variant, every session alone (2 cores),
   ``--rounds`` rounds in ABBA order (default 2: without, with, with, without), so that an
   order effect shows and a test that changes between sessions of the same variant is
   recognised as flaky; each session has a wall-clock limit, its own process group (what it
   leaves running is listed, then killed), ``tests/`` re-exported before it, and the plugin's
   code fingerprint (HEAD + a hash of pytest_ddphooks/) recorded, since the editable install
   picks up edits made while the benchmark runs. A canary suite first proves the guard is
   armed in this venv (it must report a leaked thread and ``MASTER_PORT``);
4. compares the per-test outcomes of the junit files (a session that died without writing
   its junit file falls back to its ``-v`` log); a probe plugin (``-p bench_rerun_probe``,
   written into the work folder, loaded in both variants) records why each attempt that
   pytest-rerunfailures reran failed, since a leak report on a ``flaky``-marked test would
   otherwise be hidden by its rerun. A difference is *the plugin's* when each variant agrees
   with itself and the two disagree, unless its failure also occurs in the other variant
   (then it is flaky); differences carrying the plugin's words are leak reports. Writes
   ``benchmarks/results/bench_lightning_suite.md`` plus ``WORK/runs/*/summary.json``;
   ``--report-only`` rebuilds the page from those.

Deviations from Lightning's CI, all the same for both variants: ``GLOO_SOCKET_IFNAME=lo``
(CI: ``eth0``; here nothing may leave loopback), ``HF_HUB_OFFLINE=1`` (no hub here), no
coverage wrapper, no deepspeed/bitsandbytes (strategies extras), no torchvision, torch 2.13.0
CPU.

Usage (from the repository root; the script needs only the standard library)::

    python3 benchmarks/bench_lightning_suite.py                      # the three subjects
    python3 benchmarks/bench_lightning_suite.py --paths tests/tests_pytorch/strategies
    python3 benchmarks/bench_lightning_suite.py --skip-setup --variants on   # re-run one side
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT_PAGE = ROOT / "benchmarks" / "results" / "bench_lightning_suite.md"
DEFAULT_WORK = Path("/work/lightning-bench")
DEFAULT_GIT = Path("/work/.mirror/Lightning-AI+pytorch-lightning/repo")
DEFAULT_PATHS = ("tests/tests_pytorch/strategies", "tests/tests_pytorch/trainer", "tests/tests_fabric")
# per tests root: Lightning CI's --timeout
CI_TIMEOUTS = {"tests_pytorch": 90, "tests_fabric": 60}
VARIANTS = {"off": ("-p", "no:ddphooks"), "on": ()}
VARIANT_TITLE = {"off": "without the plugin (`-p no:ddphooks`)", "on": "with the plugin"}

# requirement names never installed: torchvision (PyPI's build fails with this torch and pulls
# CUDA), the strategies extras (deepspeed compiles ops against CUDA; bitsandbytes is a GPU lib)
DENIED = {"torchvision", "deepspeed", "bitsandbytes"}
REQUIREMENT_FILES = (
    "requirements/pytorch/test.txt",
    "requirements/fabric/test.txt",
    "requirements/pytorch/extra.txt",
)

# variables of the caller that would change what the sessions select or load
SCRUBBED = (
    "PYTEST_ADDOPTS",
    "PYTEST_PLUGINS",
    "PYTEST_XDIST_WORKER",
    "PYTEST_XDIST_WORKER_COUNT",
    "PYTEST_CURRENT_TEST",
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
    "PL_RUN_STANDALONE_TESTS",
    "RUN_ONLY_CUDA_TESTS",
    "PL_RUN_TPU_TESTS",
    "PL_RUN_CUDA_TESTS",
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "PYTHONHOME",
    "CUDA_VISIBLE_DEVICES",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
EXTRA_ENV = {"GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1", "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}

# a line of a leak report, in a test's teardown error or the session's "ddphooks leak guard" section
LEAK_LINE = re.compile(
    r"leaked|could not be cleaned up|left behind (when its scope ended|at the end of the session)|ddphooks leak guard"
)
# words of the plugin's own reports
PLUGIN_WORDS = re.compile(
    r"leaked|could not be cleaned up|left behind|ddphooks|ddp_allow_leaks|still initialised|multirank|special test",
    re.IGNORECASE,
)


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def run(
    cmd: list[str], *, cwd: Path | None = None, env: dict | None = None, check: bool = True, capture: bool = True
) -> subprocess.CompletedProcess:
    log("$ " + shlex.join(str(c) for c in cmd))
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
    )
    if check and proc.returncode != 0:
        sys.stderr.write((proc.stdout or "")[-6000:])
        raise SystemExit(f"command failed ({proc.returncode}): {shlex.join(str(c) for c in cmd)}")
    return proc


# -- 1. export --------------------------------------------------------------------------------


def git_head(git_dir: Path) -> str:
    return run(["git", "--git-dir", git_dir, "rev-parse", "HEAD"]).stdout.strip()


def export_tree(git_dir: Path, dest: Path, prefix: str = "") -> list[str]:
    """Write HEAD's files (under ``prefix``) into ``dest``; return the paths whose objects the
    mirror lacks (skipped). ``git archive`` stops at the first missing blob, hence this."""
    listing = subprocess.run(
        ["git", "--git-dir", str(git_dir), "ls-tree", "-r", "-z", "HEAD", *([prefix] if prefix else [])],
        capture_output=True,
        check=True,
    ).stdout
    entries = []
    for rec in listing.split(b"\0"):
        if not rec:
            continue
        meta, path = rec.split(b"\t", 1)
        mode, kind, sha = meta.split()
        entries.append((mode.decode(), kind.decode(), sha.decode(), path.decode()))
    skipped = [f"{path} ({kind} {sha[:12]}: not in the mirror)" for mode, kind, sha, path in entries if kind != "blob"]
    blobs = [e for e in entries if e[1] == "blob"]
    cat = subprocess.Popen(
        ["git", "--git-dir", str(git_dir), "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert cat.stdin and cat.stdout
    for mode, _kind, sha, path in blobs:
        cat.stdin.write(sha.encode() + b"\n")
        cat.stdin.flush()
        header = cat.stdout.readline().split()
        if len(header) < 3 or header[1] == b"missing":
            skipped.append(f"{path} (blob {sha[:12]}: missing from the mirror)")
            continue
        data = cat.stdout.read(int(header[2]))
        cat.stdout.read(1)  # newline after the object
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if mode == "120000":
            if target.is_symlink() or target.exists():
                target.unlink()
            target.symlink_to(data.decode())
        else:
            target.write_bytes(data)
            if mode == "100755":
                target.chmod(0o755)
    cat.stdin.close()
    cat.wait()
    return skipped


def export(args: argparse.Namespace, commit: str) -> tuple[Path, list[str]]:
    src = args.work / "lightning"
    marker = src / ".bench-exported-commit"
    if src.exists() and marker.exists() and marker.read_text().strip() == commit and not args.fresh:
        log(f"export of {commit[:12]} already in {src}")
        skipped = json.loads((args.work / "export-skipped.json").read_text())
        return src, skipped
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    log(f"exporting {commit[:12]} of {args.lightning_git} into {src}")
    skipped = export_tree(args.lightning_git, src)
    (args.work / "export-skipped.json").write_text(json.dumps(skipped, indent=1))
    marker.write_text(commit + "\n")
    return src, skipped


def refresh_tests(args: argparse.Namespace, src: Path) -> None:
    """tests/ as in HEAD again: whatever a session wrote there is gone before the next one."""
    shutil.rmtree(src / "tests", ignore_errors=True)
    export_tree(args.lightning_git, src, "tests")
    for name in (".pytest_cache", "lightning_logs", "Datasets"):
        shutil.rmtree(src / name, ignore_errors=True)


# -- 2. environment ---------------------------------------------------------------------------


def pinned_torch() -> str:
    for line in (ROOT / "ci" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("torch=="):
            return line
    raise SystemExit("ci/constraints.txt pins no torch==")


def parse_requirements(path: Path) -> list[str]:
    out = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].split("#", 1)[0].strip() if not raw.strip().startswith("#") else ""
        if not line or line.startswith("-"):
            continue
        name = re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].strip().lower()
        if name in DENIED:
            continue
        out.append(line)
    return out


def setup_env(args: argparse.Namespace, src: Path) -> dict:
    work = args.work
    venv = work / "venv"
    py = venv / "bin" / "python"
    constraints = work / "constraints.txt"
    constraints.write_text(
        f"# written by {Path(__file__).name}\n{pinned_torch()}\n"
        "# no such release: whatever asks for torchvision fails to resolve and is dropped\ntorchvision==0.0.0\n"
    )
    state_file = work / "setup-state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() and not args.reinstall else {}
    if args.reinstall and venv.exists():
        shutil.rmtree(venv)
    if not py.exists():
        run([args.python, "-m", "venv", venv])
        state = {}
    pip = [py, "-m", "pip", "install", "--progress-bar", "off", "-c", constraints]
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}

    def step(name: str, cmd: list, **kw) -> subprocess.CompletedProcess | None:
        if state.get(name) == "done":
            return None
        proc = run(cmd, **kw)
        state[name] = "done"
        state_file.write_text(json.dumps(state, indent=1))
        return proc

    step("torch", [*pip, pinned_torch()], env=env)
    step("plugin", [*pip, "-e", ROOT], env=env)
    step("lightning", [*pip, "-e", src], cwd=src, env={**env, "PACKAGE_NAME": "lightning"})
    if state.get("requirements") != "done":
        reqs: list[str] = []
        for rel in REQUIREMENT_FILES:
            for line in parse_requirements(src / rel):
                if line not in reqs:
                    reqs.append(line)
        dropped = []
        proc = run([*pip, *reqs], env=env, check=False)
        if proc.returncode != 0:
            log("bulk install of the test requirements failed; line by line")
            for line in reqs:
                one = run([*pip, line], env=env, check=False)
                if one.returncode != 0:
                    tail = [ln for ln in one.stdout.splitlines() if "ERROR" in ln][-2:]
                    dropped.append(f"{line}: {' / '.join(tail) or 'pip failed'}")
        state["requirements"] = "done"
        state["dropped"] = dropped
        state["denied"] = sorted(DENIED)
        state_file.write_text(json.dumps(state, indent=1))
    # as Lightning's CI does for the unified package ("Drop PL for LAI"): the PyPI
    # pytorch-lightning / lightning-fabric that lightning's requirements pull would shadow nothing
    # the tests import, but must not be there
    if state.get("drop_pl") != "done":
        run([py, "-m", "pip", "uninstall", "-y", "pytorch-lightning", "lightning-fabric"], env=env, check=False)
        state["drop_pl"] = "done"
        state_file.write_text(json.dumps(state, indent=1))
    # the guard: torch is still the pinned CPU build, no torchvision, the plugin is editable from here
    check = run(
        [
            py,
            "-c",
            (
                "import importlib.metadata as m, torch, pytest, pytest_ddphooks, lightning, json, sys;"
                "d=lambda n: (lambda: m.version(n));"
                "tv=None\n"
                "try: tv=m.version('torchvision')\nexcept m.PackageNotFoundError: pass\n"
                "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'torchvision': tv,"
                "'pytest': pytest.__version__, 'plugin_file': pytest_ddphooks.__file__,"
                "'plugin': m.version('pytest-ddphooks'), 'lightning': lightning.__version__,"
                "'lightning_file': lightning.__file__, 'pytest_timeout': m.version('pytest-timeout'),"
                "'python': sys.version.split()[0]}))"
            ),
        ],
        env=env,
    )
    facts = json.loads(check.stdout.strip().splitlines()[-1])
    if facts["torchvision"] is not None or facts["cuda"] is not None:
        raise SystemExit(f"the venv has torchvision or a CUDA torch: {facts}")
    if not facts["plugin_file"].startswith(str(ROOT)):
        raise SystemExit(f"the plugin is not the editable one from {ROOT}: {facts['plugin_file']}")
    if not facts["lightning_file"].startswith(str(src)):
        raise SystemExit(f"lightning is not the editable export: {facts['lightning_file']}")
    facts["dropped"] = state.get("dropped", [])
    facts["denied"] = state.get("denied", sorted(DENIED))
    log(f"environment: {facts}")
    return facts


# -- 3. sessions ------------------------------------------------------------------------------


def default_signals() -> None:
    """In each session's process: SIGHUP and SIGINT as a terminal gives them. Started under
    ``nohup`` (or from a shell that ignores them), a session would inherit SIG_IGN, and
    Lightning's signal-connector tests assert the default handler (they fail under nohup)."""
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)


# -p bench_rerun_probe, in every session (both variants): pytest-rerunfailures reruns a test
# marked flaky and shows only its last outcome, so a first attempt that failed in the plugin's
# teardown check would be hidden; the probe writes every rerun attempt's failure text.
RERUN_PROBE = """
import json
import os


def pytest_runtest_logreport(report):
    if getattr(report, "outcome", None) != "rerun":
        return
    with open(os.environ["BENCH_RERUN_OUT"], "a") as f:
        f.write(json.dumps({"id": report.nodeid, "when": report.when, "text": report.longreprtext[-6000:]}) + "\\n")
"""


def write_probe(args: argparse.Namespace) -> Path:
    d = args.work / "probe"
    d.mkdir(parents=True, exist_ok=True)
    (d / "bench_rerun_probe.py").write_text(RERUN_PROBE.lstrip())
    return d


def session_env(py: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env.update(EXTRA_ENV)
    env["PATH"] = f"{py.parent}:{env.get('PATH', '')}"
    return env


def groups_of(paths: list[str]) -> dict[str, list[str]]:
    """tests/tests_pytorch/strategies -> {"tests_pytorch": ["strategies"]}: one session per root."""
    groups: dict[str, list[str]] = defaultdict(list)
    for p in paths:
        parts = Path(p).parts
        if len(parts) < 2 or parts[0] != "tests":
            raise SystemExit(f"--paths entries start with tests/<root>: {p}")
        groups[parts[1]].append(str(Path(*parts[2:])) if len(parts) > 2 else ".")
    return dict(groups)


def session_args(args: argparse.Namespace, root: str, rels: list[str], variant: str, out: Path) -> list[str]:
    timeout = args.timeout or CI_TIMEOUTS.get(root, 90)
    return [
        "-m",
        "pytest",
        *rels,
        "-v",
        f"--timeout={timeout}",
        "--durations=50",
        f"--junitxml={out / 'junit.xml'}",
        "-o",
        "junit_family=legacy",
        "-o",
        f"cache_dir={out / 'cache'}",
        "--color=no",
        "-p",
        "bench_rerun_probe",
        *VARIANTS[variant],
        *args.pytest_arg,
    ]


def group_members(pgid: int) -> list[str]:
    """The command lines of the live processes of a process group (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            out.append(f"{d.name}: {cmd[:200]}")
        except (OSError, ValueError, IndexError):
            continue
    return out


def run_session(args: argparse.Namespace, src: Path, root: str, rels: list[str], variant: str, rnd: int) -> dict:
    name = f"{variant}{rnd}-{root}"
    out = args.work / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    refresh_tests(args, src)
    py = args.work / "venv" / "bin" / "python"
    cwd = src / "tests" / root
    cmd = [str(py), *session_args(args, root, rels, variant, out)]
    env = session_env(py)
    env["PYTHONPATH"] = str(write_probe(args))
    env["BENCH_RERUN_OUT"] = str(out / "reruns.jsonl")
    (out / "command.txt").write_text(
        f"cd {cwd} && {' '.join(f'{k}={v}' for k, v in EXTRA_ENV.items())} {shlex.join(cmd)}\n"
    )
    log(f"session {name}: {shlex.join(cmd)} (in {cwd}, wall limit {args.session_limit} s)")
    code_at_start = plugin_fingerprint()
    started = time.perf_counter()
    killed = None
    with open(out / "log.txt", "w") as logf:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=default_signals,
        )
        try:
            rc = proc.wait(timeout=args.session_limit)
        except subprocess.TimeoutExpired:
            killed = f"killed at the wall-clock limit of {args.session_limit} s"
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    wall = time.perf_counter() - started
    # whatever the session left running in its process group (its own session: only its
    # processes), after a second's grace (multiprocessing's resource tracker ends on its own)
    time.sleep(1.0)
    leftovers = group_members(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    text = (out / "log.txt").read_text(errors="replace")
    cases, source = read_junit(out / "junit.xml"), "junit"
    if not cases:
        cases, source = read_log(text), "log"
    m = re.findall(r"collected (\d+) items?(?: / (\d+) deselected)?", text)
    collected = int(m[-1][0]) if m else None
    rerun_reports = []
    if (out / "reruns.jsonl").exists():
        rerun_reports = [json.loads(ln) for ln in (out / "reruns.jsonl").read_text().splitlines() if ln.strip()]
    summary = {
        "rerun_reports": rerun_reports,
        "plugin_code": code_at_start,
        "started": time.time() - wall,
        "name": name,
        "variant": variant,
        "round": rnd,
        "root": root,
        "paths": rels,
        "cwd": str(cwd),
        "command": cmd,
        "returncode": rc,
        "crash": describe_exit(rc, killed, text),
        "wall": wall,
        "collected": collected,
        "source": source,
        "left_processes_in_group": leftovers,
        "final_line": last_summary_line(text),
        "internal_error": "INTERNALERROR" in text,
        "plugins_line": next((ln.strip() for ln in text.splitlines() if ln.startswith("plugins:")), ""),
        "timeouts": len(re.findall(r"\+{5,} Timeout \+{5,}", text)),
        "reruns": sorted({m.group(1) for m in re.finditer(r"^(\S+::\S+(?:\[.*?\])?) RERUN\b", text, re.M)}),
        "plugin_lines": sorted({ln.strip()[:300] for ln in text.splitlines() if re.search(LEAK_LINE, ln)}),
        "cases": cases,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log(
        f"session {name}: rc={rc} {summary['crash'] or ''} wall {wall:.0f} s, {len(cases)} tests ({source}); "
        f"{summary['final_line']}"
    )
    return summary


CANARY = """
import os
import threading
import time


def test_canary_leaks_a_thread_and_a_variable():
    threading.Thread(target=time.sleep, args=(3,), name="bench-canary-thread").start()
    os.environ["MASTER_PORT"] = "29555"


def test_canary_clean():
    pass
"""


def check_canary(args: argparse.Namespace) -> dict:
    """The guard is armed in this venv: a tiny suite that leaks a thread and MASTER_PORT must
    get a leak report from the plugin (and none without it). Not part of the comparison."""
    d = args.work / "canary"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (d / "pytest.ini").write_text("[pytest]\n")
    (d / "test_canary.py").write_text(CANARY.lstrip())
    py = args.work / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    out = {}
    for variant in ("off", "on"):
        proc = subprocess.run(
            [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", *VARIANTS[variant]],
            preexec_fn=default_signals,
            cwd=d,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        text = proc.stdout + proc.stderr
        out[variant] = {
            "rc": proc.returncode,
            "final_line": last_summary_line(text),
            "leak_lines": [
                ln.strip() for ln in text.splitlines() if "leaked" in ln or "MASTER_PORT" in ln or "bench-canary" in ln
            ][:6],
        }
    armed = (
        out["on"]["rc"] != 0 and out["off"]["rc"] == 0 and any("bench-canary" in ln for ln in out["on"]["leak_lines"])
    )
    out["armed"] = armed
    log(f"canary: guard armed={armed}: {out}")
    return out


def warm_up(args: argparse.Namespace, src: Path, groups: dict[str, list[str]]) -> None:
    """Untimed: collect once without the plugin, so that the first measured session does not
    also pay for compiling Lightning's byte code."""
    py = args.work / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env.update(EXTRA_ENV)
    for root, rels in groups.items():
        subprocess.run(
            [str(py), "-m", "pytest", *rels, "--collect-only", "-q", "-p", "no:ddphooks", "-p", "no:cacheprovider"],
            cwd=src / "tests" / root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=900,
            preexec_fn=default_signals,
        )
    log("warm-up collection done")


def describe_exit(rc: int, killed: str | None, text: str) -> str | None:
    if killed:
        return killed
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name}"
    if rc in (0, 1, 5):
        return None
    names = {2: "interrupted", 3: "internal error", 4: "usage error"}
    return f"exit status {rc} ({names.get(rc, 'not a pytest status: the process died')})"


def last_summary_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if re.match(
            r"^(=+ )?(\d+ (passed|failed|errors?|skipped|xfailed|xpassed|warnings?|deselected|rerun)\b.*"
            r"|no tests ran.*)$",
            line.strip(),
        ):
            return line.strip("= ").strip()
    return "(no summary line: the session did not finish)"


def _outcome(elems: list[ET.Element]) -> tuple[str, str]:
    tags = [(e.tag, e.get("message", ""), e.get("type", "")) for e in elems]
    parts = []
    msg = ""
    if any(t == "failure" for t, _, _ in tags):
        parts.append("failed")
    for t, m, _ in tags:
        if t == "error":
            phase = (
                "setup"
                if "on setup" in m
                else "teardown"
                if "on teardown" in m
                else "collection"
                if "collection" in m.lower()
                else "?"
            )
            parts.append(f"error({phase})")
    if not parts:
        skips = [(m, ty) for t, m, ty in tags if t == "skipped"]
        if skips:
            parts.append("xfailed" if skips[0][1] == "pytest.xfail" else "skipped")
        else:
            parts.append("passed")
    for t, m, _ in tags:
        if t in ("failure", "error", "skipped") and m:
            msg = m
            break
    return "+".join(dict.fromkeys(parts)), msg


def read_junit(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return {}
    merged: dict[str, list[ET.Element]] = {}
    times: dict[str, float] = {}
    for tc in root.iter("testcase"):
        tid = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        merged.setdefault(tid, []).extend(list(tc))
        times[tid] = times.get(tid, 0.0) + float(tc.get("time", "0") or 0)
    cases = {}
    for tid, elems in merged.items():
        outcome, msg = _outcome(elems)
        details = "\n".join((e.text or "") for e in elems if e.tag in ("failure", "error"))
        reruns = sum(1 for e in elems if e.tag.lower().startswith("rerun"))
        cases[tid] = {
            "outcome": outcome,
            "message": msg[:2000],
            "details": details[-6000:],
            "time": times[tid],
            "reruns": reruns,
        }
    return cases


def read_log(text: str) -> dict:
    """The fallback for a session that wrote no junit file: its -v lines."""
    cases: dict[str, dict] = {}
    for m in re.finditer(r"^(\S+::\S+(?:\[.*?\])?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", text, re.M):
        tid = m.group(1)
        word = m.group(2)
        path, _, name = tid.partition("::")
        key = path.removesuffix(".py").replace("/", ".") + "::" + name.replace("::", ".")
        new = {
            "PASSED": "passed",
            "FAILED": "failed",
            "ERROR": "error(?)",
            "SKIPPED": "skipped",
            "XFAIL": "xfailed",
            "XPASS": "failed",
        }[word]
        old = cases.get(key, {}).get("outcome")
        outcome = new if old is None else f"{old}+{new}" if new.startswith("error") else old
        cases[key] = {"outcome": outcome, "message": "", "details": "", "time": 0.0, "reruns": 0}
    return cases


# -- 4. comparison ----------------------------------------------------------------------------


def bucket(outcome: str | None) -> str:
    if outcome is None:
        return "absent"
    if "error" in outcome:
        return "error"
    return outcome.split("+")[0]


def plugin_excerpt(case: dict) -> str:
    """The lines of a failure that carry the plugin's words (else its message)."""
    text = case.get("details") or ""
    lines = [ln.rstrip() for ln in text.splitlines()]
    keep = [i for i, ln in enumerate(lines) if PLUGIN_WORDS.search(ln)]
    if keep:
        return "\n".join(lines[keep[0] : keep[0] + 25])
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return (case.get("message") or last)[:800]


def failure_line(case: dict) -> str:
    """The telling line of a failure: the plugin's words, else the last ``E`` line, else the message."""
    text = case.get("details") or ""
    if PLUGIN_WORDS.search(text):
        return plugin_excerpt(case).splitlines()[0]
    e_lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    extra = (
        " (a spawned rank printed: terminate called without an active exception)"
        if ("terminate called without an active exception" in text)
        else ""
    )
    return ((e_lines[-1] if e_lines else case.get("message", "")) + extra)[:400]


def compare(sessions: list[dict]) -> dict:
    """Every test whose outcome is not the same in all sessions of one tests root, classified:
    ``plugin`` (each variant agrees with itself and the two disagree: the plugin's doing) or
    ``flaky`` (it changes between sessions of the same variant)."""
    ids = sorted(set().union(*(s["cases"] for s in sessions)))
    diffs = []
    for tid in ids:
        outs = [s["cases"].get(tid, {}).get("outcome") for s in sessions]
        if len(set(outs)) == 1:
            continue
        off = {o for s, o in zip(sessions, outs, strict=True) if s["variant"] == "off"}
        on = {o for s, o in zip(sessions, outs, strict=True) if s["variant"] == "on"}
        kind = "plugin" if len(off) == 1 and len(on) == 1 else "flaky"
        excerpt = ""
        for s, o in zip(sessions, outs, strict=True):
            if s["variant"] == "on" and o is not None and bucket(o) in ("failed", "error"):
                excerpt = plugin_excerpt(s["cases"][tid])
                break
        off_msgs = [
            s["cases"][tid]["message"][:300]
            for s, o in zip(sessions, outs, strict=True)
            if s["variant"] == "off" and o is not None and bucket(o) in ("failed", "error")
        ]
        diffs.append(
            {
                "id": tid,
                "kind": kind,
                "outcomes": {s["name"]: o for s, o in zip(sessions, outs, strict=True)},
                "on_excerpt": excerpt,
                "off_message": off_msgs[0] if off_msgs else "",
                "failures": {
                    s["name"]: failure_line(s["cases"][tid])
                    for s, o in zip(sessions, outs, strict=True)
                    if o is not None and bucket(o) in ("failed", "error")
                },
            }
        )

    # a consistent difference whose failure is one the other variant also shows (in any test
    # of the root) is the flake of that failure, not the plugin's doing: two rounds cannot tell
    # a rare flake from a cause; the failure's signature can
    def sig(case: dict) -> str:
        return re.sub(r"\d+", "#", failure_line(case))

    seen: dict[str, dict[str, str]] = {"off": {}, "on": {}}
    for sess in sessions:
        for tid, case in sess["cases"].items():
            if bucket(case["outcome"]) in ("failed", "error"):
                seen[sess["variant"]].setdefault(sig(case), tid)
    for d in diffs:
        failing = [sess for sess in sessions if bucket(d["outcomes"][sess["name"]]) in ("failed", "error")]
        d["plugin_words"] = any(
            sess["variant"] == "on" and PLUGIN_WORDS.search(sess["cases"][d["id"]]["details"] or "") for sess in failing
        )
        if d["kind"] != "plugin" or not failing or d["plugin_words"]:
            continue
        matches = []
        for sess in failing:
            other = "on" if sess["variant"] == "off" else "off"
            hit = seen[other].get(sig(sess["cases"][d["id"]]))
            matches.append(hit)
        if all(matches):
            d["kind"] = "flaky"
            d["note"] = (
                f"the same failure also occurs {'with' if failing[0]['variant'] == 'off' else 'without'} "
                f"the plugin, in `{matches[0]}`"
            )
    touched = []
    for tid in ids:
        on_cases = [s["cases"][tid] for s in sessions if s["variant"] == "on" and tid in s["cases"]]
        off_cases = [s["cases"][tid] for s in sessions if s["variant"] == "off" and tid in s["cases"]]
        on_words = [
            c
            for c in on_cases
            if bucket(c["outcome"]) in ("failed", "error") and PLUGIN_WORDS.search(c["details"] or "")
        ]
        if (
            on_words
            and not any(PLUGIN_WORDS.search(c["details"] or "") for c in off_cases)
            and tid not in {d["id"] for d in diffs}
        ):
            touched.append({"id": tid, "outcome": on_words[0]["outcome"], "on_excerpt": plugin_excerpt(on_words[0])})
    offs = [s for s in sessions if s["variant"] == "off"]
    own = sorted(
        t
        for t in ids
        if offs and all(bucket(s["cases"].get(t, {}).get("outcome")) in ("failed", "error") for s in offs)
    )
    # a first attempt that failed with the plugin's words, then passed on a rerun: hidden in the outcome
    masked = [
        {"id": r["id"], "session": s["name"], "when": r["when"], "text": r["text"]}
        for s in sessions
        if s["variant"] == "on"
        for r in s.get("rerun_reports", [])
        if LEAK_LINE.search(r["text"]) or PLUGIN_WORDS.search(r["text"])
    ]
    return {"diffs": diffs, "same_outcome_plugin_words": touched, "own_failures": own, "masked_by_rerun": masked}


def counts(cases: dict) -> Counter:
    return Counter(bucket(c["outcome"]) for c in cases.values())


# -- 5. report --------------------------------------------------------------------------------


def fmt_secs(s: float) -> str:
    return f"{s:.0f} s ({s / 60:.1f} min)"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def plugin_head() -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "pytest_ddphooks"], capture_output=True, text=True
        ).stdout.strip()
        return head + (" + uncommitted changes in pytest_ddphooks/" if dirty else "")
    except OSError:
        return "?"


RANK_SIGNAL = re.compile(r"terminated with signal SIG\w+")


def rank_signals(s: dict) -> int:
    """How often a rank that torch.multiprocessing spawned died by a signal in this session."""
    final = sum(1 for c in s["cases"].values() if RANK_SIGNAL.search(c.get("details") or ""))
    return final + sum(1 for r in s.get("rerun_reports", []) if RANK_SIGNAL.search(r["text"]))


def plugin_fingerprint() -> str:
    """The plugin code a session runs (it is installed editable): HEAD plus a hash of every
    file under pytest_ddphooks/ as it is on disk, so an edit between sessions shows."""
    import hashlib

    h = hashlib.sha1()
    for f in sorted((ROOT / "pytest_ddphooks").rglob("*.py")):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return f"{plugin_head()}, files {h.hexdigest()[:10]}"


def plugin_code(sessions: list[dict]) -> str:
    codes = list(dict.fromkeys(s.get("plugin_code") for s in sessions if s["variant"] == "on"))
    if codes == [None] or not codes:
        return f"HEAD {plugin_head()} when the page was written (the sessions did not record theirs)"
    if len(codes) == 1:
        return f"HEAD {codes[0]} in every session with the plugin"
    return "**the code changed between sessions**: " + "; ".join(
        f"{label(s)} {s['root']}: {s.get('plugin_code')}" for s in sessions if s["variant"] == "on"
    )


def label(s: dict) -> str:
    return f"{'without' if s['variant'] == 'off' else 'with'} #{s['round']}"


def md(text: str, limit: int = 1500) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")[:limit]


def write_report(args, commit, skipped, facts, by_root, comparisons, started_at, total_wall) -> str:
    cmdline = shlex.join(["python3", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]])
    if getattr(args, "produced_by", None):
        rebuilt = f"; this page was rebuilt from its saved sessions by `{cmdline}`"
        cmdline = args.produced_by
    else:
        rebuilt = ""
    all_sessions = [s for ss in by_root.values() for s in ss]
    n_rounds = max((s["round"] for s in all_sessions), default=0)
    L: list[str] = []
    L += ["# Lightning's test suite without and with pytest-ddphooks", ""]
    L += [
        f"Produced by `{cmdline}` (from the repository root), started {started_at}, {fmt_secs(total_wall)} in all"
        f"{rebuilt}.",
        "",
    ]
    L += [
        "Every session ran alone (one after the other: 2 cores) on the same export, venv and test order; "
        "`tests/` was re-exported before each. "
        + (
            f"{n_rounds} rounds in ABBA order (round 1 without then with the plugin, round 2 with then without, ...), "
            "so that an order effect shows, and a test that changes between two sessions of the same variant is "
            "*flaky*, not the plugin's doing. "
            if n_rounds > 1
            else ""
        )
        + "The plugin variant loads the plugin with its defaults (`--ddp-leaks=fail`): a leak it finds is an error "
        "in the teardown of the test, so a false report would change that test's outcome.",
        "",
    ]
    L += ["## Machine", "", "| what | value |", "| --- | --- |"]
    for k, v in [
        ("cores (nproc)", str(os.cpu_count())),
        ("CPU", cpu_model()),
        ("memory", f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"),
        ("accelerator", "none"),
        ("Python", facts.get("python", "?")),
        ("torch", facts.get("torch", "?")),
        ("pytest", facts.get("pytest", "?")),
        ("pytest-timeout", facts.get("pytest_timeout", "?")),
        ("pytest-ddphooks", f"{facts.get('plugin', '?')}, editable from this repository: {plugin_code(all_sessions)}"),
        ("Lightning", f"{facts.get('lightning', '?')}, commit `{commit}`"),
    ]:
        L.append(f"| {k} | {v} |")
    L.append("")
    # totals first
    if comparisons:
        ndiff = sum(1 for c in comparisons.values() for d in c["diffs"] if d["kind"] == "plugin")
        nflaky = sum(1 for c in comparisons.values() for d in c["diffs"] if d["kind"] == "flaky")
        nreports = sum(1 for c in comparisons.values() for d in c["diffs"] if d.get("plugin_words"))
        nmasked = sum(len(c.get("masked_by_rerun", [])) for c in comparisons.values())
        L += ["## Result", ""]
        L += [
            f"**Tests whose outcome the plugin changes: {ndiff}**; outcome differences carrying the plugin's "
            f"words (leak reports): **{nreports}** (target: 0 false reports); flaky tests (the outcome changes "
            f"between sessions of the same variant, or the failure occurs in both variants): {nflaky}; "
            f"first attempts failed by the plugin's words and hidden by a rerun: {nmasked}; "
            f"sessions crashed: {sum(1 for s in all_sessions if s['crash'])} of {len(all_sessions)}.",
            "",
        ]
        L += ["| figure | without the plugin | with the plugin |", "| --- | ---: | ---: |"]
        per = {v: [s for s in all_sessions if s["variant"] == v] for v in ("off", "on")}
        rounds = {v: sorted({s["round"] for s in per[v]}) for v in per}

        def per_round(v: str, fn) -> str:
            vals = [sum(fn(s) for s in per[v] if s["round"] == r) for r in rounds[v]]
            return " / ".join(str(x) for x in vals) if len(set(vals)) > 1 else str(vals[0]) if vals else "-"

        L.append(
            "| tests collected | "
            + " | ".join(per_round(v, lambda s: s["collected"] or 0) for v in ("off", "on"))
            + " |"
        )
        for k in ("passed", "failed", "error", "skipped", "xfailed"):
            L.append(
                f"| {k} | "
                + " | ".join(per_round(v, lambda s, k=k: counts(s["cases"])[k]) for v in ("off", "on"))
                + " |"
            )
        L.append(
            "| reruns (pytest-rerunfailures) | "
            + " | ".join(per_round(v, lambda s: len(s["reruns"])) for v in ("off", "on"))
            + " |"
        )
        L.append(
            "| pytest-timeout hits | " + " | ".join(per_round(v, lambda s: s["timeouts"]) for v in ("off", "on")) + " |"
        )
        L.append(
            "| wall time, all subjects | "
            + " | ".join(
                " / ".join(fmt_secs(sum(s["wall"] for s in per[v] if s["round"] == r)) for r in rounds[v])
                for v in ("off", "on")
            )
            + " |"
        )
        L.append("")
        if n_rounds > 1:
            L += ["(x / y: round 1 / round 2, where they differ.)", ""]
    L += ["## Sessions", ""]
    for root, sessions in by_root.items():
        first = sessions[0]
        L += [f"### `tests/{root}`: {', '.join('`' + p + '`' for p in first['paths'])}", ""]
        L += [f"Command, in `{first['cwd']}` with " + " ".join(f"`{k}={v}`" for k, v in EXTRA_ENV.items()) + ":", ""]
        on_s = next((s for s in sessions if s["variant"] == "on"), first)
        L += ["```", shlex.join(["python", *on_s["command"][1:]]).replace(str(args.work), "$WORK"), "```", ""]
        L += [f"(without the plugin: the same plus `-p no:ddphooks`; `$WORK` = `{args.work}`)", ""]
        L.append("| figure | " + " | ".join(label(s) for s in sessions) + " |")
        L.append("| --- |" + " ---: |" * len(sessions))
        rows = [
            ("collected", lambda s: str(s["collected"])),
            (
                "tests reported",
                lambda s: f"{len(s['cases'])}" + ("" if s["source"] == "junit" else " (from the log: no junit)"),
            ),
            *[
                (k, lambda s, k=k: str(counts(s["cases"])[k]))
                for k in ("passed", "failed", "error", "skipped", "xfailed")
            ],
            ("reruns", lambda s: str(len(s["reruns"]))),
            ("a spawned rank died by a signal (final failures + rerun attempts)", lambda s: str(rank_signals(s))),
            ("pytest-timeout hits", lambda s: str(s["timeouts"])),
            ("leak lines in the log", lambda s: str(len(s["plugin_lines"]))),
            ("processes of the session alive 1 s after it ended", lambda s: str(len(s["left_processes_in_group"]))),
            ("exit status", lambda s: str(s["returncode"])),
            ("crashed", lambda s: s["crash"] or "no"),
            ("wall time", lambda s: fmt_secs(s["wall"])),
        ]
        for name, fn in rows:
            L.append(f"| {name} | " + " | ".join(fn(s) for s in sessions) + " |")
        L.append("")
        L += ["Final lines: " + "; ".join(f"{label(s)}: `{s['final_line']}`" for s in sessions), ""]
        alive = [(label(s), p) for s in sessions for p in s["left_processes_in_group"]]
        if alive:
            L += [
                "Processes of a session still alive 1 s after it ended (then killed): "
                + "; ".join(f"{lab}: `{p}`" for lab, p in alive),
                "",
            ]
        c = comparisons.get(root)
        if c is None:
            continue
        plugin = [d for d in c["diffs"] if d["kind"] == "plugin"]
        flaky = [d for d in c["diffs"] if d["kind"] == "flaky"]
        L += [
            f"Outcome changed by the plugin: **{len(plugin)}**; flaky: {len(flaky)}; "
            f"Lightning's own failures without the plugin (in every such session): **{len(c['own_failures'])}**.",
            "",
        ]
        for title, ds in (("Changed by the plugin", plugin), ("Flaky", flaky)):
            if not ds:
                continue
            L += [
                f"{title}:",
                "",
                "| test | " + " | ".join(label(s) for s in sessions) + " | the failure |",
                "| --- |" + " --- |" * (len(sessions) + 1),
            ]
            for d in ds:
                L.append(
                    f"| `{d['id']}` | "
                    + " | ".join(str(d["outcomes"][s["name"]]) for s in sessions)
                    + " | "
                    + md(
                        ((d["note"] + "\n") if d.get("note") else "")
                        + "\n".join(
                            f"{label(next(x for x in sessions if x['name'] == n))}: {t}"
                            for n, t in d.get("failures", {}).items()
                        )
                        or "-"
                    )
                    + " |"
                )
            L.append("")
        if c["same_outcome_plugin_words"]:
            L += ["Same outcome in every session, but the plugin's words appear only with it:", ""]
            for t in c["same_outcome_plugin_words"]:
                L.append(f"- `{t['id']}` ({t['outcome']}): " + t["on_excerpt"].replace("\n", " / ")[:600])
            L.append("")
        if c.get("masked_by_rerun"):
            L += ["A first attempt failed with the plugin's words and was rerun (hidden in the final outcome):", ""]
            for m in c["masked_by_rerun"]:
                L.append(f"- `{m['id']}` ({m['session']}, {m['when']}): " + m["text"].replace("\n", " / ")[-600:])
            L.append("")
        reports = [(label(s), r) for s in sessions for r in s.get("rerun_reports", [])]
        if reports:
            L += ["<details><summary>Why each rerun attempt failed (last line of its error)</summary>", ""]
            for lab, r in reports:
                last = next((ln for ln in reversed(r["text"].splitlines()) if ln.strip()), "")
                L.append(f"- {lab}: `{r['id']}` ({r['when']}): {md(last, 300)}")
            L += ["", "</details>", ""]
        reruns = sorted({(label(s), r) for s in sessions for r in s["reruns"]})
        if reruns:
            L += [
                "Rerun by pytest-rerunfailures (Lightning's `flaky` markers; the final outcome counts): "
                + "; ".join(f"{lab}: `{r}`" for lab, r in reruns),
                "",
            ]
        if c["own_failures"]:
            off = next(s for s in sessions if s["variant"] == "off")
            L += ["<details><summary>Lightning's own failures (without the plugin)</summary>", ""]
            for t in c["own_failures"]:
                L.append(
                    f"- `{t}`: {off['cases'][t]['outcome']}: {off['cases'][t]['message'].replace(chr(10), ' ')[:200]}"
                )
            L += ["", "</details>", ""]
        # time: the largest per-test differences of the means
        if any(s["variant"] == "on" for s in sessions) and any(s["variant"] == "off" for s in sessions):

            def mean_time(v: str, t: str, sessions: list[dict] = sessions) -> float:
                xs = [s["cases"][t]["time"] for s in sessions if s["variant"] == v and t in s["cases"]]
                return sum(xs) / len(xs) if xs else 0.0

            common = set.intersection(*(set(s["cases"]) for s in sessions))
            deltas = sorted(((mean_time("on", t) - mean_time("off", t), t) for t in common), key=lambda x: -abs(x[0]))[
                :8
            ]
            L += [
                "<details><summary>Largest per-test time differences (junit call time, mean over rounds)</summary>",
                "",
                "| test | without | with |",
                "| --- | ---: | ---: |",
            ]
            for _dlt, t in deltas:
                L.append(f"| `{t}` | {mean_time('off', t):.1f} s | {mean_time('on', t):.1f} s |")
            L += ["", "</details>", ""]
    L += ["## Environment notes", ""]
    if facts.get("canary"):
        c = facts["canary"]
        L.append(
            f"- Guard armed (a canary suite in the same venv leaks a thread and `MASTER_PORT`): "
            f"{'yes' if c['armed'] else '**no**'}; without the plugin: `{c['off']['final_line']}`; "
            f"with it: `{c['on']['final_line']}`."
        )
    L.append(
        f"- Installed, every pip call constrained to `{pinned_torch()}` with torchvision unresolvable: torch, "
        f"the plugin (`pip install -e {ROOT}`), Lightning (`PACKAGE_NAME=lightning pip install -e .` in the export; "
        "the PyPI `pytorch-lightning` its requirements pull is uninstalled, as Lightning's CI does), and "
        + ", ".join(f"`{f}`" for f in REQUIREMENT_FILES)
        + f"; never installed: {', '.join(facts.get('denied', []))}."
    )
    if facts.get("dropped"):
        L.append(
            "- Requirement lines dropped because they failed to install: "
            + "; ".join(f"`{d}`" for d in facts["dropped"])
        )
    else:
        L.append("- No requirement line failed to install.")
    if skipped:
        L.append(
            "- Files of Lightning's HEAD absent from the mirror (not exported): " + "; ".join(f"`{s}`" for s in skipped)
        )
    L.append(
        "- Deviations from Lightning's CI, the same for every session: `GLOO_SOCKET_IFNAME=lo` (CI: `eth0`), "
        "`HF_HUB_OFFLINE=1`, no coverage wrapper, no `--random-order-seed` (file order), torch 2.13.0 CPU, "
        "Python 3.11, SIGHUP/SIGINT/SIGTERM reset to their defaults in each session (under `nohup` an inherited "
        "SIG_IGN fails two of Lightning's signal-connector tests)."
    )
    L.append(
        "- Per-session logs, junit files and `summary.json`: `$WORK/runs/<variant><round>-<root>/`; the comparison: "
        "`$WORK/runs/comparison.json`."
    )
    L.append("")
    return "\n".join(L)


def print_diffs(comparisons: dict) -> None:
    print("\n=== tests whose outcome is not the same in every session ===")
    n = 0
    for root, c in comparisons.items():
        for d in c["diffs"]:
            n += 1
            print(f"\n[{root}] {d['kind']}: {d['id']}: " + ", ".join(f"{k}={v}" for k, v in d["outcomes"].items()))
            if d["on_excerpt"]:
                print("  " + d["on_excerpt"].replace("\n", "\n  "))
    if not n:
        print("none")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--work", type=Path, default=DEFAULT_WORK, help=f"work folder, outside the repository (default {DEFAULT_WORK})"
    )
    p.add_argument(
        "--lightning-git", type=Path, default=DEFAULT_GIT, help=f"Lightning's git directory (default {DEFAULT_GIT})"
    )
    p.add_argument("--paths", nargs="+", default=list(DEFAULT_PATHS), help="subjects, relative to Lightning's root")
    p.add_argument(
        "--variants", default="off,on", help="the order of round 1 (default off,on; 'on' alone: only the plugin)"
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds, in ABBA order (default 2: off,on then on,off)")
    p.add_argument(
        "--timeout",
        type=int,
        default=0,
        help="pytest-timeout per test (default: Lightning CI's, 90 pytorch / 60 fabric)",
    )
    p.add_argument(
        "--session-limit", type=int, default=5400, help="wall-clock limit per session, seconds (default 5400)"
    )
    p.add_argument("--python", default="python3", help="interpreter of the venv (default python3)")
    p.add_argument(
        "--pytest-arg",
        action="append",
        default=[],
        help="extra pytest argument for every session (repeatable), e.g. -k",
    )
    p.add_argument("--skip-setup", action="store_true", help="use the venv as it is (no pip call)")
    p.add_argument("--reinstall", action="store_true", help="new venv")
    p.add_argument("--fresh", action="store_true", help="export Lightning anew")
    p.add_argument("--setup-only", action="store_true")
    p.add_argument("--report-only", action="store_true", help="rebuild the page from the sessions in WORK/runs")
    p.add_argument("--no-page", action="store_true", help=f"do not write {RESULT_PAGE.relative_to(ROOT)}")
    args = p.parse_args()
    args.work = args.work.resolve()
    if args.work == ROOT or ROOT in args.work.parents:
        raise SystemExit(f"the work folder must be outside the repository: {args.work}")
    args.work.mkdir(parents=True, exist_ok=True)
    started_at = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    t0 = time.perf_counter()

    commit = git_head(args.lightning_git)
    src, skipped = export(args, commit)
    if args.skip_setup and (args.work / "facts.json").exists():
        facts = json.loads((args.work / "facts.json").read_text())
    else:
        facts = setup_env(args, src)
        (args.work / "facts.json").write_text(json.dumps(facts, indent=1))
    if args.setup_only:
        return 0

    groups = groups_of(args.paths)
    order = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not order or any(v not in VARIANTS for v in order):
        raise SystemExit(f"--variants: a list of {', '.join(VARIANTS)}")
    by_root: dict[str, list[dict]] = {root: [] for root in groups}
    if args.report_only:
        found = sorted(
            (args.work / "runs").glob("*/summary.json"),
            key=lambda f: json.loads(f.read_text()).get("started", f.stat().st_mtime),
        )
        for f in found:
            summary = json.loads(f.read_text())
            if summary["root"] in groups and summary["paths"] == groups[summary["root"]]:
                by_root[summary["root"]].append(summary)
        canary = args.work / "canary.json"
        facts["canary"] = json.loads(canary.read_text()) if canary.exists() else None
    else:
        facts["canary"] = check_canary(args) if "on" in order else None
        (args.work / "canary.json").write_text(json.dumps(facts["canary"], indent=1))
        warm_up(args, src, groups)
        for rnd in range(1, args.rounds + 1):
            for variant in order if rnd % 2 else order[::-1]:
                for root, rels in groups.items():
                    by_root[root].append(run_session(args, src, root, rels, variant, rnd))
    for sessions in by_root.values():
        for s in sessions:
            loaded = "ddphooks" in s["plugins_line"]
            if loaded != (s["variant"] == "on"):
                raise SystemExit(f"session {s['name']}: the plugin loaded={loaded}, not as asked: {s['plugins_line']}")
    meta_file = args.work / "runs" / "meta.json"
    if args.report_only and meta_file.exists():
        meta = json.loads(meta_file.read_text())
        args.produced_by = meta["command"]
        started_at, total = meta["started_at"], meta["total"]
    else:
        args.produced_by = None
        total = time.perf_counter() - t0
        meta_file.parent.mkdir(parents=True, exist_ok=True)
        meta_file.write_text(
            json.dumps(
                {
                    "command": shlex.join(
                        ["python3", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]]
                    ),
                    "started_at": started_at,
                    "total": total,
                }
            )
        )
    comparisons = {
        root: compare(ss) for root, ss in by_root.items() if {"off", "on"} <= {s["variant"] for s in ss} or len(ss) > 1
    }
    (args.work / "runs" / "comparison.json").write_text(json.dumps(comparisons, indent=1))
    page = write_report(args, commit, skipped, facts, by_root, comparisons, started_at, total)
    if not args.no_page:
        RESULT_PAGE.parent.mkdir(parents=True, exist_ok=True)
        RESULT_PAGE.write_text(page + "\n")
        log(f"wrote {RESULT_PAGE}")
    print(page)
    print_diffs(comparisons)
    return 0


if __name__ == "__main__":
    sys.exit(main())
