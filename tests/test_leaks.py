"""The leak guard: every kind fires when leaked and stays silent when cleaned, in each mode."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

LEAKS = {
    "group": (
        """
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
        """,
        """
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
        dist.destroy_process_group()
        """,
        "  the default process group (backend gloo, world size 1, group name *) is still initialised",
    ),
    "process": (
        """
        p = subprocess.Popen(["sleep", "300"])
        if os.environ.get("LEAK_PID_FILE"):
            open(os.environ["LEAK_PID_FILE"], "w").write(str(p.pid))
        """,
        """
        p = subprocess.Popen(["sleep", "300"])
        p.kill()
        p.wait()
        """,
        "  process * is still running: sleep 300",
    ),
    "thread": (
        """
        threading.Thread(target=STOP.wait, name="leaky-worker", daemon=True).start()
        """,
        """
        t = threading.Thread(target=STOP.wait, name="tidy-worker", daemon=True)
        t.start()
        STOP.set()
        t.join()
        """,
        "  daemon thread 'leaky-worker' (target threading.Event.wait) is still running:"
        " a thread cannot be stopped from outside; it was left running",
    ),
    "socket": (
        """
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        KEEP.append(s)
        """,
        """
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
        """,
        "  socket listening on 127.0.0.1:* is still open",
    ),
    "connection": (
        """
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        server.close()
        KEEP.extend([client, conn])
        """,
        """
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            with socket.create_connection(server.getsockname()):
                pass
        """,
        "  connection 127.0.0.1:* -> 127.0.0.1:* (ESTABLISHED) is still open",
    ),
    "env": (
        """
        os.environ["MASTER_PORT"] = "29500"
        """,
        """
        monkeypatch.setenv("MASTER_PORT", "29500")
        """,
        "  environment variable MASTER_PORT='29500' was set",
    ),
}

PRELUDE = """
import os
import socket
import subprocess
import threading
import pytest
import torch.distributed as dist

STOP = threading.Event()
KEEP = []
"""


CLEANED = "test_leaky.py::test_it leaked (cleaned up before the next test):"
LEFT = "test_leaky.py::test_it leaked what could not be cleaned up safely (left as it is):"


def _header(kind: str) -> str:
    """A thread cannot be stopped from outside: the report says it was left running."""
    return LEFT if kind == "thread" else CLEANED


def _module(body: str, name: str = "test_it") -> str:
    indented = textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")
    return PRELUDE + f"\ndef {name}(tmp_path, monkeypatch):\n{indented}\n\ndef test_after():\n    pass\n"


# an in-process inner run's thread leak is also this process's: it cannot be stopped
@pytest.mark.ddp_allow_leaks("thread:leaky-worker")
@pytest.mark.parametrize("kind", sorted(LEAKS))
def test_leak_fails_the_test_in_teardown_naming_it(pytester, kind: str) -> None:
    leaky, _, words = LEAKS[kind]
    pytester.makepyfile(test_leaky=_module(leaky))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_it*", _header(kind), words])


@pytest.mark.parametrize("kind", sorted(LEAKS))
def test_clean_test_stays_silent(pytester, kind: str) -> None:
    _, tidy, _ = LEAKS[kind]
    pytester.makepyfile(test_tidy=_module(tidy))
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "error::pytest_ddphooks.LeakWarning")
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*leaked*")


@pytest.mark.ddp_allow_leaks("thread:leaky-worker")
@pytest.mark.parametrize("kind", sorted(LEAKS))
def test_warn_mode_warns_with_the_same_words(pytester, kind: str) -> None:
    leaky, _, words = LEAKS[kind]
    pytester.makepyfile(test_leaky=_module(leaky))
    result = pytester.runpytest("-p", "no:cacheprovider", "--ddp-leaks=warn")
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*test_leaky.py:*: LeakWarning: " + _header(kind),
            "  " + words,
        ]
    )


@pytest.mark.parametrize("kind", sorted(LEAKS))
def test_off_mode_reports_nothing(pytester, kind: str, monkeypatch, tmp_path) -> None:
    leaky, _, _ = LEAKS[kind]
    pid_file = tmp_path / "leaked.pid"
    monkeypatch.setenv("LEAK_PID_FILE", str(pid_file))
    pytester.makepyfile(test_leaky=_module(leaky))
    pytester.makeini("[pytest]\nddp_leaks = off\n")
    # in its own interpreter: a thread the guard cannot stop ends with that process
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*leaked*")
    result.stdout.no_fnmatch_line("*leak guard*")


def test_leak_is_cleaned_before_the_next_test(pytester) -> None:
    pytester.makepyfile(
        test_order=PRELUDE
        + """
def test_leaks_group_and_env(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    os.environ["RANK"] = "3"

def test_next_sees_a_clean_process():
    assert not dist.is_initialized()
    assert "RANK" not in os.environ
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    # off reports nothing, and cleans all the same: the next test never sees the leak
    result = pytester.runpytest("-p", "no:cacheprovider", "--ddp-leaks=off")
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*leaked*")


@pytest.mark.ddp_allow_leaks("thread:known-pool", "thread:other")
def test_allowlist_in_ini_and_marker(pytester) -> None:
    pytester.makeini("[pytest]\nddp_leaks_allow =\n    thread:known-*\n")
    pytester.makepyfile(
        test_allow=PRELUDE
        + """
def test_known_thread():
    threading.Thread(target=STOP.wait, name="known-pool", daemon=True).start()

@pytest.mark.ddp_allow_leaks("env:MASTER_ADDR")
def test_marker_allows_env():
    os.environ["MASTER_ADDR"] = "127.0.0.1"

@pytest.mark.ddp_allow_leaks("thread")
def test_marker_allows_a_kind():
    threading.Thread(target=STOP.wait, name="other", daemon=True).start()

@pytest.mark.ddp_allow_leaks("env:MASTER_ADDR")
def test_marker_allows_only_what_it_names():
    os.environ["WORLD_SIZE"] = "2"
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_marker_allows_only_what_it_names leaked*", "  environment variable WORLD_SIZE='2' was set"]
    )

    os.environ.pop("MASTER_ADDR", None)


def test_bad_allowlist_entry_is_a_usage_error(pytester) -> None:
    pytester.makeini("[pytest]\nddp_leaks_allow =\n    threads:x\n")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*ddp_leaks_allow*'threads:x'*the kind must be one of group, process, thread, socket, env*"]
    )


def test_bad_allow_marker_fails_its_test_at_setup(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.ddp_allow_leaks("threads:x")
        def test_x():
            raise AssertionError("must not run")

        @pytest.mark.ddp_allow_leaks(42)
        def test_not_a_str():
            raise AssertionError("must not run")

        @pytest.mark.ddp_allow_leaks(entries="env:SOMETHING_ELSE")
        def test_keyword():
            raise AssertionError("must not run")

        @pytest.mark.ddp_allow_leaks("env:MY_FLAG", reason="the app sets it for good")
        def test_with_a_reason():
            import os
            os.environ["MY_FLAG"] = "1"

        def test_after():
            pass
        """
    )
    ran.result.assert_outcomes(passed=2, errors=3)  # each bad marker once, at its setup
    ran.lines(
        "*@pytest.mark.ddp_allow_leaks: takes the entries as positional arguments, got entries="
        " ('env:MASTER_PORT', 'thread:worker-*')"
    )
    ran.lines(
        "*ERROR at setup of test_x*",
        "*@pytest.mark.ddp_allow_leaks: *'threads:x'*the kind must be one of group*",
    )
    ran.lines("*@pytest.mark.ddp_allow_leaks: leak allowlist entry 42: an entry is a str such as 'thread:worker-*'*")
    ran.no_lines("*must not run*")
    ran.no_lines("*AttributeError*")


def test_a_forked_child_gets_a_processes_second_not_a_relaunched_ranks_wait(inner) -> None:
    ran = inner(
        """
        import multiprocessing
        import time

        def sleeper():
            time.sleep(300)

        def test_forks():
            multiprocessing.get_context("fork").Process(target=sleeper).start()

        def test_after():
            pass
        """,
        "--durations=0",
    )
    ran.result.assert_outcomes(passed=2, errors=1)
    ran.lines("*test_forks leaked (cleaned up before the next test):*")
    teardown = next(line for line in ran.text.splitlines() if line.endswith("teardown test_inner.py::test_forks"))
    assert float(teardown.split("s", 1)[0]) < 10, teardown  # 1 s to end, not the 30 s of a relaunch


def test_module_fixture_is_judged_when_its_scope_ends(pytester) -> None:
    pytester.makepyfile(
        test_scoped=PRELUDE
        + """
@pytest.fixture(scope="module")
def group(tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    dist.init_process_group("gloo", init_method=f"file://{path}/s", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

@pytest.fixture(scope="module")
def sloppy_server():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    KEEP.append(s)
    yield s

def test_one(group):
    assert dist.is_initialized()

def test_two(group):
    assert dist.is_initialized()

def test_uses_server(sloppy_server):
    pass

def test_last():
    pass
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rE")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_last*",
            "fixture 'sloppy_server' (module scope), set up for test_scoped.py::test_uses_server,"
            " left behind when its scope ended (cleaned up):",
            "  socket listening on 127.0.0.1:* is still open",
        ]
    )
    result.stdout.no_fnmatch_line("*test_one leaked*")


def test_no_false_alarms_in_a_clean_suite_of_200_tests(pytester) -> None:
    pytester.makepyfile(
        test_clean="""
        import threading
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.fixture(scope="session")
        def model():
            return torch.nn.Linear(2, 2)

        @pytest.mark.parametrize("i", range(190))
        def test_plain(i, model, tmp_path, monkeypatch):
            monkeypatch.setenv("RANK", "0")
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()
            assert model(torch.ones(2)).shape == (2,)

        @pytest.mark.parametrize("i", range(10))
        @pytest.mark.multirank(world_size=2)
        def test_ranks(i, rank):
            dist.barrier()
        """
    )
    for args in ((), ("-n", "2"), ("--timeout=30", "--timeout-method=thread")):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
        result.assert_outcomes(passed=200)
        result.stdout.no_fnmatch_line("*leaked*")


def test_processes_a_rank_leaves_are_killed_and_named(pytester) -> None:
    pytester.makepyfile(
        test_rank_leak="""
        import multiprocessing
        import subprocess
        import threading
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_spawns(rank):
            if rank == 1:
                subprocess.Popen(["sleep", "300"])

        @pytest.mark.multirank(world_size=2)
        def test_tidy(rank):
            subprocess.run(["true"], check=True)

        @pytest.mark.ddp_allow_leaks("process:*sleep 301*")
        @pytest.mark.multirank(world_size=2)
        def test_allowed_to(rank):
            subprocess.Popen(["sleep", "301"])  # killed with its rank all the same, not reported

        def serve_for_ever():
            threading.Event().wait()

        @pytest.mark.multirank(world_size=2)
        def test_forks(rank):
            if rank == 0:
                multiprocessing.get_context("fork").Process(target=serve_for_ever, daemon=False).start()
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.no_fnmatch_line("*sleep 301*")
    result.stdout.fnmatch_lines(
        [
            "test_rank_leak.py::test_spawns leaked (cleaned up before the next test):",
            "  rank 1 left process * running (killed): sleep 300",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "test_rank_leak.py::test_forks leaked (cleaned up before the next test):",
            "  rank 0 left process * running (killed): * (a fork of the rank)",
        ]
    )


def test_group_a_rank_keeps_alive_is_not_a_leak(pytester) -> None:
    pytester.makepyfile(
        test_trainer_style="""
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, init_process_group=False)
        def test_keeps_its_group(rank):
            dist.init_process_group("gloo")  # kept alive on purpose, as Lightning does after fit
            dist.barrier()
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_unittest_class_resources_are_judged_when_the_class_ends(pytester) -> None:
    pytester.makepyfile(
        test_unit="""
        import subprocess
        import unittest

        class TestPool(unittest.TestCase):
            # like torch's MultiProcContinuousTest: workers start lazily, live for the class
            workers = []

            def setUp(self):
                if not self.workers:
                    self.workers.append(subprocess.Popen(["sleep", "300"]))

            @classmethod
            def tearDownClass(cls):
                for w in cls.workers:
                    w.kill()
                    w.wait()

            def test_a(self):
                pass

            def test_b(self):
                pass

        class TestSloppy(unittest.TestCase):
            workers = []

            def setUp(self):
                if not self.workers:
                    self.workers.append(subprocess.Popen(["sleep", "301"]))

            def test_a(self):
                pass

            def test_b(self):
                pass

        class TestMethodLeaks(unittest.TestCase):
            def test_leaves_a_process(self):
                subprocess.Popen(["sleep", "302"])

            def test_sees_none(self):
                import psutil

                alive = [p for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE]
                assert not [p for p in alive if "302" in " ".join(p.cmdline())]
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=6, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of TestSloppy.test_b*",
            "unittest class TestSloppy (its setUp), set up for test_unit.py::TestSloppy::test_a,"
            " left behind when its scope ended (cleaned up):",
            "  process * is still running: sleep 301",
        ]
    )
    # what a test method itself leaves is its own leak, cleaned before the next test
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of TestMethodLeaks.test_leaves_a_process*",
            "test_unit.py::TestMethodLeaks::test_leaves_a_process leaked (cleaned up before the next test):",
            "  process * is still running: sleep 302",
        ]
    )


def test_what_a_wider_fixture_undoes_in_its_teardown_is_no_leak_of_the_last_test(inner) -> None:
    """The class's fixture sets MASTER_PORT and removes it when the class ends, in the
    teardown of the class's last test: nothing is reported and nothing is put back, while
    that test's own leak is still found."""
    ran = inner(
        """
        import os
        import pytest

        class TestWithPort:
            @pytest.fixture(scope="class", autouse=True)
            @classmethod
            def port(cls):
                os.environ["MASTER_PORT"] = "29555"
                yield
                del os.environ["MASTER_PORT"]

            def test_a(self):
                assert os.environ["MASTER_PORT"] == "29555"

            def test_last_of_class(self):
                os.environ["WORLD_SIZE"] = "2"

        def test_next_sees_what_the_fixture_left():
            assert "MASTER_PORT" not in os.environ
            assert "WORLD_SIZE" not in os.environ
        """
    )
    ran.result.assert_outcomes(passed=3, errors=1)
    ran.lines(
        "*ERROR at teardown of TestWithPort.test_last_of_class*",
        "test_inner.py::TestWithPort::test_last_of_class leaked (cleaned up before the next test):",
        "  environment variable WORLD_SIZE='2' was set",
    )
    ran.no_lines("*MASTER_PORT*")


def test_an_allowed_process_may_outlive_its_test_but_not_the_session(inner, tmp_path) -> None:
    pid_file = tmp_path / "pid"
    ran = inner(
        f"""
        import subprocess
        import pytest

        @pytest.mark.ddp_allow_leaks("process:*sleep 302*")
        def test_starts_a_server():
            proc = subprocess.Popen(["sleep", "302"])
            open({str(pid_file)!r}, "w").write(str(proc.pid))

        def test_server_still_there():
            import os
            os.kill(int(open({str(pid_file)!r}).read()), 0)
        """
    )
    ran.result.assert_outcomes(passed=2)
    ran.no_lines("*sleep 302*")
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    # killed: gone, or a zombie until this process (its parent here) reaps it
    assert not stat.exists() or stat.read_text().split(") ")[1][0] == "Z"


def test_allowing_a_group_allows_its_sockets(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.ddp_allow_leaks("group")
        def test_group_allowed():
            store = dist.TCPStore("127.0.0.1", 0, 1, True)  # its listening socket and connections
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)

        def test_still_there():
            assert dist.is_initialized()
            dist.destroy_process_group()
        """
    )
    ran.result.assert_outcomes(passed=2)
    ran.no_lines("*leaked*")


def test_what_a_lingering_thread_makes_while_the_guard_waits_is_the_tests_leak(inner) -> None:
    ran = inner(
        """
        import os
        import subprocess
        import threading
        import time

        def test_delayed():
            def later():
                time.sleep(0.3)
                global CHILD
                CHILD = subprocess.Popen(["sleep", "300"])
            threading.Thread(target=later, name="later").start()

        def test_next_sees_it_cleaned():
            time.sleep(0.5)
            assert CHILD.poll() is not None
        """
    )
    ran.result.assert_outcomes(passed=2, errors=1)
    ran.lines("*test_delayed leaked (cleaned up before the next test):", "  process * is still running: sleep 300")


def test_what_a_later_test_is_charged_with_names_the_thread_an_earlier_one_left_running(inner) -> None:
    ran = inner(
        """
        import os
        import subprocess
        import threading

        GO, DONE, KEEP = threading.Event(), threading.Event(), []

        def test_starts_a_spawner():
            def spawner():
                GO.wait()
                KEEP.append(subprocess.Popen(["sleep", "301"]))
                DONE.set()
            threading.Thread(target=spawner, name="spawner", daemon=True).start()

        def test_innocent():
            GO.set()
            DONE.wait(30)

        def test_clean_and_quiet():
            pass
        """,
        "--ddp-leaks=warn",
    )
    ran.result.assert_outcomes(passed=3, warnings=2)
    ran.lines(
        "*test_innocent leaked (cleaned up before the next test):",
        "    process * is still running: sleep 301",
        "    (perhaps not this test's: daemon thread 'spawner' (target *spawner), left running by"
        " test_inner.py::test_starts_a_spawner, still ran as this test began)",
    )
    ran.no_lines("*test_clean_and_quiet leaked*")
    ran.no_lines("*test_starts_a_spawner leaked*perhaps not*")


def test_an_xfail_never_takes_a_leak_for_the_failure_it_expects(inner) -> None:
    ran = inner(
        """
        import subprocess
        import pytest

        @pytest.mark.xfail(reason="bug 123")
        def test_known_bug_that_leaks():
            subprocess.Popen(["sleep", "303"])
            assert False

        @pytest.mark.xfail(reason="bug 124")
        def test_known_bug_clean():
            assert False
        """,
        "-rA",
    )
    ran.result.assert_outcomes(xfailed=2, errors=1)
    ran.lines(
        "*ERROR at teardown of test_known_bug_that_leaks*",
        "test_inner.py::test_known_bug_that_leaks leaked (cleaned up before the next test):",
        "  process * is still running: sleep 303",
    )


def test_a_leak_warning_raised_as_an_error_shows_the_leak_not_the_guard(inner) -> None:
    ran = inner(
        """
        import os

        def test_sets_rank():
            os.environ["WORLD_SIZE"] = "7"
        """,
        "--ddp-leaks=warn",
        "-W",
        "error",
    )
    ran.result.assert_outcomes(passed=1, errors=1)
    ran.lines(
        "LeakWarning: test_inner.py::test_sets_rank leaked (cleaned up before the next test):",
        "  environment variable WORLD_SIZE='7' was set",
    )
    ran.no_lines("*leaks.py*")


def test_each_wider_fixture_answers_for_what_its_own_setup_made(inner) -> None:
    ran = inner(
        """
        import http.server
        import socket
        import threading
        import pytest

        KEEP = []

        @pytest.fixture(scope="session")
        def clean_session():
            yield 1

        @pytest.fixture(scope="module")
        def kept_socket():
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            KEEP.append(s)  # kept by the module as well: letting go of the value closes nothing
            yield s

        @pytest.fixture(scope="module")
        def served():
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
            threading.Thread(target=server.serve_forever, name="never-shut-down", daemon=True).start()
            yield server  # no shutdown: its thread keeps the server, and the server its socket

        def test_uses_them(clean_session, kept_socket, served):
            pass
        """,
        "-rA",
        subprocess=True,  # the thread it cannot stop stays: not in this session
    )
    ran.result.assert_outcomes(passed=1, errors=1)
    ran.lines(
        "fixture 'kept_socket' (module scope), set up for test_inner.py::test_uses_them, left behind when its"
        " scope ended (cleaned up):",
        "  socket listening on 127.0.0.1:* is still open",
    )
    ran.lines("fixture 'served' (module scope), set up for test_inner.py::test_uses_them, left behind*")
    ran.lines("  daemon thread 'never-shut-down' * is still running*")
    ran.no_lines("*'clean_session'*")


def test_a_process_object_kept_outside_any_pool_is_killed(inner) -> None:
    ran = inner(
        """
        import multiprocessing
        import time

        class Holder:
            pass

        HOLDER = Holder()

        def test_keeps_a_process():
            HOLDER.process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(304,))
            HOLDER.process.start()

        def test_next():
            assert not HOLDER.process.is_alive()
        """,
        "-rA",
    )
    ran.result.assert_outcomes(passed=2, errors=1)
    ran.lines(
        "test_inner.py::test_keeps_a_process leaked (cleaned up before the next test):",
        "  process * (a fork of this process) is still running: *",
    )


def test_udp_and_unix_sockets_are_named_as_what_they_are(inner) -> None:
    ran = inner(
        """
        import socket

        KEEP = []

        def test_udp():
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            KEEP.append(s)

        def test_unix(tmp_path):
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(tmp_path / "server.sock"))
            s.listen()
            KEEP.append(s)

        def test_pair_is_no_server():
            KEEP.extend(socket.socketpair())
        """,
        "-rA",
    )
    ran.result.assert_outcomes(passed=3, errors=2)
    ran.lines("  UDP socket bound to 127.0.0.1:* is still open")
    ran.lines("  Unix socket listening on */server.sock is still open")


def test_a_fixture_fetched_inside_another_or_overridden_answers_for_itself(pytester) -> None:
    pytester.makeconftest(
        """
        import os
        import socket
        import pytest
        import torch.distributed as dist

        @pytest.fixture(scope="session")
        def server():
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            yield s
            s.close()

        @pytest.fixture(scope="session")
        def dist_env(tmp_path_factory):
            store = tmp_path_factory.mktemp("store") / "file"
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
            yield
            dist.destroy_process_group()
        """
    )
    pytester.makepyfile(
        test_one="""
        import pytest
        import torch.distributed as dist

        @pytest.fixture(scope="module")
        def server(server):  # overrides the session fixture of the same name
            return server

        @pytest.fixture(scope="module")
        def model(request):
            request.getfixturevalue("dist_env")
            return "model"

        def test_uses_them(server, model):
            dist.barrier()
        """,
        test_two="""
        import torch.distributed as dist

        def test_after_the_module(server, dist_env):
            assert server.fileno() != -1, "the session fixture's socket was closed"
            assert dist.is_initialized(), "the session's group was destroyed"
            dist.barrier()
        """,
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=2)


def test_a_store_a_module_fixture_returns_is_no_leftover_after_a_failed_test(inner) -> None:
    ran = inner(
        """
        import pytest
        from torch.distributed import TCPStore

        @pytest.fixture(scope="module")
        def store():
            return TCPStore("127.0.0.1", 0, 1, True)

        def test_fails(store):
            store.set("k", "v")
            assert store.get("k") == b"w"

        def test_last(store):
            pass
        """,
        "-rA",
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    ran.no_lines("*left behind*")
