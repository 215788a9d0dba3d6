"""What the pytest process asks the fork server for: one multirank run (a Job)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..schedule import Hold

# variables that differ from test to test and that nothing before the body reads: a rank
# prepared ahead of its test takes them from the job it is handed
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)
DEBUGGING_GROUP_TIMEOUT = 24 * 3600.0


@dataclass
class Job:
    """One multirank run: ``world_size`` fresh rank processes running one test."""

    test_id: str
    label: str  # what reports call it: the test's node id
    world_size: int
    nodes: int
    backend: str
    init_process_group: bool
    timeout: float  # seconds for the whole run across ranks
    run_dir: str  # this run's private folder: events, output, results, stacks
    env: dict[str, str]
    cwd: str
    payload: bytes = b""  # opaque to the launcher; the rank body decodes it
    group_timeout: float = 0.0  # the process group's own timeout; 0 derives it from timeout
    live_output: bool = False  # each rank's lines also go to pytest's stdout as printed (-s)
    post_mortem: bool = False  # --pdb: a failing rank opens pdb on its traceback
    pdb_rank: int | None = None  # --ddp-pdb-rank: only this rank does
    attempt: int = 0  # how many times the ranks were restarted before this run
    max_restarts: int = 0  # multirank(restarts=K): a rank's death starts every rank again, K times
    holds: dict[int, list[Hold]] | None = None  # a schedule (``--ddp-explore``): rank -> its holds

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.nodes

    @property
    def group_limit(self) -> float:
        """The process group's timeout: longer than the test's limit, so the watchdog
        diagnoses a hang before gloo gives up; under --pdb the peers of a rank being debugged
        wait as long as the person does."""
        if self.post_mortem:
            return DEBUGGING_GROUP_TIMEOUT
        return self.group_timeout or self.timeout + 60.0

    def readiness(self) -> tuple[object, ...] | None:
        """What ranks set up before their test knows its body depend on (their group, their
        environment, where their output goes); None for a run whose ranks cannot be set up
        ahead: it creates its group itself, or its schedule holds a rank before the group."""
        if not self.init_process_group or self.holds is not None:
            return None
        env = tuple(sorted((k, v) for k, v in self.env.items() if k not in VOLATILE_ENV))
        return (self.world_size, self.nodes, self.backend, self.group_limit, self.live_output, env)

    def path(self, rank: int, what: str) -> str:
        return os.path.join(self.run_dir, f"rank{rank}.{what}")
