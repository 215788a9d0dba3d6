"""A rank starts as a process torchrun starts would: its own torch seed, Python's Ctrl-C, the
signal handlers and thread count the project set, one thread per rank only where ranks share
a node, whatever the fork server the ranks come from had."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

GATHER = """
import os
import signal
import pytest
import torch
import torch.distributed as dist


def gathered(value):
    got = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(got, value)
    return got
"""


def test_unseeded_draws_differ_between_ranks_and_tests_and_a_seed_the_project_set_stays(inner, pytester) -> None:
    pytester.makeconftest("")
    ran = inner(
        GATHER
        + """
def sync_params(model):
    pass  # the bug: the broadcast was forgotten


@pytest.mark.multirank(world_size=2)
def test_sync_params_makes_ranks_agree(rank):
    model = torch.nn.Linear(4, 4)
    sync_params(model)
    w = model.weight.detach().clone()
    got = gathered(w)
    assert torch.equal(got[0], got[1]), "ranks disagree after sync_params"


@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("n", range(2))
def test_draws(rank, n):
    got = gathered(torch.rand(1))
    assert not torch.equal(got[0], got[1]), f"both ranks drew {got[0].item()}"
    with open(f"draw-{n}-{rank}.txt", "w") as f:  # in the session's folder, where ranks start
        f.write(repr(got[rank].item()))
""",
        subprocess=True,  # a session whose torch nobody seeded, as a user's is
    )
    ran.result.assert_outcomes(failed=1, passed=2)
    ran.lines("*rank 0: failed: AssertionError: ranks disagree after sync_params*")
    draws = [p.read_text() for p in pytester.path.glob("draw-*.txt")]
    assert len(draws) == 4 and len(set(draws)) == 4, draws


def test_a_seed_and_threads_set_as_the_conftest_is_imported_reach_every_rank(inner, pytester) -> None:
    pytester.makeconftest("import torch\ntorch.manual_seed(1234)\ntorch.set_num_threads(3)\n")
    ran = inner(
        GATHER
        + """
@pytest.mark.multirank(world_size=2)
def test_seeded(rank):
    assert torch.initial_seed() == 1234
    got = gathered(torch.rand(1))
    assert torch.equal(got[0], got[1]), "the project's seed was replaced"
    assert torch.get_num_threads() == 3
""",
        subprocess=True,  # the conftest would seed this process's torch too
    )
    ran.result.assert_outcomes(passed=1)


def test_ctrl_c_is_a_keyboard_interrupt_and_a_conftests_sigterm_handler_stays(inner, pytester) -> None:
    pytester.makeconftest(
        """
import signal

def graceful(signum, frame):
    raise SystemExit("terminated gracefully")

signal.signal(signal.SIGTERM, graceful)
"""
    )
    ran = inner(
        GATHER
        + """
def test_plain():
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.multirank(world_size=2)
def test_ranks(rank):
    assert signal.getsignal(signal.SIGTERM).__name__ == "graceful"
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(SystemExit, match="terminated gracefully"):
        os.kill(os.getpid(), signal.SIGTERM)
""",
        subprocess=True,  # the conftest's handler is not this session's
    )
    ran.result.assert_outcomes(passed=2)


def test_one_thread_per_rank_only_where_ranks_share_a_node_and_never_over_the_projects_choice(inner, pytester) -> None:
    pytester.makeconftest("")
    ran = inner(
        GATHER
        + """
def test_plain_threads():
    with open("threads-plain.txt", "w") as f:
        f.write(str(torch.get_num_threads()))


@pytest.mark.multirank(world_size=1)
def test_alone(rank):
    assert "OMP_NUM_THREADS" not in os.environ
    with open("threads-alone.txt", "w") as f:
        f.write(str(torch.get_num_threads()))


@pytest.mark.multirank(world_size=2)
def test_sharing_a_node(rank):
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert torch.get_num_threads() == 1


@pytest.mark.multirank(world_size=2, nodes=2)
def test_a_node_each(rank):
    assert "OMP_NUM_THREADS" not in os.environ
""",
        subprocess=True,  # torch's thread count as a fresh session has it
    )
    ran.result.assert_outcomes(passed=4)
    assert (pytester.path / "threads-alone.txt").read_text() == (pytester.path / "threads-plain.txt").read_text()


def test_a_seed_set_before_the_plugin_loaded_is_kept(inner, pytester, monkeypatch) -> None:
    # the plugin named in the conftest after torch was seeded there: torch's own import seed
    # is not known then, so the ranks keep what they inherit
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest(
        "import torch\ntorch.manual_seed(1234)\ntorch.set_num_threads(3)\npytest_plugins = ['pytest_ddphooks.plugin']\n"
    )
    ran = inner(
        GATHER
        + """
@pytest.mark.multirank(world_size=2)
def test_kept(rank):
    assert torch.initial_seed() == 1234
    assert torch.get_num_threads() == 3
""",
        subprocess=True,
    )
    ran.result.assert_outcomes(passed=1)


def test_multiprocessing_folders_a_rank_made_are_removed_as_it_leaves_and_the_pytest_processs_stay(
    inner, pytester, monkeypatch
) -> None:
    # sending a tensor to a child starts multiprocessing's resource sharer in a pymp-* folder,
    # which a process torchrun starts removes as it exits; the pytest process's own folder,
    # made before the ranks' fork server existed, is not theirs to remove
    temp = Path(tempfile.mkdtemp(prefix="ddp-"))  # short: a Unix socket's path is at most 107 bytes
    monkeypatch.setenv("TMPDIR", str(temp))
    pytester.makeconftest("import multiprocessing.util\nSESSION_TEMP = multiprocessing.util.get_temp_dir()\n")
    ran = inner(
        """
import multiprocessing as mp
import os
from multiprocessing import resource_sharer

import pytest
from conftest import SESSION_TEMP


@pytest.mark.multirank(world_size=2)
def test_rank_offers_a_file_to_a_child(rank):
    # what sending a tensor's memory to a child process does first
    resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))
    assert os.listdir(mp.util.get_temp_dir())  # the sharer's socket
    assert mp.util.get_temp_dir() != SESSION_TEMP  # a fresh process makes its own


def test_the_sessions_folder_is_still_there():
    assert os.path.isdir(SESSION_TEMP)
    with open(os.path.join(os.path.dirname(SESSION_TEMP), "session-temp.txt"), "w") as f:
        f.write(SESSION_TEMP)
""",
        subprocess=True,
    )
    try:
        ran.result.assert_outcomes(passed=2)
        session_temp = (temp / "session-temp.txt").read_text()
        assert not os.path.exists(session_temp)  # removed as the pytest process exited
        assert sorted(p.name for p in temp.glob("pymp-*")) == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_a_rank_that_leaves_a_pool_open_ends_without_waiting_on_it(inner) -> None:
    # running every multiprocessing finalizer as a rank left waited for ever on the pool's lock,
    # held by a worker the rank had killed: ranks piled up until the session's end
    ran = inner(
        """
        import multiprocessing as mp
        import os
        import time
        import psutil
        import pytest

        KEEP = []

        def square(x):
            return x * x

        @pytest.mark.multirank(world_size=2)
        @pytest.mark.parametrize("i", range(2))
        def test_pool_left_open(rank, i):
            pool = mp.get_context("fork").Pool(2)
            KEEP.append(pool)
            assert pool.map(square, [1, 2, 3]) == [1, 4, 9]

        def test_z_no_rank_lingers():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ranks = [p for c in psutil.Process().children() for p in c.children()]
                if not ranks:
                    return
                time.sleep(0.05)
            raise AssertionError(f"{len(ranks)} rank processes still alive")
        """,
        "--ddp-leaks=off",
    )
    ran.result.assert_outcomes(passed=3)
