"""Ranks prepared before their test: the next multirank test's ranks are forked, rendezvoused
and connected while a test runs, and handed the test when it comes. A test must never see the
difference: fresh processes, its own group, its own environment, its own folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_ddphooks.plugin.multirank import PREPARED_KEY


class _Prepared:
    """An inner-session plugin: which tests ran on ranks prepared ahead of them."""

    def __init__(self) -> None:
        self.by_test: dict[str, bool] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        if PREPARED_KEY in item.stash:
            self.by_test[item.name] = item.stash[PREPARED_KEY]


def _run(pytester: pytest.Pytester, source: str, *args: str) -> tuple[pytest.RunResult, dict[str, bool]]:
    pytester.makepyfile(test_prepared=source)
    seen = _Prepared()
    result = pytester.runpytest("-p", "no:cacheprovider", *args, plugins=[seen])
    return result, seen.by_test


# Each rank writes what a test can see of its process, group and environment.
_FACTS = """
import json, os
from pathlib import Path
import pytest
import torch
import torch.distributed as dist

BODIES_RUN = 0  # a rank forked from a clean state has run no body before


def facts(rank, out):
    global BODIES_RUN
    BODIES_RUN += 1
    t = torch.ones(1)
    dist.all_reduce(t)
    env = dict(os.environ)
    seen = {
        "bodies_run": BODIES_RUN,
        "world": dist.get_world_size(),
        "sum": t.item(),
        "initialized": dist.is_initialized(),
        "run_id": env.pop("TORCHELASTIC_RUN_ID"),
        "port": env.pop("MASTER_PORT"),
        "current_test": env.pop("PYTEST_CURRENT_TEST"),
        "env": env,
        "cwd": os.getcwd(),
        "pid": os.getpid(),
    }
    Path(out, f"{os.environ['PYTEST_CURRENT_TEST'].split('::')[1].split()[0]}-{rank}.json").write_text(json.dumps(seen))
"""


def _facts(folder: Path) -> dict[str, dict[str, object]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def test_prepared_ranks_see_what_fresh_ranks_see(pytester: pytest.Pytester) -> None:
    folders = {}
    flags = {}
    for mode in ("on", "off"):
        out = pytester.path / f"facts-{mode}"
        out.mkdir()
        source = _FACTS + "".join(
            f"""
@pytest.mark.multirank(world_size=2)
def test_{i}(rank):
    facts(rank, {str(out)!r})
"""
            for i in range(4)
        )
        result, flags[mode] = _run(pytester, source, f"--ddp-prepare={mode}")
        result.assert_outcomes(passed=4)
        folders[mode] = _facts(out)
    # the first test's ranks could not be prepared; every later one's were
    assert flags["on"] == {"test_0": False, "test_1": True, "test_2": True, "test_3": True}
    assert flags["off"] == dict.fromkeys(flags["on"], False)
    on, off = folders["on"], folders["off"]
    assert on.keys() == off.keys() and len(on) == 8
    for key, seen in on.items():
        fresh = off[key]
        test = key.rsplit("-", 1)[0]
        assert seen["bodies_run"] == fresh["bodies_run"] == 1
        assert seen["world"] == 2 and seen["sum"] == 2.0 and seen["initialized"]
        assert seen["current_test"] == fresh["current_test"]
        assert seen["current_test"].startswith(f"test_prepared.py::{test} ")
        assert seen["env"] == fresh["env"], f"{key}: the environment differs from a fresh rank's"
        assert seen["cwd"] == fresh["cwd"]
    # every test its own processes, run id and port (its own group)
    for name in ("pid", "run_id", "port"):
        assert len({v[name] for v in on.values()}) == (8 if name == "pid" else 4), name


def test_a_test_whose_environment_changed_gets_ranks_set_up_for_it(pytester: pytest.Pytester) -> None:
    # the pytest process's environment changes for one test (as a plugin's hook may do it)
    pytester.makeconftest(
        """
        import os
        import pytest

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_setup(item):
            if item.name == "test_changed":
                os.environ["DDPHOOKS_TEST_SETTING"] = "set-by-a-hook"

        def pytest_runtest_teardown(item):
            os.environ.pop("DDPHOOKS_TEST_SETTING", None)
        """
    )
    result, flags = _run(
        pytester,
        """
        import os
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_first(rank):
            assert "DDPHOOKS_TEST_SETTING" not in os.environ

        @pytest.mark.multirank(world_size=2)
        def test_changed(rank):
            assert os.environ["DDPHOOKS_TEST_SETTING"] == "set-by-a-hook"

        @pytest.mark.multirank(world_size=2)
        def test_after(rank):
            assert "DDPHOOKS_TEST_SETTING" not in os.environ
        """,
    )
    result.assert_outcomes(passed=3)
    # the ranks prepared before the fixture changed the environment were not used
    assert flags == {"test_first": False, "test_changed": False, "test_after": False}


def test_sizes_and_kinds_of_runs_are_prepared_for_the_test_that_comes(pytester: pytest.Pytester) -> None:
    result, flags = _run(
        pytester,
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_two(rank):
            assert dist.get_world_size() == 2

        @pytest.mark.multirank(world_size=3)
        def test_three(rank):
            assert dist.get_world_size() == 3

        def test_plain():
            pass

        @pytest.mark.multirank(world_size=2, init_process_group=False)
        def test_own_group(rank):
            assert not dist.is_initialized()
            dist.init_process_group("gloo")
            dist.barrier()
            dist.destroy_process_group()

        @pytest.mark.multirank(world_size=2)
        def test_last(rank):
            dist.barrier()
        """,
    )
    result.assert_outcomes(passed=5)
    # a test that creates its group itself gets fresh ranks, as always; the one after it
    # was prepared while it ran
    assert flags == {
        "test_two": False,
        "test_three": True,
        "test_own_group": False,
        "test_last": True,
    }


def test_prepared_ranks_that_died_before_their_test_are_replaced(pytester: pytest.Pytester) -> None:
    result, flags = _run(
        pytester,
        """
        import os
        import signal
        import time
        import pytest
        import torch.distributed as dist
        from pytest_ddphooks.launch import procs

        @pytest.mark.multirank(world_size=2)
        def test_kills_the_next_ranks(rank):
            peers = [None, None]
            dist.all_gather_object(peers, os.getpid())
            if rank == 0:
                # the next test's ranks are forked once this test was handed its own: a moment
                # after this body may have begun, so they are waited for (both of them)
                deadline = time.monotonic() + 30
                prepared = []
                while len(prepared) < 2 and time.monotonic() < deadline:
                    prepared = [p for p in procs.children_of(os.getppid()) if p not in peers]
                    time.sleep(0.005)
                assert len(prepared) == 2, f"the next test's ranks were not being prepared: {prepared}"
                for pid in prepared:
                    os.kill(pid, signal.SIGKILL)
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_next(rank):
            dist.barrier()
        """,
    )
    result.assert_outcomes(passed=2)
    assert flags == {"test_kills_the_next_ranks": False, "test_next": False}


def test_idle_prepared_ranks_use_no_cpu(pytester: pytest.Pytester) -> None:
    result, _ = _run(
        pytester,
        """
        import os
        import time
        import pytest
        import torch.distributed as dist
        from pytest_ddphooks.launch import procs

        def cpu_ns_by_thread(pid):
            out = {}
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    out[(tid, name)] = int(f.read().split()[0])
            return out

        def waiting_for_their_test(pid):
            # blocked in read() on a pipe: the hand-over pipe (a socket would be the set-up)
            with open(f"/proc/{pid}/syscall") as f:
                call = f.read().split()
            if call[0] != "0":
                return False
            try:
                return os.readlink(f"/proc/{pid}/fd/{int(call[1], 16)}").startswith("pipe:")
            except OSError:
                return False

        @pytest.mark.multirank(world_size=2)
        def test_watches_the_next_ranks(rank):
            peers = [None, None]
            dist.all_gather_object(peers, os.getpid())
            if rank == 0:
                deadline = time.monotonic() + 30
                prepared = []
                while len(prepared) < 2 or not all(waiting_for_their_test(p) for p in prepared):
                    prepared = [p for p in procs.children_of(os.getppid()) if p not in peers]
                    assert time.monotonic() < deadline, "the prepared ranks never became ready"
                    time.sleep(0.01)
                before = {p: cpu_ns_by_thread(p) for p in prepared}
                time.sleep(1.0)  # watching them idle, not waiting for anything
                for p in prepared:
                    after = cpu_ns_by_thread(p)
                    for thread, used in after.items():
                        spent = used - before[p].get(thread, used)
                        if thread[1] == "gloo_tcp_loop":
                            # gloo's transport thread wakes every 10 ms in any connected group
                            assert spent < 10_000_000, f"{thread}: {spent} ns in 1 s"
                        else:
                            assert spent == 0, f"{thread} of prepared rank {p} ran {spent} ns"
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_next(rank):
            dist.barrier()
        """,
    )
    result.assert_outcomes(passed=2)


def test_prepare_is_an_option_with_an_ini_twin(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nddp_prepare = off\n")
    result, flags = _run(
        pytester,
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_a(rank):
            pass

        @pytest.mark.multirank(world_size=2)
        def test_b(rank):
            pass
        """,
    )
    result.assert_outcomes(passed=2)
    assert flags == {"test_a": False, "test_b": False}
    bad = pytester.runpytest("-p", "no:cacheprovider", "--ddp-prepare=sometimes")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--ddp-prepare*invalid choice*'sometimes'*"])
