"""Asking processes for their stacks: the answer of the living, no wait for the departed."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time

import _pytest
import pluggy

import pytest_ddphooks
from pytest_ddphooks.launch import procs
from pytest_ddphooks.stacks import (
    Frame,
    OwnFrames,
    ThreadStack,
    dump_stacks,
    fatal_error,
    format_stack,
    own_frames,
    without_harness_frames,
)

ANSWERS = """
import faulthandler, signal, sys, time
stacks = open(sys.argv[1], "w")
faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
def waiting_to_be_asked():
    print("ready", flush=True)  # from inside: asked after this line, the stack has this frame
    time.sleep(60)
waiting_to_be_asked()
"""


def test_a_living_process_answers_with_its_stack(tmp_path) -> None:
    path = tmp_path / "stacks"
    child = subprocess.Popen([sys.executable, "-c", ANSWERS, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        stacks = dump_stacks({0: (child.pid, str(path))})[0]
        assert "waiting_to_be_asked" in path.read_text()
        assert stacks.threads
    finally:
        child.kill()
        child.wait()


def test_processes_that_ended_are_not_waited_for(tmp_path) -> None:
    """Reaped or a zombie: either way it writes nothing more, and the report goes on at once
    (a minute's patience here would be the old behaviour of waiting out the deadline)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while procs.state_of(zombie.pid) not in ("Z", None):
        os.sched_yield()
    targets = {0: (gone.pid, str(tmp_path / "gone")), 1: (zombie.pid, str(tmp_path / "zombie"))}
    began = time.monotonic()
    out = dump_stacks(targets, wait=60.0)
    assert time.monotonic() - began < 30.0
    assert set(out) == {0, 1} and not out[0].threads and not out[1].threads
    assert zombie.wait() == 0  # left for its parent to reap


KEPT = """
import os, signal, sys
from pytest_ddphooks import dump_signals
stacks = open(sys.argv[1], "w")
if sys.argv[2] == "kept":
    dump_signals.keep_armed((signal.SIGUSR1,), lambda: dump_signals.register(signal.SIGUSR1, stacks))
else:
    import faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
# what Lightning's trainer does around a fit: Python thinks SIGUSR1 is at its default
signal.signal(signal.SIGUSR1, signal.getsignal(signal.SIGUSR1))
def asked_after_the_restore():
    os.kill(os.getpid(), signal.SIGUSR1)
asked_after_the_restore()
print("alive", flush=True)
"""


def test_a_dump_kept_armed_survives_code_that_puts_every_handler_back(tmp_path) -> None:
    for how, alive in (("kept", True), ("plain", False)):
        path = tmp_path / f"stacks-{how}"
        done = subprocess.run([sys.executable, "-c", KEPT, str(path), how], capture_output=True, text=True, timeout=60)
        assert ("alive" in done.stdout) is alive, (how, done.returncode, done.stderr[-500:])
        if alive:
            assert "asked_after_the_restore" in path.read_text()


def test_a_crash_in_a_native_thread_says_what_cpp_said_and_where_the_main_thread_was(tmp_path) -> None:
    test_file = tmp_path / "test_grads.py"
    test_file.write_text("def test_grads():\n    dist.all_reduce(grad)\n")
    stderr = (
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [enforce fail at pair.cc:456] Received data size doesn't match expected size.\n"
        "Fatal Python error: Aborted\n\n"
        "Thread 0x00007f07bebff6c0 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 982 in run\n\n'
        "Thread 0x00007f07de9f9b80 (most recent call first):\n"
        f'  File "{test_file}", line 2 in test_grads\n'
    )
    lines = fatal_error(stderr)
    assert lines[:3] == [
        "Fatal Python error: Aborted",
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
        "what():  [enforce fail at pair.cc:456] Received data size doesn't match expected size.",
    ]
    assert lines[3] == "it crashed in a native thread; the main thread was at (most recent call last):"
    assert lines[4].endswith('test_grads.py", line 2, in test_grads')
    assert lines[5] == "    dist.all_reduce(grad)"


def test_a_crash_in_a_python_thread_shows_that_thread_only() -> None:
    stderr = (
        "Fatal Python error: Segmentation fault\n\n"
        "Thread 0x0002 (most recent call first):\n"
        '  File "/srv/other.py", line 5 in idle\n\n'
        "Current thread 0x0001 (most recent call first):\n"
        '  File "/srv/crash.py", line 3 in crash\n'
    )
    lines = fatal_error(stderr)
    assert lines[0] == "Fatal Python error: Segmentation fault"
    assert lines[1] == "in the thread that crashed (most recent call last):"
    assert "native thread" not in "\n".join(lines)
    assert not any("other.py" in ln for ln in lines)


def test_a_crash_dump_in_a_ranks_stderr_leaves_out_the_harness() -> None:
    """The dump is the harness's doing: the launcher and pytest below the test, the
    recorder's wrappers and the harness's own threads are not the test's."""
    package = os.path.dirname(os.path.abspath(pytest_ddphooks.__file__))
    stderr = (
        "before the crash\n"
        "Fatal Python error: Aborted\n\n"
        "Thread 0x0002 (most recent call first):\n"
        f'  File "{package}/launch/rank.py", line 202 in serve\n'
        '  File "/usr/lib/python3.11/threading.py", line 982 in run\n\n'
        "Current thread 0x0001 (most recent call first):\n"
        '  File "/venv/torch/distributed/distributed_c10d.py", line 2799 in recv\n'
        f'  File "{package}/recorder/distpatch.py", line 556 in wrapper\n'
        '  File "/srv/test_x.py", line 11 in test_recv\n'
        '  File "/venv/_pytest/python.py", line 157 in pytest_pyfunc_call\n'
        f'  File "{package}/launch/rank.py", line 300 in rank_main\n\n'
        "Extension modules: torch._C (total: 1)\n"
    )
    assert without_harness_frames(stderr) == (
        "before the crash\n"
        "Fatal Python error: Aborted\n\n"
        "Current thread 0x0001 (most recent call first):\n"
        '  File "/venv/torch/distributed/distributed_c10d.py", line 2799 in recv\n'
        '  File "/srv/test_x.py", line 11 in test_recv\n\n'
        "Extension modules: torch._C (total: 1)\n"
    )
    assert without_harness_frames("no dump here\n") == "no dump here\n"


def _frames(*outer_first: tuple[str, str]) -> list[Frame]:
    """A main thread's frames as a dump holds them (innermost first), given outermost first."""
    return [Frame(path, 1, fn) for path, fn in outer_first][::-1]


_PKG = os.path.dirname(os.path.abspath(pytest_ddphooks.__file__))
_PYTEST = os.path.dirname(os.path.abspath(_pytest.__file__))
_PLUGGY = os.path.dirname(os.path.abspath(pluggy.__file__))
_STDLIB = sysconfig.get_paths()["stdlib"]
_TORCH = os.path.join(os.path.dirname(_PYTEST), "torch")
_USER = "/srv/project/test_x.py"
# a rank the fork server prepared before its test: forked from deep inside pytest's main
_PREPARED = (
    ("<frozen runpy>", "_run_module_as_main"),
    (f"{_PYTEST}/config/__init__.py", "main"),
    (f"{_PLUGGY}/_callers.py", "_multicall"),
    (f"{_PKG}/plugin/multirank.py", "pytest_runtestloop"),
    (f"{_PKG}/launch/forkserver.py", "_fork_ranks"),
    (f"{_PKG}/launch/rank.py", "prepared_rank_main"),
    (f"{_PKG}/launch/rank.py", "_run"),
    (f"{_PKG}/plugin/rankbody.py", "_run_body"),
)


def test_a_rank_fixtures_stack_starts_at_the_fixture_and_keeps_what_it_calls() -> None:
    barrier = [(f"{_TORCH}/distributed/c10d_logger.py", "wrapper"), (f"{_PKG}/recorder/distpatch.py", "wrapper")]
    setup = _frames(*_PREPARED, (f"{_PKG}/plugin/rankfixtures.py", "_evaluate"), (_USER, "hangs"), *barrier)
    assert own_frames(setup) == OwnFrames(_frames((_USER, "hangs"), barrier[0]))
    # the first test's ranks are forked by the fork server itself, not prepared
    first = _frames((f"{_PKG}/launch/rank.py", "rank_main"), *_PREPARED[6:], (_USER, "hangs"))
    assert own_frames(first).frames == _frames((_USER, "hangs"))
    # forked inside a test of an outer session (pytester): that test's body is not the rank's
    outer_test = [(f"{_PYTEST}/python.py", "pytest_pyfunc_call"), ("/srv/project/test_outer.py", "test_it")]
    nested = setup + _frames(*outer_test)
    assert own_frames(nested) == own_frames(setup)
    # a decorator around the fixture, and pytest's machinery the fixture calls, are the fixture's doing
    teardown = _frames(
        *_PREPARED,
        (f"{_PKG}/plugin/rankfixtures.py", "finish"),
        (f"{_STDLIB}/contextlib.py", "inner"),
        (_USER, "hangs"),
        (f"{_PYTEST}/fixtures.py", "getfixturevalue"),
    )
    assert own_frames(teardown).frames == teardown[:3]


def test_a_body_or_a_thread_of_the_test_keeps_its_stack_as_it_was() -> None:
    body = _frames(*_PREPARED, (f"{_PYTEST}/python.py", "pytest_pyfunc_call"), (_USER, "test_x"))
    assert own_frames(body) == OwnFrames(_frames((_USER, "test_x")))
    thread = _frames((f"{_STDLIB}/threading.py", "_bootstrap"), (_USER, "worker"), (f"{_STDLIB}/queue.py", "get"))
    assert own_frames(thread) == OwnFrames(thread)


def test_a_rank_stuck_in_the_harness_is_said_and_shown_from_its_entry_point() -> None:
    stuck = _frames(*_PREPARED[:6], (f"{_PKG}/launch/rank.py", "_await_job"))
    assert own_frames(stuck) == OwnFrames(stuck[:2], in_harness=True)
    lines = format_stack(ThreadStack(1, True, stuck), "rank 0 stack, MainThread")
    assert lines[1] == "  (no frame of the test's code: the rank is in the harness itself, here from its start)"
    told = [ln for ln in lines if ln.startswith("  File")]
    assert [ln.rsplit(", in ", 1)[1] for ln in told] == ["prepared_rank_main", "_await_job"]


def test_an_ask_made_while_the_last_is_answered_is_not_lost(tmp_path) -> None:
    """The pipe was reopened after each ask: one made while the rank answered the watchdog's
    '?' (reading torch's flight recorder) found no reader and was dropped, and a hang's report
    had only the 100 frames faulthandler writes."""
    import threading

    from pytest_ddphooks.launch.rank import _answer_asks
    from pytest_ddphooks.stacks import ASK_NATIVE, ASK_STACKS, ask

    answering, release = threading.Event(), threading.Event()

    class Recorder:
        def read_native(self, grace: bool) -> None:
            answering.set()
            release.wait(30)

    pipe, stacks = str(tmp_path / "ask"), str(tmp_path / "stacks")
    _answer_asks(pipe, stacks, Recorder())  # type: ignore[arg-type]
    ask(pipe, ASK_NATIVE)
    assert answering.wait(30)
    ask(pipe, ASK_STACKS)  # while the first is being answered
    release.set()
    deadline = time.monotonic() + 30
    while not os.path.exists(stacks):
        assert time.monotonic() < deadline, "the second ask was lost"
        time.sleep(0.01)
    with open(stacks) as answered:
        assert f"Thread 0x{threading.get_ident():016x}" in answered.read()
