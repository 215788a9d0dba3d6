"""A frozen rank in the middle of the reference trainer's fit: the run must end at its limit with
a hang report that names the rank the fault stopped and shows where the other one waits."""

from __future__ import annotations

import pytest

FROZEN = """
import pytest
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from reference_trainer import RegressionDataModule, RegressionModule, Trainer


@pytest.mark.multirank(world_size=2, timeout=4)
def test_frozen_peer(rank, faults, shared_tmp_path):
    faults.stop(rank=1, at="dist.all_reduce#3")
    Trainer("ddp", ddp_comm_hook=allreduce_hook).fit(RegressionModule(), RegressionDataModule(shared_tmp_path))
"""


def test_a_rank_stopped_mid_fit_is_named_in_the_hang_report(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nddp_preload =\n    torch._dynamo\n    torch.nn.parallel\n")
    pytester.makepyfile(test_frozen=FROZEN)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "rank 1 was stopped by the injected fault stop(at='dist.all_reduce#3') at event #*",
            "hang: the test did not finish within 4 s (2 ranks), after the injected SIGSTOP of rank 1",
            "  rank 0: waiting for all_reduce #10 on the default group, handed to a future (Work.get_future), for *",
            "*",
            "  rank 1: stopped (SIGSTOP): stopped by the injected fault stop(at='dist.all_reduce#3') at event #*",
        ]
    )
    result.stdout.fnmatch_lines(["rank 0 stack, MainThread (most recent call last):"])
