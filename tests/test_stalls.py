"""A rank that waits in a collective (or ``timeline()``) that a rank which already finished
the test never entered can never return: it is stopped at once with a diagnosis, not at the
time limit. Every check here runs under a 60 s limit and must end within a few seconds."""

from __future__ import annotations

LIMIT = 60


def test_timeline_called_on_one_rank_only_is_named_at_once(inner) -> None:
    ran = inner(
        f"""
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout={LIMIT})
        def test_only_rank0_gathers(rank, recorder):
            recorder.mark("work")
            dist.barrier()
            if rank == 0:
                recorder.timeline()
        """
    )
    ran.result.assert_outcomes(failed=1)
    assert ran.seconds < 20
    ran.lines(
        f"hang: the ranks were stopped after * s, not at the {LIMIT} s limit:"
        " they wait for ranks that finished the test",
        "  rank 1 finished the test without calling timeline(); rank 0 waits in it",
    )


def test_a_skip_on_one_rank_while_the_other_waits_in_a_collective_is_named_at_once(inner) -> None:
    ran = inner(
        f"""
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout={LIMIT})
        def test_skips_on_rank1(rank):
            if rank == 1:
                pytest.skip("no data on rank 1")
            dist.all_reduce(torch.ones(2))
        """
    )
    ran.result.assert_outcomes(failed=1)
    assert ran.seconds < 20
    ran.lines("  rank 1 finished the test without calling all_reduce #1 on the default group; rank 0 waits in it")
    ran.lines("  rank 1: finished the test body (skipped), then waited for the other ranks")


def test_a_send_or_a_recv_the_finished_peer_never_matched_is_named_at_once(inner) -> None:
    ran = inner(
        f"""
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout={LIMIT})
        def test_send_nobody_receives(rank):
            if rank == 0:
                dist.send(torch.ones(1), dst=1)

        @pytest.mark.multirank(world_size=2, timeout={LIMIT})
        def test_isend_nobody_receives(rank):
            if rank == 0:
                dist.isend(torch.ones(1), dst=1).wait()

        @pytest.mark.multirank(world_size=2, timeout={LIMIT})
        def test_recv_nobody_sends(rank):
            if rank == 1:
                dist.recv(torch.ones(1), src=0)

        @pytest.mark.multirank(world_size=2, timeout={LIMIT})
        def test_matched(rank):
            t = torch.ones(1)
            for _ in range(3):
                if rank == 0:
                    dist.send(t, dst=1)
                else:
                    dist.recv(t, src=0)
        """
    )
    ran.result.assert_outcomes(failed=3, passed=1)
    assert ran.seconds < 30
    assert ran.text.count("  rank 1 finished the test without a recv from rank 0; rank 0 waits in send to rank 1") == 2
    ran.lines("  rank 0 finished the test without a send to rank 1; rank 1 waits in recv from rank 0")


def test_work_that_does_not_need_the_finished_rank_is_left_alone(inner) -> None:
    ran = inner(
        f"""
        import time
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=3, timeout={LIMIT})
        def test_pair_goes_on(rank):
            pair = dist.new_group([0, 1])
            if rank == 2:
                return  # not a member of what follows
            time.sleep(0.7)  # rank 2 is done long before
            for _ in range(3):
                dist.all_reduce(torch.ones(2), group=pair)
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_a_collective_the_finished_rank_issued_unseen_is_no_stall(inner) -> None:
    ran = inner(
        f"""
        import time
        import pytest
        import torch.distributed as dist

        def unseen_barrier():
            dist.ProcessGroup.barrier.__ddphooks_original__(dist.group.WORLD).wait()

        @pytest.mark.multirank(world_size=2, timeout={LIMIT})
        def test_gap(rank):
            if rank == 0:
                time.sleep(0.7)  # rank 1 has finished: its last barrier was not recorded
                dist.barrier()
            else:
                unseen_barrier()
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_a_rank_stopped_by_sigstop_is_named_with_where_it_stopped(inner) -> None:
    ran = inner(
        """
        import os
        import signal
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_frozen(rank):
            dist.barrier()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            dist.barrier()
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "hang: the test did not finish within 3 s (2 ranks)",
        "  rank 0: blocked in barrier #2 on the default group for *",
        "    ranks that never entered barrier #2: 1",
        "*",
        "  rank 1: stopped (SIGSTOP)",
        "    its last recorded event: dist.barrier ended on rank 1 (event #*)",
    )
    ran.lines("rank 1: no stack (stopped by SIGSTOP: it runs no code until continued)")
