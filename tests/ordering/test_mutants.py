"""Mutation tests: the ordering suite, run against each seeded bug of the reference trainer,
must fail with a message that points at the bug.

Each case runs ``test_lifecycle.py`` itself (as ``test_mutated_lifecycle.py``, so its module name cannot
clash with the outer session's) in an inner session with
``REFERENCE_TRAINER_BUGS`` set, restricted to the layouts where the bug can show. The README's
mutation score is the share of these cases that pass; every one must.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SUITE = Path(__file__).with_name("test_lifecycle.py").read_text()
INI = "[pytest]\nddp_preload =\n    torch._dynamo\n    torch.nn.parallel\n    torch.distributed.fsdp\n"

# bug -> (selection, the lines the failure must show)
MUTANTS = {
    "group_after_prepare_data-launched": (
        "group_after_prepare_data",
        "test_launched_ranks and external-ws2-nodes1-once",
        [
            "E*'dm.prepare_data@0' does not happen before 'dm.setup':",
            "E*no collective connects them*",
            "E*no-op barrier: 'barrier' on rank 1 (event #*) issued no collective: no process group existed",
        ],
    ),
    "group_after_prepare_data-self-launched": (
        "group_after_prepare_data",
        "test_self_launched_ranks and ddp-ws2",
        [
            "E*'dm.prepare_data@0' does not happen before 'dm.setup':",
            "E*no-op barrier: 'barrier' on rank 1 (event #*) issued no collective: no process group existed",
        ],
    ),
    "no_barrier_after_setup": (
        "no_barrier_after_setup",
        "test_launched_ranks and ddp-ws2-nodes1-once",
        ["E*'setup' does not happen before 'configure_model':", "E*no collective connects them*"],
    ),
    "no_barrier_before_setup": (
        "no_barrier_before_setup",
        "test_launched_ranks and fsdp-ws2-nodes1-once",
        ["E*'dm.prepare_data@0' does not happen before 'dm.setup':", "E*no collective connects them*"],
    ),
    "prepare_data_every_rank": (
        "prepare_data_every_rank",
        "test_launched_ranks and external-ws4-nodes2-per_node",
        ["E*AssertionError: prepare_data ran on ranks [[]0, 1, 2, 3[]], expected [[]0, 2[]]*"],
    ),
    "prepare_data_rank0_only": (
        "prepare_data_rank0_only",
        "test_launched_ranks and external-ws4-nodes2-per_node",
        ["E*AssertionError: prepare_data ran on ranks [[]0[]], expected [[]0, 2[]]*"],
    ),
    "model_to_device_twice": (
        "model_to_device_twice",
        "test_launched_ranks and ddp-ws2-nodes1-once",
        ["E*'model_to_device' was called 2 times on rank 0 (events #*, #*); expected exactly once"],
    ),
    "barrier_rank0_only": (
        "barrier_rank0_only",
        "test_launched_ranks and external-ws2-nodes1-once",
        [
            "desync: collective #2 on the default group: rank 0 barrier(), rank 1 all_gather(int64[1])",
            "hang: the ranks were stopped after * s, not at the * s limit: they are blocked in collectives that*",
            "  rank 0: blocked in barrier #2 on the default group for *, in *barrier",
            "  rank 1: waiting in all_gather #2 on the default group, issued from native code (gloo:all_gather),"
            " for *, in *wrap_model",
        ],
    ),
    "resume_ignores_checkpoint": (
        "resume_ignores_checkpoint",
        "killed_mid_training",
        ["E*AssertionError: the restarted fit did not resume from epoch 0's checkpoint (trainer.resumed_from=None)"],
    ),
    "checkpoint_without_barrier": (
        "checkpoint_without_barrier",
        "killed_mid_training",
        ["E*'save_checkpoint@0' does not happen before 'on_fit_end':", "E*no collective connects them*"],
    ),
    "teardown_keeps_group": (
        "teardown_keeps_group",
        "test_launched_ranks and external-ws2-nodes1-once or in_process",
        [
            "E*order teardown -> dist.destroy_process_group not found:",
            "*test_in_process_fit_leaves_nothing_behind leaked (cleaned up before the next test):",
            "  the default process group (backend gloo, world size 1, group name *) is still initialised",
        ],
    ),
}


def test_every_seeded_bug_has_a_mutation_test() -> None:
    from reference_trainer import BUGS

    assert sorted({bug for bug, _, _ in MUTANTS.values()}) == sorted(BUGS)


@pytest.mark.parametrize("case", sorted(MUTANTS))
def test_the_ordering_suite_catches_the_seeded_bug(pytester: pytest.Pytester, monkeypatch, case: str) -> None:
    bug, selection, lines = MUTANTS[case]
    pytester.makeini(INI)
    pytester.makepyfile(test_mutated_lifecycle=SUITE)
    monkeypatch.setenv("REFERENCE_TRAINER_BUGS", bug)
    monkeypatch.setenv("ORDERING_TIMEOUT", "3")
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", selection, "-rfE")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) >= 1, result.stdout.str()
    assert outcomes.get("passed", 0) == 0 or case == "teardown_keeps_group", "every selected case must catch it"
    for line in lines:
        result.stdout.fnmatch_lines([line])


def test_the_unmutated_trainer_passes_the_same_selections(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(test_mutated_lifecycle=SUITE)
    selection = " or ".join(f"({sel})" for _, sel, _ in MUTANTS.values())
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", selection)
    result.assert_outcomes(passed=7)
