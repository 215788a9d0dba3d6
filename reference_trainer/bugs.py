"""Seeded bugs: each name switches on one historical hook-ordering mistake in the trainer.

They exist so tests can build mutants of the one trainer instead of copying it; every place
a bug changes behaviour is marked ``# BUG <name>`` in the source.
"""

from __future__ import annotations

from collections.abc import Iterable

GROUP_AFTER_PREPARE_DATA = "group_after_prepare_data"
NO_BARRIER_AFTER_SETUP = "no_barrier_after_setup"
NO_BARRIER_BEFORE_SETUP = "no_barrier_before_setup"
PREPARE_DATA_EVERY_RANK = "prepare_data_every_rank"
PREPARE_DATA_RANK0_ONLY = "prepare_data_rank0_only"
MODEL_TO_DEVICE_TWICE = "model_to_device_twice"
BARRIER_RANK0_ONLY = "barrier_rank0_only"
TEARDOWN_KEEPS_GROUP = "teardown_keeps_group"
RESUME_IGNORES_CHECKPOINT = "resume_ignores_checkpoint"
CHECKPOINT_WITHOUT_BARRIER = "checkpoint_without_barrier"

BUGS: dict[str, str] = {
    # created after setup, not straight after the barrier: joining a group waits for every
    # rank, so an init right after the barrier would still order prepare_data before setup
    GROUP_AFTER_PREPARE_DATA: "the process group is created only after prepare_data and setup, so the barrier"
    " before setup has no group and does nothing",
    NO_BARRIER_AFTER_SETUP: "the barrier between setup and configure_model is skipped",
    NO_BARRIER_BEFORE_SETUP: "the barrier between prepare_data and setup is skipped",
    PREPARE_DATA_EVERY_RANK: "prepare_data runs on every rank instead of once per node (or once)",
    PREPARE_DATA_RANK0_ONLY: "prepare_data runs on global rank 0 only, even with prepare_data_per_node=True",
    MODEL_TO_DEVICE_TWICE: "wrap_model moves the model to the device again, after the trainer already did",
    BARRIER_RANK0_ONLY: "only rank 0 enters the barrier after setup; the other ranks go on (a hang)",
    TEARDOWN_KEEPS_GROUP: "the trainer does not destroy the process group it created",
    RESUME_IGNORES_CHECKPOINT: "resume=True finds the last checkpoint but starts the fit from scratch",
    CHECKPOINT_WITHOUT_BARRIER: "the ranks go on while rank 0 is still writing the epoch's checkpoint, so a"
    " rank that dies then restarts from a file that may be torn",
}


def check(bugs: Iterable[str]) -> frozenset[str]:
    """The bug names as a set; an unknown name is an error, not a silently correct run."""
    out = frozenset(bugs)
    unknown = sorted(out - BUGS.keys())
    if unknown:
        raise ValueError(f"unknown bug switch(es) {unknown}; known: {sorted(BUGS)}")
    return out
