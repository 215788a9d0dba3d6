"""A hang becomes a fast, precise failure, and the session goes on with the next test."""

from __future__ import annotations

import psutil
import pytest

NEXT = """

        def test_next_runs_normally():
            assert True
        """


def test_rank_that_returns_early_leaves_the_others_in_barrier(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=3, timeout=60)
        def test_early_return(rank):
            dist.barrier()
            if rank == 2:
                return
            dist.barrier()
        """
        + NEXT
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    assert ran.seconds < 30, "diagnosed as soon as rank 2 left, not at the limit"
    ran.lines(
        "hang: the ranks were stopped after * s, not at the 60 s limit: they wait for ranks that finished the test",
        "  rank 2 finished the test without calling barrier #2 on the default group; ranks 0,1 wait in it",
        "  rank 0: blocked in barrier #2 on the default group for *",
        "    ranks that never entered barrier #2: 2",
        "    stuck at test_inner.py:9 in test_early_return: dist.barrier()",
        "  rank 1: blocked in barrier #2 on the default group for *",
        "  rank 2: finished the test body (passed), then waited for the other ranks",
    )
    ran.lines(
        "rank 0 stack, MainThread (most recent call last):", '  File "test_inner.py", line 9, in test_early_return'
    )
    ran.lines("recorded timeline:", "rank 0 * | rank 1 * | rank 2", "*= barrier #1 =*= barrier #1 =*= barrier #1 =*")
    ran.lines("FAILED test_inner.py::test_early_return - rank 2 finished the test*")


def test_all_reduce_against_broadcast_is_a_desync_said_first(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_mismatch(rank):
            t = torch.ones(4)
            dist.all_reduce(t)
            dist.barrier()
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        """
    )
    ran.result.assert_outcomes(failed=1)
    # stopped once the mismatch is seen twice without progress, long before the limit
    ran.lines(
        "desync: collective #3 on the default group:"
        " rank 0 all_reduce(float32[4]), rank 1 broadcast(float32[4], src=0)",
        "hang: the ranks were stopped after * s, not at the 60 s limit:"
        " they are blocked in collectives that can never match",
        "  rank 0: blocked in all_reduce #3 on the default group for *",
        "    stuck at test_inner.py:11 in test_mismatch: dist.all_reduce(t)",
        "  rank 1: blocked in broadcast #3 on the default group for *",
        "    stuck at test_inner.py:13 in test_mismatch: dist.broadcast(t, src=0)",
    )
    ran.lines("FAILED test_inner.py::test_mismatch - desync: collective #3 on the default*")
    assert ran.seconds < 30


def test_a_desync_whose_returning_side_goes_on_to_the_next_collective_is_stopped_early(inner) -> None:
    """gloo lets rank 0 return from an all-reduce of 2 elements against one of 3: it waits in
    the next barrier, while rank 1 waits in the all-reduce for ever."""
    ran = inner(
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_then_barrier(rank):
            dist.all_reduce(torch.ones(2 if rank == 0 else 3))
            dist.barrier()
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "desync: collective #1 on the default group: rank 0 all_reduce(float32[2]), rank 1 all_reduce(float32[3])",
        "hang: the ranks were stopped after * s, not at the 60 s limit:"
        " they are blocked in collectives that can never match",
    )
    assert ran.seconds < 30


def test_a_send_or_receive_its_peer_never_posts_while_it_waits_in_a_collective_is_a_deadlock(inner) -> None:
    ran = inner(
        """
        import threading
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_send_against_barrier(rank):
            if rank == 0:
                dist.send(torch.ones(2), 1)  # rank 1 posts no receive
            dist.barrier()

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_receive_posted_late(rank):
            if rank == 0:
                dist.send(torch.ones(2), 1)
            else:
                threading.Event().wait(3)  # busy elsewhere, no collective: rank 0 only waits
                dist.recv(torch.empty(2), 0)
            dist.barrier()
        """
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    ran.lines(
        "hang: the ranks were stopped after * s, not at the 60 s limit: ranks 0,1 wait for each other in"
        " different collectives (a deadlock)",
        "  rank 0: blocked in send (peer 1) for * s",
        "  rank 1: blocked in barrier #1 on the default group for * s",
        "    ranks that never entered barrier #1: 0",
    )
    assert ran.seconds < 30


def test_a_slow_peer_in_a_matching_collective_is_not_stopped_early(inner) -> None:
    ran = inner(
        """
        import threading
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=30)
        def test_slow_peer(rank):
            t = torch.ones(4)
            if rank == 1:
                # rank 0 waits inside all_reduce #1 for several desync looks
                threading.Event().wait(2.5)
            dist.all_reduce(t)
            assert t.tolist() == [2.0] * 4
        """
    )
    ran.result.assert_outcomes(passed=1)
    ran.no_lines("desync: *")
    ran.no_lines("hang: *")


def test_two_groups_entered_in_opposite_orders_are_a_deadlock_said_early(inner) -> None:
    ran = inner(
        """
        import threading
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_opposite_orders(rank):
            a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
            first, second = (a, b) if rank == 0 else (b, a)
            dist.barrier(group=first)
            dist.barrier(group=second)

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_same_order_but_one_rank_is_late(rank):
            a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
            if rank == 1:
                threading.Event().wait(3)  # rank 0 waits in a's barrier meanwhile: a wait, no cycle
            dist.barrier(group=a)
            dist.barrier(group=b)

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_a_worker_thread_waits_while_the_main_thread_is_busy(rank):
            a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
            if rank == 0:
                dist.barrier(group=a)
                dist.barrier(group=b)
            else:  # b's barrier on a thread of its own, a's on the main thread once it is done
                saver = threading.Thread(target=dist.barrier, kwargs={"group": b}, name="saver")
                saver.start()
                threading.Event().wait(3)  # longer than a cycle must hold: no cycle, the main thread is free
                dist.barrier(group=a)
                saver.join()
        """
    )
    ran.result.assert_outcomes(failed=1, passed=2)
    ran.lines(
        "hang: the ranks were stopped after * s, not at the 60 s limit: ranks 0,1 wait for each other in"
        " different collectives (a deadlock)",
        "  rank 0: blocked in barrier #1 on group 1 (ranks 0,1) for * s",
        "    ranks that never entered barrier #1: 1",
        "    stuck at test_inner.py:* in test_opposite_orders: dist.barrier(group=first)",
        "  rank 1: blocked in barrier #1 on group 2 (ranks 0,1) for * s",
        "    ranks that never entered barrier #1: 0",
    )
    ran.lines("FAILED test_inner.py::test_opposite_orders - deadlock of ranks 0,1; rank 0: b*")
    assert ran.seconds < 30


def test_a_cycle_a_thread_of_the_code_under_test_could_still_break_is_no_deadlock(inner) -> None:
    ran = inner(
        """
        import threading
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_each_main_thread_waits_for_the_other_ranks_loader(rank):
            a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
            mine, theirs = (a, b) if rank == 0 else (b, a)

            def load():
                threading.Event().wait(4)  # longer than a cycle must hold
                dist.barrier(group=theirs)

            loader = threading.Thread(target=load, name="loader")
            loader.start()
            dist.barrier(group=mine)
            loader.join()

        @pytest.mark.multirank(world_size=2, timeout=5)
        def test_a_cycle_beside_an_idle_thread(rank):
            a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
            first, second = (a, b) if rank == 0 else (b, a)
            threading.Thread(target=threading.Event().wait, name="heartbeat", daemon=True).start()
            dist.barrier(group=first)
            dist.barrier(group=second)
        """
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    # nothing tells the heartbeat from a thread about to enter: only the limit ends the wait
    ran.lines("hang: the test did not finish within 5 s (2 ranks)")
    ran.lines("FAILED test_inner.py::test_a_cycle_beside_an_idle_thread - hang after 5 s*")
    ran.no_lines("*wait for each other*")


def test_a_rank_that_never_joins_the_group_its_peers_init_is_said_early(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, init_process_group=False, timeout=60)
        def test_only_rank0_inits(rank):
            if rank == 0:
                dist.init_process_group("gloo")

        @pytest.mark.multirank(world_size=2, init_process_group=False, timeout=60)
        def test_both_init(rank):
            dist.init_process_group("gloo")
            dist.barrier()
        """
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    ran.lines(
        "hang: the ranks were stopped after * s, not at the 60 s limit: they wait for ranks that finished the test",
        "  rank 1 finished the test without calling init_process_group; rank 0 waits in it",
    )
    assert ran.seconds < 30


def test_a_rank_that_never_calls_new_group_its_peers_call_is_said_early(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_only_rank0_builds_the_group(rank):
            if rank == 0:
                dist.new_group([0, 1])

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_both_build_it(rank):
            group = dist.new_group([0, 1])
            dist.barrier(group=group)

        @pytest.mark.multirank(world_size=3, timeout=60)
        def test_only_members_synchronise(rank):
            if rank != 2:
                group = dist.new_group([0, 1], use_local_synchronization=True)
                dist.barrier(group=group)
        """
    )
    ran.result.assert_outcomes(failed=1, passed=2)
    ran.lines(
        "hang: the ranks were stopped after * s, not at the 60 s limit: they wait for ranks that finished the test",
        "  rank 1 finished the test without calling new_group; rank 0 waits in it",
        "  rank 0: blocked in new_group for * s",
        "    stuck at test_inner.py:7 in test_only_rank0_builds_the_group: dist.new_group([[]0, 1[]])",
    )
    assert ran.seconds < 30


def test_a_collective_hung_in_another_thread_is_named_with_the_thread(inner) -> None:
    ran = inner(
        """
        import threading
        import time
        import pytest
        import torch
        import torch.distributed as dist

        def save(state):
            dist.all_reduce(state)

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_saver_waits_for_a_busy_peer(rank):
            state = torch.ones(2)
            if rank == 0:
                saver = threading.Thread(target=save, args=(state,), name="ckpt-saver")
                saver.start()
                saver.join()
            else:
                time.sleep(100)
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "hang: the test did not finish within 3 s (2 ranks)",
        "  rank 0: blocked in all_reduce #1 on the default group for * s, in thread ckpt-saver",
        "    ranks that never entered all_reduce #1: 1",
        "    stuck at test_inner.py:16 in test_saver_waits_for_a_busy_peer: saver.join()",
        "    thread ckpt-saver at test_inner.py:8 in save: dist.all_reduce(state)",
        "  rank 1: still running",
    )


def test_a_desync_one_side_of_which_returned_is_stopped_early(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_counts_differ(rank):
            dist.all_reduce(torch.ones(2 if rank == 0 else 3))
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "desync: collective #1 on the default group: rank 0 all_reduce(float32[[]2[]]),"
        " rank 1 all_reduce(float32[[]3[]])",
        "hang: the ranks were stopped after * s, not at the 60 s limit: they are blocked in a collective that can"
        " never match what the finished ranks called",
        "  rank 0: finished the test body (passed), then waited for the other ranks",
        "  rank 1: blocked in all_reduce #1 on the default group for * s",
    )
    assert ran.seconds < 30


def test_timeline_against_a_collective_is_a_deadlock_said_early(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_rank0_gathers_first(rank, recorder):
            if rank == 0:
                recorder.timeline()
            dist.barrier()

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_both_gather_then_barrier(rank, recorder):
            recorder.timeline()
            dist.barrier()
        """
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    ran.lines(
        "hang: the ranks were stopped after * s, not at the 60 s limit: ranks 0,1 wait for each other (a deadlock):"
        " timeline() against a collective",
        "  rank 0: waiting in timeline() for the other ranks to call it",
        "    stuck at test_inner.py:7 in test_rank0_gathers_first: recorder.timeline()",
        "  rank 1: blocked in barrier #1 on the default group for * s",
    )
    assert ran.seconds < 30


def test_a_barrier_paired_across_hooks_is_pointed_out(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        class Trainer:
            def setup(self):
                dist.barrier()

            def teardown(self):
                dist.barrier()

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_extra_barrier_on_rank0(rank, recorder):
            trainer = recorder.instrument(Trainer(), "setup", "teardown")
            if rank == 0:
                trainer.setup()
            trainer.teardown()
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "note: barrier #1 on the default group was entered in different hooks (rank 0 in Trainer.setup, rank 1 in"
        " Trainer.teardown): gloo takes any two barrier calls of one shape as one, so these may be two different"
        " ones, paired",
        "hang: the ranks were stopped after * s, not at the 60 s limit: they wait for ranks that finished the test",
        "  rank 1 finished the test without calling barrier #2 on the default group; rank 0 waits in it",
    )


def test_a_hang_inside_an_installed_framework_names_the_users_call_into_it(inner, pytester) -> None:
    framework = pytester.path / "venv" / "site-packages" / "fakefw"
    framework.mkdir(parents=True)
    (framework / "__init__.py").write_text("import torch.distributed as dist\n\n\ndef barrier():\n    dist.barrier()\n")
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(framework.parent)!r})\n")
    ran = inner(
        """
        import time
        import pytest
        import fakefw

        def setup():
            fakefw.barrier()

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_framework_barrier(rank):
            if rank == 0:
                setup()
            else:
                time.sleep(100)
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "  rank 0: blocked in barrier #1 on the default group for * s",
        "    ranks that never entered barrier #1: 1",
        "    stuck at *site-packages/fakefw/__init__.py:5 in barrier: dist.barrier()",
        "      called from test_inner.py:6 in setup: fakefw.barrier()",
    )


def test_a_native_call_cut_short_by_the_stack_dump_is_still_the_hang(inner) -> None:
    # PyDLL keeps the GIL through libc's sleep, which the stack dump's signal interrupts: the
    # body then runs on, and what it does after it was stopped must not be taken as its result
    ran = inner(
        """
        import ctypes
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_native(rank):
            if rank == 1:
                ctypes.PyDLL(None).sleep(30)
            dist.barrier()
        """
        + NEXT
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    ran.lines(
        "hang: the test did not finish within 2 s (2 ranks)",
        "  rank 0: blocked in barrier #1 on the default group for *",
        "    ranks that never entered barrier #1: 1",
        "  rank 1: still running",
        "    stuck at test_inner.py:8 in test_native: ctypes.PyDLL(None).sleep(30)",
    )
    assert "finished the test body (passed)" not in ran.text


def test_desync_without_a_hang_still_fails(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=20)
        def test_shapes(rank):
            # same op, other shapes: gloo errors out, the report says why first
            t = torch.ones(4 if rank == 0 else 8)
            dist.all_reduce(t)
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "desync: collective #1 on the default group: rank 0 all_reduce(float32[4]), rank 1 all_reduce(float32[8])"
    )
    assert ran.seconds < 15


def test_a_message_larger_than_its_receive_is_a_desync_through_any_receive_and_a_smaller_one_none(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch
        import torch.distributed as dist

        def receive(how, buffer):
            if how == "recv":
                dist.recv(buffer, src=0)
            elif how == "irecv":
                dist.irecv(buffer, src=0).wait()
            else:
                for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, 0)]):
                    work.wait()

        @pytest.mark.multirank(world_size=2, timeout=20)
        @pytest.mark.parametrize("how", ["recv", "irecv", "batch"])
        def test_sizes(rank, how):
            if rank == 0:
                dist.send(torch.ones(2), dst=1)  # the first message fits
                dist.send(torch.ones(5), dst=1)
            else:
                receive(how, torch.zeros(3))
                receive(how, torch.zeros(3))

        @pytest.mark.multirank(world_size=2, timeout=20)
        def test_fits(rank):
            # gloo takes a message into a larger buffer, whatever the dtypes: no mismatch
            if rank == 0:
                dist.send(torch.ones(2, dtype=torch.float64), dst=1)
            else:
                buffer = torch.zeros(4)
                dist.recv(buffer, src=0)
                assert buffer.view(torch.float64).tolist() == [1.0, 1.0]
        """
    )
    ran.result.assert_outcomes(failed=3, passed=1)
    assert sum(line.startswith("desync: ") for line in ran.text.splitlines()) == 3
    for how in ("recv", "irecv", "batch"):
        ran.lines(
            f"_* test_sizes[[]{how}[]] _*",
            "desync: send/recv 0->1 on the default group: rank 0 send(float32[5]) of 20 bytes,"
            " rank 1 recv(float32[3]) into 12 bytes: gloo aborts a receive whose message is larger than its buffer",
        )
    assert ran.seconds < 15


def test_matching_collectives_report_no_desync(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_hang_only(rank):
            dist.all_reduce(torch.ones(2))
            if rank == 0:
                dist.barrier()
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.no_lines("desync: *")
    ran.lines("hang: *")


HANGS = {
    "python_loop": ("while True:\n                    x = sum(range(100))", "x = sum(range(100))"),
    "native_sleep": ("time.sleep(600)", "time.sleep(600)"),
    "lock": (
        "lock = threading.Lock()\n                lock.acquire()\n                lock.acquire()",
        "lock.acquire()",
    ),
    "child": ('subprocess.run(["sleep", "600"])', 'subprocess.run([[]"sleep", "600"[]])'),
}


@pytest.mark.parametrize("kind", sorted(HANGS))
def test_each_kind_of_hang_is_found_and_named(inner, kind: str) -> None:
    code, stuck = HANGS[kind]
    ran = inner(
        f"""
        import subprocess
        import threading
        import time
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_hang(rank):
            dist.barrier()
            if rank == 1:
                {code}
            dist.barrier()
        """
        + NEXT
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    ran.lines(
        "hang: the test did not finish within 2 s (2 ranks)",
        "  rank 0: blocked in barrier #2 on the default group for *",
        "    ranks that never entered barrier #2: 1",
        "  rank 1: still running",
        f"    stuck at test_inner.py:* in test_hang: {stuck}",
    )
    assert ran.seconds < 15


def test_hang_inside_an_instrumented_hook_names_the_hook(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        class Trainer:
            def setup(self, stage):
                if dist.get_rank() == 0:
                    dist.barrier()

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_hook(rank, recorder):
            trainer = recorder.instrument(Trainer())
            trainer.setup("fit")
        """
    )
    ran.lines("  rank 0: blocked in barrier #1 on the default group for *, in Trainer.setup")


def test_pytest_timeout_value_is_used_and_the_session_survives(inner) -> None:
    ran = inner(
        """
        import time

        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_hang(rank):
            if rank == 0:
                dist.barrier()
            else:
                time.sleep(600)  # never enters it: a hang only the limit ends

        @pytest.mark.timeout(1)
        @pytest.mark.multirank(world_size=2)
        def test_marker_wins(rank):
            if rank == 0:
                dist.barrier()
            else:
                time.sleep(600)  # never enters it: a hang only the limit ends
        """
        + NEXT,
        "--timeout=2",
        "--timeout-method=thread",
        subprocess=True,
    )
    ran.result.assert_outcomes(failed=2, passed=1)
    ran.lines("hang: the test did not finish within 2 s (2 ranks)")
    ran.lines("hang: the test did not finish within 1 s (2 ranks)")
    ran.no_lines("*Timeout*pytest-timeout*")
    ran.no_lines("*++++ Timeout ++++*")


def test_marker_timeout_beats_pytest_timeout_and_ddp_timeout(inner) -> None:
    ran = inner(
        """
        import time

        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=1)
        def test_hang(rank):
            if rank == 0:
                dist.barrier()
            else:
                time.sleep(600)  # never enters it: a hang only the limit ends
        """,
        "--timeout=30",
        "--ddp-timeout=40",
    )
    ran.lines("hang: the test did not finish within 1 s (2 ranks)")


def test_ddp_timeout_option_and_ini(inner, pytester) -> None:
    pytester.makeini("[pytest]\nddp_timeout = 1.5\n")
    source = """
        import time

        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_hang(rank):
            if rank == 0:
                dist.barrier()
            else:
                time.sleep(600)  # never enters it: a hang only the limit ends
        """
    ran = inner(source)
    ran.lines("hang: the test did not finish within 1.5 s (2 ranks)")
    ran = inner(source, "--ddp-timeout=1")
    ran.lines("hang: the test did not finish within 1 s (2 ranks)")
    # pytest 9's native TOML table gives numbers as numbers (a string still works there)
    (pytester.path / "tox.ini").unlink()
    for value, shown in (("2", "2"), ('"1.5"', "1.5")):
        pytester.makepyprojecttoml(f"[tool.pytest]\nddp_timeout = {value}\nddp_explore = 0\nddp_pdb_rank = 1\n")
        ran = inner(source)
        ran.lines(f"hang: the test did not finish within {shown} s (2 ranks)")


def test_a_passing_multirank_test_is_timed_once_and_passes_under_pytest_timeout(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_ok(rank):
            dist.barrier()
        """,
        "--timeout=5",
        "--timeout-method=signal",
    )
    ran.result.assert_outcomes(passed=1)


def test_events_recorded_before_the_hang_are_in_the_report(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_marks(rank, recorder):
            recorder.mark("before-hang")
            if rank == 1:
                recorder.mark("rank1-only")
                while True:
                    pass
            dist.barrier()
        """
    )
    ran.lines("recorded timeline:", "rank 0 * | rank 1", "*", "* before-hang * | * before-hang", "* | * rank1-only")


def test_hangs_under_xdist(inner) -> None:
    kinds = "\n".join(
        f"""
        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_kind_{kind}(rank):
            dist.barrier()
            if rank == 1:
                {code.replace("600", "613")}
            dist.barrier()
        """
        for kind, (code, _) in sorted(HANGS.items())
    )
    ran = inner(
        """
        import subprocess
        import threading
        import time
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.parametrize("i", range(4))
        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_hang(i, rank):
            if rank == i % 2:
                dist.barrier()

        @pytest.mark.parametrize("i", range(4))
        @pytest.mark.multirank(world_size=2)
        def test_ok(i, rank):
            dist.barrier()

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_desync(rank):
            t = torch.ones(4)
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        """
        + kinds,
        "-n",
        "2",
        subprocess=True,
    )
    ran.result.assert_outcomes(failed=4 + 1 + len(HANGS), passed=4)
    ran.lines("FAILED test_inner.py::test_desync - desync: collective #1 on the default gr*")
    for kind, (_, stuck) in sorted(HANGS.items()):
        ran.lines(f"FAILED test_inner.py::test_kind_{kind} - hang after 2 s*")
        ran.lines(f"    stuck at test_inner.py:* in test_kind_{kind}: {stuck.replace('600', '613')}")
    assert ran.seconds < 60
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "613"]]


def test_a_hang_deeper_than_faulthandler_dumps_still_names_the_tests_line(inner) -> None:
    """faulthandler writes a stack's innermost 100 frames: the rank's own thread gives the
    rest, so the test's frame and its "stuck at" line are kept; a frame repeated is told once."""
    ran = inner(
        """
        import contextlib
        import pytest
        import torch.distributed as dist

        @contextlib.contextmanager
        def nothing():
            yield

        def wrapped(f):
            for _ in range(120):  # a framework's decorators, stacked
                f = nothing()(f)
            return f

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_deep(rank):
            barrier = wrapped(dist.barrier)
            if rank == 0:
                barrier()
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "  rank 0: blocked in barrier #1 on the default group for *",
        "    ranks that never entered barrier #1: 1",
        "    stuck at test_inner.py:18 in test_deep: barrier()",
    )
    ran.lines(
        "rank 0 stack, MainThread (most recent call last):",
        '  File "test_inner.py", line 18, in test_deep',
        "    barrier()",
        '  File "*contextlib.py", line *, in inner',
        "    return func(*args, **kwds)",
        "  [[]the same frame 119 more times[]]",
    )
    ran.no_lines("*the dump holds the innermost 100 frames*")


@pytest.mark.parametrize("handler", ["lambda *args: None", "signal.SIG_IGN"])
def test_a_hang_in_code_that_took_the_stack_signal_for_itself_still_shows_every_stack(inner, handler) -> None:
    """The harness asks for stacks with SIGUSR1, which applications take for their own uses
    (Lightning's SLURM requeue): the rank's own thread answers then."""
    ran = inner(
        f"""
        import signal
        import time
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_own_handler(rank):
            signal.signal(signal.SIGUSR1, {handler})
            if rank == 0:
                dist.barrier()
            else:
                while True:
                    time.sleep(0.01)
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "  rank 0: blocked in barrier #1 on the default group for *",
        "    stuck at test_inner.py:10 in test_own_handler: dist.barrier()",
        "  rank 1: still running",
        "    stuck at test_inner.py:13 in test_own_handler: time.sleep(0.01)",
    )
    for rank, line in ((0, 10), (1, 13)):
        ran.lines(
            f"rank {rank} stack, MainThread (most recent call last):",
            f'  File "test_inner.py", line {line}, in test_own_handler',
        )
    ran.no_lines("*no stack (the rank did not answer)*")


def _stacks(text: str) -> list[list[str]]:
    """Each "rank N stack" block of a report, its header first."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("rank ") and " stack, " in line:
            blocks.append([line])
        elif blocks and blocks[-1][-1] and line.startswith("  "):
            blocks[-1].append(line)
        elif blocks:
            blocks[-1].append("")  # the block ended
    return [[ln for ln in b if ln] for b in blocks]


def test_a_hang_in_a_rank_fixture_shows_the_fixtures_frames_not_the_harness(inner) -> None:
    """In setup and teardown, in the first test's ranks and in ranks the fork server prepared
    (forked from inside pytest's main): the stack starts at the fixture, as a body's does."""
    ran = inner(
        """
        import time
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def hangs_in_setup(rank):
            if rank == 0:
                dist.barrier()
            yield

        @pytest.fixture
        def hangs_in_teardown(rank):
            yield
            if rank == 0:
                dist.barrier()

        @pytest.fixture
        def slow(rank):
            time.sleep(60)
            yield

        @pytest.mark.multirank(world_size=2, timeout=30)
        def test_setup(rank, hangs_in_setup):
            pass

        @pytest.mark.multirank(world_size=2, timeout=30)
        def test_teardown(rank, hangs_in_teardown):
            pass

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_slow(rank, slow):
            pass

        @pytest.mark.multirank(world_size=2, timeout=30)
        def test_body(rank):
            if rank == 0:
                dist.barrier()

        @pytest.fixture
        def never_closes(rank):
            yield
            time.sleep(60)  # a shutdown that never returns

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_slow_teardown(rank, never_closes):
            pass
        """
    )
    ran.result.assert_outcomes(errors=4, passed=2, failed=1)
    stacks = _stacks(ran.text)
    assert [b[:2] for b in stacks] == [
        ["rank 0 stack, MainThread (most recent call last):", '  File "test_inner.py", line 8, in hangs_in_setup'],
        ["rank 0 stack, MainThread (most recent call last):", '  File "test_inner.py", line 15, in hangs_in_teardown'],
        ["rank 0 stack, MainThread (most recent call last):", '  File "test_inner.py", line 19, in slow'],
        ["rank 1 stack, MainThread (most recent call last):", '  File "test_inner.py", line 19, in slow'],
        ["rank 0 stack, MainThread (most recent call last):", '  File "test_inner.py", line 42, in never_closes'],
        ["rank 1 stack, MainThread (most recent call last):", '  File "test_inner.py", line 42, in never_closes'],
        ["rank 0 stack, MainThread (most recent call last):", '  File "test_inner.py", line 37, in test_body'],
    ]
    # a hang once every body passed is the teardown's error, each rank said to be there
    ran.lines(
        "*ERROR at teardown of test_teardown*",
        "hang: the ranks were stopped after * s, not at the 30 s limit: they wait for ranks that finished the test",
        "  rank 1 finished the test without calling barrier #1 on the default group; rank 0 waits in it",
        "  rank 0: blocked in barrier #1 on the default group for * s, in a fixture's teardown after its body passed",
    )
    ran.lines(
        "*ERROR at teardown of test_slow_teardown*",
        "hang: the test did not finish within 2 s (2 ranks)",
        "  rank 0: still running, in a fixture's teardown after its body passed",
        "    stuck at test_inner.py:42 in never_closes: time.sleep(60)  # a shutdown that never returns",
    )
    # a hang in a body is FAILED, as before, and says nothing of teardown
    ran.lines("*_ test_body _*", "hang: the ranks were stopped after * s*", "  rank 0: blocked in barrier #1*")
    ran.no_lines("*test_body*teardown*")
    for block in stacks:
        assert not [ln for ln in block if "pytest_ddphooks/" in ln or "_pytest/" in ln or "<frozen" in ln], block
    # what the fixture called stays, as in a body's stack
    ran.result.stdout.fnmatch_lines(
        [
            '  File "test_inner.py", line 8, in hangs_in_setup',
            "    dist.barrier()",
            '  File "*torch/distributed/c10d_logger.py", line *, in wrapper',
        ],
        consecutive=True,
    )
    # the body's stack, as it has always been (its header is checked above)
    ran.result.stdout.fnmatch_lines(
        [
            '  File "test_inner.py", line 37, in test_body',
            "    dist.barrier()",
            '  File "*torch/distributed/c10d_logger.py", line *, in wrapper',
            "    return func(*args, **kwargs)",
            '  File "*torch/distributed/distributed_c10d.py", line *, in barrier',
            "    work.wait()",
            "",
        ],
        consecutive=True,
    )
    ran.no_lines("*no frame of the test's code*")


def test_the_stack_of_a_thread_that_recorded_nothing_is_labelled_with_its_name(inner) -> None:
    ran = inner(
        """
        import threading
        import pytest

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_threads_deadlock(rank):
            first, second = threading.Lock(), threading.Lock()
            both = threading.Barrier(2)

            def take(a, b):
                with a:
                    both.wait()
                    with b:
                        pass

            workers = [
                threading.Thread(target=take, args=(first, second), name="worker-a"),
                threading.Thread(target=take, args=(second, first), name="worker-b"),
            ]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines("rank 0 stack, thread worker-a (most recent call last):")
    ran.lines("rank 1 stack, thread worker-b (most recent call last):")
