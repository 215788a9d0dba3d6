"""The leak guard in a real suite: it never corrupts what live code owns, never blames a test
for what only its failure kept alive, and leaves process-wide singletons of libraries alone."""

from __future__ import annotations

import pytest

GLOO_PAIR = """
import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

KEEP = []


def gloo_pair(tmp_path):
    # two ranks of one gloo group in one process: real sockets that only gloo owns
    store = dist.FileStore(str(tmp_path / "store"), 2)
    groups = [None, None]

    def make(r):
        groups[r] = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=30))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def use(groups):
    works = [g.allreduce([torch.ones(2)]) for g in groups]
    for w in works:
        w.wait()
"""


def test_groups_held_by_a_failing_tests_frame_are_no_leak(pytester) -> None:
    pytester.makepyfile(
        test_frame=GLOO_PAIR
        + """
def test_fails_holding_groups(tmp_path):
    groups = gloo_pair(tmp_path)
    use(groups)
    assert groups is None

def test_next_one_fails_too():
    assert 1 == 2

def test_after():
    pass
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2, passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.no_fnmatch_line("*leaked*")
    result.stderr.no_fnmatch_line("*terminate called*")


def test_groups_kept_in_a_module_global_are_reported_and_left_intact(pytester) -> None:
    pytester.makepyfile(
        test_global=GLOO_PAIR
        + """
def test_keeps_groups(tmp_path):
    KEEP.extend(gloo_pair(tmp_path))

def test_groups_still_work():
    use(KEEP)  # the guard did not pull their sockets from under them

def test_then_fails():
    assert False

def test_after():
    KEEP.clear()
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1, errors=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, "the session ended normally, not by a signal"
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_keeps_groups*",
            "test_global.py::test_keeps_groups leaked what could not be cleaned up safely (left as it is):",
            "  socket listening on 127.0.0.1:* is still open: native code owns it (still referenced:"
            " 2 ProcessGroupGloo objects; held in test_global.KEEP): left open, as closing it from outside would"
            " crash that code",
        ]
    )
    result.stdout.no_fnmatch_line("*cleaned up before the next test*")
    result.stderr.no_fnmatch_line("*terminate called*")


def test_listening_socket_held_by_a_failing_test_is_no_leak(pytester) -> None:
    pytester.makepyfile(
        test_sock="""
        import socket

        def test_fails_while_listening():
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen()
            assert server.getsockname() is None

        def test_after():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.no_fnmatch_line("*leaked*")


def test_rerunfailures_stored_exception_is_no_leak(pytester) -> None:
    pytest.importorskip("pytest_rerunfailures")
    pytester.makepyfile(
        test_rerun="""
        import socket

        def test_flaky_while_listening():
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen()
            assert server.getsockname() is None
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--reruns", "1")
    assert result.parseoutcomes() == {"failed": 1, "rerun": 1}
    result.stdout.no_fnmatch_line("*leaked*")


def test_a_rerun_leaves_a_session_fixtures_group_alone(pytester) -> None:
    """pytest-rerunfailures takes the session's scope off pytest's stack while it reruns a
    failed test: the leak guard once took that for the scope's end, destroyed a session
    fixture's process group and failed the next test that used it."""
    pytest.importorskip("pytest_rerunfailures")
    pytester.makeconftest(
        """
        import pytest
        import torch.distributed as dist

        @pytest.fixture(scope="session")
        def session_group(tmp_path_factory):
            store = tmp_path_factory.mktemp("store") / "file"
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
            yield dist.group.WORLD
            dist.destroy_process_group()
        """
    )
    pytester.makepyfile(
        test_rerun="""
        import torch
        import torch.distributed as dist

        def test_a(session_group):
            dist.barrier()

        def test_flaky_unrelated():
            assert False

        def test_b(session_group):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 1
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--reruns", "1")
    assert result.parseoutcomes() == {"failed": 1, "passed": 2, "rerun": 1}
    result.stdout.no_fnmatch_line("*left behind*")


KEPT = {
    # a socket the module keeps is closed through its object, which then knows it is closed
    "socket": (
        """
        import socket

        KEEP = []

        def test_keeps_it():
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen()
            KEEP.append(server)

        def test_its_owner_sees_what_was_done():
            assert KEEP[0].fileno() == -1
        """,
        "  socket listening on 127.0.0.1:* is still open",
    ),
    # a process is killed and left for its owner to reap: its Popen sees how it ended
    "process": (
        """
        import signal
        import subprocess

        KEEP = []

        def test_keeps_it():
            KEEP.append(subprocess.Popen(["sleep", "300"]))

        def test_its_owner_sees_what_was_done():
            assert KEEP[0].wait(timeout=10) == -signal.SIGKILL
        """,
        "  process * is still running: sleep 300",
    ),
}


@pytest.mark.parametrize("kind", sorted(KEPT))
def test_what_a_module_keeps_is_cleaned_through_its_owner(inner, kind: str) -> None:
    source, line = KEPT[kind]
    ran = inner(source, name="test_kept")
    ran.result.assert_outcomes(passed=2, errors=1)
    ran.lines("test_kept.py::test_keeps_it leaked (cleaned up before the next test):", line)


def test_a_thread_that_ends_right_after_the_test_is_no_leak(pytester) -> None:
    pytester.makepyfile(
        test_winding="""
        import threading

        STOP = threading.Event()

        def test_lets_a_worker_wind_down():
            t = threading.Thread(target=STOP.wait, args=(0.2,), name="winding-down")
            t.start()

        def test_after():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*leaked*")


SINGLETONS = """
import threading
import pytest

STOP = threading.Event()


def test_fsspec_io_loop():
    import fsspec.asyn

    fsspec.asyn.get_loop()  # starts fsspec's one IO thread of the process
    assert any(t.name == "fsspecIO" for t in threading.enumerate())


def test_a_thread_only_named_like_it():
    threading.Thread(target=STOP.wait, name="fsspecIO-impostor", daemon=True).start()


def test_inductor_compile_pool():
    import torch._inductor.config as config
    from torch._inductor.async_compile import AsyncCompile

    config.compile_threads = 2
    assert AsyncCompile.pool().submit(lambda: 42).result() == 42


def test_a_pool_of_the_tests_own():
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    pool.submit(STOP.wait).done()
    POOLS.append(pool)


POOLS = []


def test_after():
    STOP.set()
    for pool in POOLS:
        pool.shutdown()
"""


def test_library_singletons_are_not_leaks_and_look_alikes_are(pytester) -> None:
    pytester.makepyfile(test_single=SINGLETONS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rE")
    result.assert_outcomes(passed=5, errors=2)
    result.stdout.fnmatch_lines_random(
        [
            "ERROR test_single.py::test_a_thread_only_named_like_it*",
            "ERROR test_single.py::test_a_pool_of_the_tests_own*",
            "  daemon thread 'fsspecIO-impostor' (target threading.Event.wait) is still running:*",
            "  *thread 'ThreadPoolExecutor-*' (target concurrent.futures.thread._worker) is still running:*",
        ]
    )
    result.stdout.no_fnmatch_line("*test_fsspec_io_loop leaked*")
    result.stdout.no_fnmatch_line("*test_inductor_compile_pool leaked*")


def test_tqdm_monitor_is_not_a_leak(pytester) -> None:
    pytest.importorskip("tqdm")
    pytester.makepyfile(
        test_bar="""
        import time
        from tqdm import tqdm

        def test_progress_bar():
            tqdm.monitor_interval = 1
            for _ in tqdm(range(3)):
                time.sleep(0.01)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*leaked*")


def test_finding_a_socket_s_owner_warns_nothing_even_under_w_error(pytester) -> None:
    pytester.makepyfile(
        test_store="""
import torch.distributed as dist

KEEP = []
BY_NAME = {}  # a dict of such objects alone: the garbage collector does not even track it

def test_keeps_a_store():
    KEEP.append(dist.TCPStore("127.0.0.1", 0, 1, True))

def test_keeps_one_by_name():
    BY_NAME["store"] = dist.TCPStore("127.0.0.1", 0, 1, True)
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error")
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines(
        ["*native code owns it (still referenced: 2 TCPStore objects; held in test_store.KEEP, test_store.BY_NAME)*"]
    )
    result.stdout.fnmatch_lines(["*owns it (still referenced: 1 TCPStore object; held in test_store.KEEP)*"])
    result.stdout.no_fnmatch_line("*FutureWarning*")
