"""--pdb opens the debugger on a failing rank's own traceback, on the terminal; breakpoint()
in a rank stops that rank and lends it the terminal. Run under a pseudo-terminal."""

from __future__ import annotations

import sys

import pytest
from ptyproc import PtyProcess

FAILS = """
import pytest
import torch.distributed as dist

@pytest.mark.multirank(world_size=2, timeout=60)
def test_fails(rank):
    value = rank * 10 + 1
    dist.barrier()
    assert value == 1

def test_after():
    pass
"""


def test_pdb_opens_on_the_failing_ranks_traceback_and_q_ends_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fails=FAILS)
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "test_fails.py"], str(pytester.path)
    )
    proc.expect("rank 1: post-mortem of its failure")
    proc.expect("(Pdb) ")
    proc.send("p value")
    proc.expect("11")
    proc.send("p rank")
    proc.expect("(Pdb) ")
    proc.send("q")
    assert proc.wait() == 1
    text = proc.text
    assert "rank 1 gave the terminal back" in text
    assert "1 failed, 1 passed" in text
    assert text.count("(Pdb)") >= 2 and "PDB post_mortem" not in text, "pytest's own debugger stayed away"


def test_ddp_pdb_rank_chooses_which_failing_rank_gets_the_debugger(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_both="""
        import pytest

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_both_fail(rank):
            mine = f"rank {rank} here"
            assert False
        """
    )
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "--ddp-pdb-rank=0", "test_both.py"]
    proc = PtyProcess(argv, str(pytester.path))
    proc.expect("rank 0: post-mortem of its failure")
    proc.expect("(Pdb) ")
    proc.send("p mine")
    proc.expect("'rank 0 here'")
    proc.send("q")
    assert proc.wait() == 1
    assert "rank 1: post-mortem" not in proc.text


LATE = """
import threading
import pytest

@pytest.mark.multirank(world_size=2, timeout=60)
def test_rank_1_fails_later(rank):
    late = f"rank {rank} failed late"
    if rank == 1:
        threading.Event().wait(1.5)  # rank 0 fails first: rank 1 must still get there
    assert rank == 7
"""


def test_the_chosen_rank_is_let_fail_after_another_rank_failed_first(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_late=LATE)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "--ddp-pdb-rank=1", "test_late.py"]
    proc = PtyProcess(argv, str(pytester.path))
    proc.expect("rank 1: post-mortem of its failure")
    proc.expect("(Pdb) ")
    proc.send("p late")
    proc.expect("'rank 1 failed late'")
    proc.send("q")
    assert proc.wait() == 1
    assert "rank 0: post-mortem" not in proc.text


def test_a_pdb_rank_the_test_does_not_have_is_said(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_late=LATE)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "--ddp-pdb-rank=5", "test_late.py"]
    proc = PtyProcess(argv, str(pytester.path))
    assert proc.wait() == 1
    assert "--ddp-pdb-rank=5: this test has ranks 0..1; no rank opened pdb" in proc.text
    assert "post-mortem of its failure" not in proc.text


def test_breakpoint_in_a_rank_lends_it_the_terminal_and_continuing_goes_on(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_break="""
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_stops_on_rank1(rank):
            x = 40 + rank
            if rank == 1:
                breakpoint()
                x += 1
            dist.barrier()
            assert x == 40 + 2 * rank
        """
    )
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "test_break.py"], str(pytester.path)
    )
    proc.expect("rank 1: breakpoint")
    proc.expect("(Pdb) ")
    proc.send("p x")
    proc.expect("41")
    proc.send("c")
    assert proc.wait() == 0, proc.text
    assert "1 passed" in proc.text


def test_a_breakpoint_without_a_terminal_does_not_hang(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_break="""
        import pytest

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_stops(rank):
            breakpoint()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "1")
    result.assert_outcomes(passed=1)  # an xdist worker has no terminal to lend: passed over
    assert "BrokenPipeError" not in result.stdout.str()
    assert result.duration < 40


def test_pdb_opens_on_a_rank_fixtures_error_and_pytest_stays_away(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_fixture_fails="""
        import pytest

        @pytest.fixture
        def data(rank):
            missing = f"shard-{rank}.bin"
            if rank == 1:
                raise FileNotFoundError(missing)
            return missing

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_uses_data(data):
            pass

        def test_after():
            pass
        """
    )
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "test_fixture_fails.py"], str(pytester.path)
    )
    proc.expect("rank 1: post-mortem of its failure")
    proc.expect("(Pdb) ")
    proc.send("p missing")
    proc.expect("shard-1.bin")
    proc.send("q")
    proc.wait()
    text = proc.text
    assert "1 passed, 1 error" in text, text
    assert "PDB post_mortem" not in text, "pytest's own debugger stayed away"


def test_quitting_at_a_ranks_breakpoint_fails_the_test_in_one_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_quit="""
        import pytest

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_stops_on_rank1(rank):
            if rank == 1:
                breakpoint()
        """
    )
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "test_quit.py"], str(pytester.path)
    )
    proc.expect("rank 1: breakpoint")
    proc.expect("(Pdb) ")
    proc.send("q")
    assert proc.wait() == 1
    assert "rank 1: failed: the debugger was quit (q) in this rank" in proc.text
    assert "BdbQuit" not in proc.text
