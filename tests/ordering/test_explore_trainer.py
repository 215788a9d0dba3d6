"""Schedule exploration on the reference trainer: with no data on disk before the fit, its
seeded bugs that let setup read what prepare_data is still writing hide under normal timing
and are found by exploration in a test that only checks that the fit succeeds."""

from __future__ import annotations

import pytest

FIT = """
import pytest
from reference_trainer import RegressionDataModule, RegressionModule, Trainer


def busy(n):
    return sum(i * i for i in range(n))


class Data(RegressionDataModule):
    def setup(self, stage):
        if self.trainer.global_rank != 0:
            busy(3_000_000)  # a tokenizer to load first (~0.15 s): the other ranks read late, the bugs hide
        super().setup(stage)


@pytest.mark.parametrize("bugs", [(), ("no_barrier_before_setup",), ("group_after_prepare_data",)])
@pytest.mark.multirank(world_size=2, init_process_group=False, timeout=60)
def test_fit_succeeds(rank, shared_tmp_path, bugs):
    trainer = Trainer("external", bugs=bugs, timeout=60.0)
    result = trainer.fit(RegressionModule(), Data(shared_tmp_path))
    assert result.final_loss < result.initial_loss
"""


def test_exploration_finds_the_seeded_prepare_data_races(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nddp_preload =\n    torch._dynamo\n    torch.nn.parallel\n")
    pytester.makepyfile(test_fit=FIT)
    plain = pytester.runpytest("-p", "no:cacheprovider")
    plain.assert_outcomes(passed=3)  # under normal timing every variant passes
    explored = pytester.runpytest("-p", "no:cacheprovider", "--ddp-explore=20", "-rA")
    explored.assert_outcomes(passed=1, failed=2)
    for bug in ("bugs1", "bugs2"):
        explored.stdout.fnmatch_lines(
            [
                f"*_ test_fit_succeeds[[]{bug}[]] _*",
                "failed under schedule * of 20 (seed 0x*); replay with --ddp-schedule=0x*",
                "*rank 1: failed: FileNotFoundError: setup on rank 1 found no data at *: prepare_data has not"
                " finished for this node",
            ]
        )
    explored.stdout.fnmatch_lines(["*test_fit_succeeds[[]bugs0[]]*", "passed under all 20 schedules explored *"])
