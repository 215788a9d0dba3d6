"""What live objects own is theirs: a fixture's pool, client or server keeps what it starts
while its scope lasts, a pool or data loader a test kept is reported but never broken, a
fixture's next parameter is the fixture's, a sub-group left behind goes alone, and of several
session fixtures the one that set a variable is the one named."""

from __future__ import annotations

import pytest


def test_what_a_wider_fixtures_object_starts_at_its_first_use_is_the_fixtures(pytester) -> None:
    pytester.makepyfile(
        test_owned="""
        import concurrent.futures as cf
        import http.server
        import socket
        import threading
        import urllib.request
        import pytest

        @pytest.fixture(scope="module")
        def pool():
            with cf.ProcessPoolExecutor(2) as ex:
                yield ex

        @pytest.fixture(scope="module")
        def threads():
            with cf.ThreadPoolExecutor(2) as ex:
                yield ex

        @pytest.fixture(scope="module", params=["a", "b"])
        def listener(request):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            yield s
            s.close()

        @pytest.fixture(scope="session")
        def server():
            class Handler(http.server.BaseHTTPRequestHandler):
                protocol_version = "HTTP/1.1"  # keeps the connection, in a thread of its own
                def do_GET(self):
                    self.send_response(200)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                def log_message(self, *args):
                    pass
            srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            srv.daemon_threads = True
            t = threading.Thread(target=srv.serve_forever, daemon=True)
            t.start()
            yield srv
            if hasattr(srv, "kept"):
                srv.kept.close()
            srv.shutdown()
            srv.server_close()
            t.join()

        def test_pool_once(pool):
            assert pool.submit(pow, 2, 3).result() == 8

        def test_pool_twice(pool):
            assert pool.submit(pow, 2, 4).result() == 16

        def test_threads(threads):
            assert threads.submit(pow, 2, 5).result() == 32

        def test_listener(listener):
            socket.create_connection(listener.getsockname()).close()

        def test_server_later(request):
            srv = request.getfixturevalue("server")
            connection = socket.create_connection(srv.server_address)
            connection.sendall(b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
            reply = b""
            while not reply.endswith(b"ok"):
                reply += connection.recv(1000)
            srv.kept = connection  # kept alive by the session's server, as a client pool keeps one
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=6)
    result.stdout.no_fnmatch_line("*leaked*")


def test_a_pool_or_loader_a_test_keeps_is_reported_and_never_broken(pytester) -> None:
    pytester.makepyfile(
        test_kept="""
        import multiprocessing as mp
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        KEPT = []

        def square(x):
            return x * x

        def test_keeps_a_pool():
            pool = mp.get_context("fork").Pool(2)
            KEPT.append(pool)
            assert pool.map(square, range(4)) == [0, 1, 4, 9]

        def test_keeps_a_loader():
            loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, num_workers=2, persistent_workers=True)
            assert sum(1 for _ in loader) == 2
            KEPT.append(loader)

        def test_both_still_work():
            assert KEPT[0].map(square, range(3)) == [0, 1, 4]
            assert sum(1 for _ in KEPT[1]) == 2
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", timeout=120)
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*test_keeps_a_pool leaked what could not be cleaned up safely (left as it is):",
            "*process * is still running: *: a Pool object still holds it: left running,"
            " as killing it would break that object",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*process * is still running: *: a _MultiProcessingDataLoaderIter object still holds it: left running*"]
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")


def test_a_sub_group_left_behind_goes_alone(pytester) -> None:
    pytester.makepyfile(
        test_subgroup="""
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.fixture(scope="session")
        def group(tmp_path_factory):
            store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            yield
            dist.destroy_process_group()

        def test_leaves_a_sub_group(group):
            dist.all_reduce(torch.ones(2), group=dist.new_group([0]))

        def test_the_sessions_group_still_works(group):
            t = torch.ones(2)
            dist.all_reduce(t)
            assert t.tolist() == [1.0, 1.0]
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_leaves_a_sub_group leaked (cleaned up before the next test):"])


def test_the_session_fixture_that_set_a_variable_is_the_one_named(pytester) -> None:
    pytester.makeconftest(
        """
        import os
        import pytest

        @pytest.fixture(scope="session", autouse=True)
        def dist_env():
            os.environ["MASTER_ADDR"] = "127.0.0.1"

        @pytest.fixture(scope="session")
        def data_dir(tmp_path_factory):
            return tmp_path_factory.mktemp("data")
        """
    )
    pytester.makepyfile(test_env="def test_a(data_dir): pass\ndef test_b(): pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.stdout.fnmatch_lines(
        [
            "fixture 'dist_env' (session scope), set up for test_env.py::test_a, left behind when its scope"
            " ended (cleaned up):",
            "  environment variable MASTER_ADDR='127.0.0.1' was set",
        ]
    )
    result.stdout.no_fnmatch_line("*'data_dir'*")


@pytest.mark.parametrize("leave", [True, False])
def test_a_pool_a_test_leaves_is_still_reported_when_it_owns_it(pytester, leave: bool) -> None:
    # the fire case beside the silent ones above: a pool of the test's own, never shut down
    pytester.makepyfile(
        test_own=f"""
        import concurrent.futures as cf

        KEPT = []

        def test_own_pool():
            ex = cf.ThreadPoolExecutor(1)
            assert ex.submit(pow, 2, 2).result() == 4
            KEPT.append(ex)
            if not {leave}:
                ex.shutdown()
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    if leave:
        result.assert_outcomes(passed=1, errors=1)
        result.stdout.fnmatch_lines(["*test_own_pool leaked*", "*ThreadPoolExecutor-*is still running*"])
    else:
        result.assert_outcomes(passed=1)


def test_the_signals_torchs_launcher_forwards_are_its_setting_not_a_ranks_identity(pytester, monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)  # gone again after the inner run
    pytester.makepyfile(
        test_env="""
        import os

        def test_elastic_launch_sets_its_signals():
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT"  # as elastic_launch() does

        def test_an_identity_left_behind():
            os.environ["TORCHELASTIC_RUN_ID"] = "left"
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_an_identity_left_behind leaked*", "*TORCHELASTIC_RUN_ID='left' was set"])
    result.stdout.no_fnmatch_line("*TORCHELASTIC_SIGNALS_TO_HANDLE*")


def test_joblibs_reusable_pool_is_a_process_wide_singleton_left_to_the_library(pytester) -> None:
    pytester.makepyfile(
        test_loky="""
        import atexit
        import subprocess
        import sys
        import types

        def test_parallel_keeps_its_workers():
            # what joblib's loky keeps between Parallel calls: one executor per process, its workers
            worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            atexit.register(worker.kill)  # as the library ends them, when the interpreter ends
            executor = types.SimpleNamespace(_processes={worker.pid: worker})
            module = types.ModuleType("joblib.externals.loky.reusable_executor")
            module._executor = executor
            sys.modules[module.__name__] = module

        def test_after():
            module = sys.modules["joblib.externals.loky.reusable_executor"]
            assert all(p.poll() is None for p in module._executor._processes.values()), "killed"
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*leaked*")


def test_a_wider_fixtures_group_or_store_goes_with_its_value_when_its_scope_ends(pytester) -> None:
    pytester.makepyfile(
        test_scoped="""
        import socket
        from datetime import timedelta

        import pytest
        import torch
        import torch.distributed as dist

        def free_port():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]

        @pytest.fixture(scope="module")
        def pg():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            yield dist.group.WORLD
            dist.destroy_process_group()

        @pytest.fixture(scope="module")
        def store():
            yield dist.TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=10))

        def test_allreduce(pg):
            t = torch.ones(2)
            dist.all_reduce(t, group=pg)
            assert t.tolist() == [1.0, 1.0]

        def test_store_last(store, pg):  # the scopes end in this test's teardown
            store.set("k", "v")
            assert store.get("k") == b"v"
        """,
        test_then="""
        import torch.distributed as dist

        KEPT = []

        def test_keeps_a_group_of_its_own():
            KEPT.append(dist.TCPStore("127.0.0.1", 0, 1, True))  # a real leak: still reported
        """,
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_keeps_a_group_of_its_own*"])
    result.stdout.no_fnmatch_line("*fixture 'pg'*")
    result.stdout.no_fnmatch_line("*fixture 'store'*")


def test_library_threads_and_workers_started_once_per_process_are_no_leaks(pytester, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_WORKER_START", "fork")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")
    pytester.makepyfile(
        test_once="""
        import multiprocessing as mp

        import torch
        from torch._inductor.async_compile import AsyncCompile

        def total(q_in, q_out):
            q_out.put(float(q_in.get().sum()))

        def test_sends_a_tensor_to_a_child():
            # the first tensor sent starts multiprocessing's resource sharer thread, kept for ever
            ctx = mp.get_context("fork")
            q_in, q_out = ctx.Queue(), ctx.Queue()
            child = ctx.Process(target=total, args=(q_in, q_out))
            child.start()
            q_in.put(torch.ones(3))
            assert q_out.get(timeout=60) == 3.0
            child.join(30)

        def test_warms_inductors_compile_pool():
            AsyncCompile.warm_pool()
            AsyncCompile.wait_pool_ready()
            assert AsyncCompile.process_pool()._processes

        def test_next():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=3)
    result.stdout.no_fnmatch_line("*leaked*")


SCOPE_TEARDOWNS = """
import os
import subprocess
import threading
import pytest

KEPT = []

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # undoes in its teardown all it did in its setup: no leak
    old = os.environ.get("MASTER_ADDR")
    os.environ["MASTER_ADDR"] = "10.0.0.1"
    os.environ["WORLD_SIZE"] = "4"
    proc = subprocess.Popen(["sleep", "300"])
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="server-loop")
    thread.start()
    yield
    stop.set()
    thread.join()
    proc.kill()
    proc.wait()
    del os.environ["WORLD_SIZE"]
    if old is None:
        del os.environ["MASTER_ADDR"]
    else:
        os.environ["MASTER_ADDR"] = old
    if LEAVE:
        # and then starts what outlives it
        os.environ["MASTER_PORT"] = "29777"
        proc = subprocess.Popen(["sleep", "300"])
        KEPT.append(proc)
        tmp_path_factory.getbasetemp().joinpath("pid").write_text(str(proc.pid))

class TestRanks:
    @pytest.fixture(scope="class")
    @classmethod
    def rank_env(cls):
        yield
        if LEAVE:
            os.environ["RANK"] = "9"

    def test_in_class(self, rank_env, server):
        assert os.environ["WORLD_SIZE"] == "4"

def test_last_of_the_module(server):
    pass
"""

NEXT_MODULE = """
import os
import psutil

def test_next_module(tmp_path_factory):
    for name in ("MASTER_PORT", "RANK", "WORLD_SIZE"):
        assert name not in os.environ, name
    pid = tmp_path_factory.getbasetemp().joinpath("pid")
    if pid.exists():  # killed (its Popen, kept, has not reaped it)
        try:
            assert psutil.Process(int(pid.read_text())).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
"""


@pytest.mark.parametrize("leave", [True, False])
def test_what_a_wider_fixtures_teardown_leaves_is_named_and_cleaned_up(pytester, leave: bool) -> None:
    pytester.makepyfile(test_a_scoped=f"LEAVE = {leave}\n" + SCOPE_TEARDOWNS, test_b_next=NEXT_MODULE)
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", "-rE")
    if not leave:
        result.assert_outcomes(passed=3)
        result.stdout.no_fnmatch_line("*left behind*")
        return
    # the next module's test finds nothing left, and the process killed
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of TestRanks.test_in_class*",
            "fixture 'rank_env' (class scope), torn down after test_a_scoped.py::TestRanks::test_in_class, left"
            " behind in its teardown (cleaned up):",
            "  environment variable RANK='9' was set",
            "*ERROR at teardown of test_last_of_the_module*",
            "fixture 'server' (module scope), torn down after test_a_scoped.py::test_last_of_the_module, left"
            " behind in its teardown (cleaned up):",
            "  process * is still running: sleep 300",
            "  environment variable MASTER_PORT='29777' was set",
        ]
    )
    result.stdout.no_fnmatch_line("*MASTER_ADDR*")
    result.stdout.no_fnmatch_line("*WORLD_SIZE*")


def test_a_teardown_that_puts_back_what_another_scopes_fixture_set_leaves_nothing(pytester) -> None:
    # the session fixture's value is what the module fixture's teardown must leave, not the
    # state before the test that set both up (that once reported it, and deleted it)
    pytester.makeconftest(
        """
        import os
        import pytest

        @pytest.fixture(scope="session", autouse=True)
        def dist_defaults():
            os.environ["MASTER_PORT"] = "29500"
            yield
            os.environ.pop("MASTER_PORT", None)

        @pytest.fixture(scope="module")
        def free_port():
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("MASTER_PORT", "29777")
                yield 29777
        """
    )
    pytester.makepyfile(
        test_1="import os\ndef test_uses_port(free_port):\n    assert os.environ['MASTER_PORT'] == '29777'\n",
        test_2="import os\ndef test_default():\n    assert os.environ['MASTER_PORT'] == '29500'\n",
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
