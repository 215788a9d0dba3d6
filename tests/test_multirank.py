"""multirank runs the body on real, fresh rank processes joined in one gloo group."""

from __future__ import annotations

import os

import pytest

from pytest_ddphooks import session_dirs


def test_body_runs_once_per_rank_in_distinct_processes(inner) -> None:
    ran = inner(
        """
        import os
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=4)
        def test_ranks(rank, world_size):
            assert dist.is_initialized() and dist.get_backend() == "gloo"
            assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size) == (rank, 4)
            pids = [None] * world_size
            dist.all_gather_object(pids, os.getpid())
            assert len(set(pids)) == 4 and os.getpid() not in (os.getppid(),)
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            assert t.item() == 6.0
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_group_is_created_before_and_destroyed_after_the_body(inner) -> None:
    ran = inner(
        """
        import os
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_one(rank):
            assert dist.is_initialized()

        def test_plain_after():
            # the pytest process never held the ranks' group
            assert not dist.is_initialized()
        """
    )
    ran.result.assert_outcomes(passed=2)


def test_world_size_list_makes_one_item_per_size(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.parametrize("x", ["a", "b"])
        @pytest.mark.multirank(world_size=[1, 2, 3])
        def test_sizes(x, world_size, rank):
            assert dist.get_world_size() == world_size
        """,
        "-v",
    )
    ran.result.assert_outcomes(passed=6)
    ran.lines("*test_sizes[[]a-1[]] PASSED*", "*test_sizes[[]a-2[]] PASSED*", "*test_sizes[[]b-3[]] PASSED*")


def test_world_size_list_without_the_fixture_still_sets_the_size(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=[2, 4])
        def test_sizes():
            assert dist.get_world_size() in (2, 4)
        """,
        "-v",
    )
    ran.result.assert_outcomes(passed=2)
    ran.lines("*test_sizes[[]2[]] PASSED*", "*test_sizes[[]4[]] PASSED*")


def test_fixtures_and_parameters_reach_the_ranks(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.fixture(scope="module")
        def config():
            return {"lr": 0.1, "steps": [1, 2, 3]}

        @pytest.fixture
        def scaled(config):
            return config["lr"] * 10

        @pytest.mark.multirank(world_size=2)
        @pytest.mark.parametrize("n", [3, 5])
        def test_values(config, scaled, n, rank):
            assert config == {"lr": 0.1, "steps": [1, 2, 3]}
            assert scaled == 1.0
            assert n in (3, 5)
        """
    )
    ran.result.assert_outcomes(passed=2)


def test_fixture_that_depends_on_rank_is_evaluated_in_each_rank(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        events = []

        @pytest.fixture
        def seed(rank):
            events.append("setup")
            yield 100 + rank
            events.append("teardown")

        @pytest.fixture
        def doubled(seed, tmp_path):
            return seed * 2

        @pytest.mark.multirank(world_size=2)
        def test_per_rank(seed, doubled, rank):
            assert seed == 100 + rank
            assert doubled == 2 * (100 + rank)
            assert events == ["setup"]
            seeds = [None, None]
            dist.all_gather_object(seeds, seed)
            assert seeds == [100, 101]

        def test_pytest_process_never_ran_it():
            assert events == []
        """
    )
    ran.result.assert_outcomes(passed=2)


def test_monkeypatch_in_a_rank_applies_there(inner) -> None:
    ran = inner(
        """
        import os
        import pytest

        @pytest.fixture
        def env(monkeypatch, rank):
            monkeypatch.setenv("MY_RANK_VALUE", str(rank))

        @pytest.mark.multirank(world_size=2)
        def test_env(env, rank):
            assert os.environ["MY_RANK_VALUE"] == str(rank)
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_environment_of_the_pytest_process_reaches_the_ranks(inner) -> None:
    ran = inner(
        """
        import os
        import pytest

        @pytest.fixture
        def flag(monkeypatch):
            # set in the pytest process, during setup
            monkeypatch.setenv("FROM_PYTEST", "yes")

        @pytest.mark.multirank(world_size=2)
        def test_env(flag):
            assert os.environ["FROM_PYTEST"] == "yes"
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_unsendable_fixture_fails_naming_it(inner) -> None:
    ran = inner(
        """
        import threading
        import pytest

        @pytest.fixture
        def lock():
            return threading.Lock()

        @pytest.mark.multirank(world_size=2)
        def test_lock(lock):
            pass

        @pytest.mark.parametrize("fn", [lambda x: x])
        @pytest.mark.multirank(world_size=2)
        def test_lambda(rank, fn):
            pass
        """
    )
    ran.result.assert_outcomes(failed=2)
    ran.lines("*fixture 'lock' cannot be sent to the ranks: TypeError: cannot pickle '_thread.lock' object*")
    ran.lines("*parametrize argument 'fn' cannot be sent to the ranks: PicklingError: *")


def test_a_fixture_that_cannot_be_rebuilt_in_a_rank_shows_where_without_the_harness(inner) -> None:
    ran = inner(
        """
        import pytest

        def _rebuild():
            raise RuntimeError("cannot rebuild me")

        class Unloadable:
            def __reduce__(self):
                return (_rebuild, ())

        @pytest.fixture
        def unloadable():
            return Unloadable()

        @pytest.mark.multirank(world_size=2)
        def test_uses_it(unloadable):
            pass
        """
    )
    ran.result.assert_outcomes(errors=1)
    ran.lines(
        "*rank 0: failed in fixture setup: RuntimeError: fixture 'unloadable' could not be rebuilt in the rank:"
        " RuntimeError: cannot rebuild me"
    )
    ran.lines('>       raise RuntimeError("cannot rebuild me")', "E       RuntimeError: cannot rebuild me")
    assert "rankbody.py" not in ran.text and "payload = ItemPayload" not in ran.text


def test_tmp_path_is_one_folder_for_all_ranks(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=3)
        def test_shared(rank, tmp_path, shared_tmp_path):
            assert shared_tmp_path == tmp_path
            (tmp_path / f"r{rank}").write_text(str(rank))
            dist.barrier()
            assert sorted(p.name for p in tmp_path.iterdir()) == ["r0", "r1", "r2"]
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_simulated_nodes_get_torchrun_variables_and_a_folder_each(inner) -> None:
    ran = inner(
        """
        import os
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=4, nodes=2)
        def test_nodes(rank, node_tmp_path, tmp_path):
            env = os.environ
            assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4"
            assert env["LOCAL_RANK"] == str([0, 1, 0, 1][rank])
            assert env["NODE_RANK"] == env["GROUP_RANK"] == str([0, 0, 1, 1][rank])
            assert env["LOCAL_WORLD_SIZE"] == "2"
            assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
            assert node_tmp_path != tmp_path
            (node_tmp_path / f"r{rank}").touch()
            dist.barrier()
            mine = sorted(p.name for p in node_tmp_path.iterdir())
            assert mine == (["r0", "r1"] if rank < 2 else ["r2", "r3"])
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_external_launcher_mode_has_the_environment_but_no_group(inner) -> None:
    ran = inner(
        """
        import os
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, init_process_group=False)
        def test_self_init(rank, world_size):
            assert not dist.is_initialized()
            names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
            for name in names:
                assert name in os.environ
            dist.init_process_group("gloo")  # env:// as a trainer under torchrun does
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
            dist.destroy_process_group()
        """
    )
    ran.result.assert_outcomes(passed=1)


@pytest.mark.parametrize("init", [True, False])
def test_nothing_listens_beyond_loopback(inner, init: bool) -> None:
    ran = inner(
        f"""
        import psutil
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=3, init_process_group={init})
        def test_listeners(rank):
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            dist.all_reduce(torch.ones(2))
            listening = [c.laddr for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"]
            assert listening, "gloo and the store listen somewhere"
            assert all(addr.ip == "127.0.0.1" for addr in listening), listening
            dist.barrier()
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_class_tests_and_instance_state(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        class TestTrainer:
            @pytest.fixture(autouse=True)
            def prepare(self):
                self.prepared = "yes"

            @pytest.mark.multirank(world_size=2)
            def test_method(self, rank):
                assert self.prepared == "yes"
                assert dist.get_world_size() == 2
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_nccl_is_skipped_without_enough_gpus(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2, backend="nccl")
        def test_gpu(rank):
            raise AssertionError("must not run")

        @pytest.mark.multirank(world_size=1, backend="nccl")
        def test_one_gpu(rank):
            raise AssertionError("must not run")

        @pytest.mark.special
        @pytest.mark.multirank(world_size=2, backend="nccl")
        def test_special_gpu(rank):
            raise AssertionError("must not run")
        """,
        "-rs",
    )
    ran.result.assert_outcomes(skipped=3)
    ran.lines("SKIPPED [1] test_inner.py:3: multirank(backend='nccl') needs 2 GPUs, 0 visible")
    ran.lines("SKIPPED [1] test_inner.py:7: multirank(backend='nccl') needs 1 GPU, 0 visible")
    # a special test skips the same, here: no interpreter is started only to skip
    ran.lines("SKIPPED [1] test_inner.py:11: multirank(backend='nccl') needs 2 GPUs, 0 visible")


def test_world_size_one_is_a_real_single_rank_group(inner) -> None:
    ran = inner(
        """
        import os
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=1)
        def test_single(rank):
            assert rank == 0 and dist.get_world_size() == 1
            dist.barrier()
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_plain_tests_are_untouched(inner) -> None:
    ran = inner(
        """
        import os

        def test_plain(rank, world_size):
            assert (rank, world_size) == (0, 1)
            assert "RANK" not in os.environ
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_preloaded_modules_are_in_the_ranks_already(inner, pytester) -> None:
    pytester.makeini("[pytest]\nddp_preload =\n    json.tool\n")
    ran = inner(
        """
        import sys
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_there(rank):
            assert "json.tool" in sys.modules
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_a_preload_that_cannot_be_imported_is_a_usage_error(pytester) -> None:
    pytester.makeini("[pytest]\nddp_preload =\n    no_such_module_anywhere\n")
    pytester.makepyfile(
        test_x="""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_x(rank):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini ddp_preload: cannot import 'no_such_module_anywhere': ModuleNotFoundError*"])


RUN_FILES_IN_MEMORY = """
import os
import pytest


@pytest.mark.multirank(world_size=2)
def test_where(rank):
    fds = os.listdir("/proc/self/fd")
    paths = set()
    for fd in fds:
        try:
            paths.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    events = [p for p in paths if p.endswith(f"rank{rank}.events")]
    assert events, paths
    print("RUN-FILE", events[0])
    assert events[0].startswith("/dev/shm/ddphooks-")
"""


@pytest.mark.skipif(not session_dirs.memory_parent(), reason="no memory filesystem with room here (or TMPDIR is set)")
def test_a_run_s_files_are_in_memory_and_gone_after_the_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_where=RUN_FILES_IN_MEMORY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
    shown = [line.split("RUN-FILE ", 1)[1] for line in result.outlines if "RUN-FILE " in line]
    assert shown, result.outlines
    session_folder = shown[0].split("/run-")[0]
    assert not os.path.exists(session_folder), "the session's runs folder is removed at its end"
