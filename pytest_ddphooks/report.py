"""What a multirank run observed: each rank's result and exit, what the harness did, what
was recorded. Built by the launcher's run loop, or under torchrun from the results the
ranks exchanged; ``failure.classify`` turns it into a verdict."""

from __future__ import annotations

import os
import pickle
import signal
from dataclasses import dataclass, field
from typing import Any

from .recorder.timeline import Calls, Timeline
from .stacks import Stacks

PHASES = ("setup", "call", "teardown")


# the file of a run's rank where it tells how its body ended (failed, skipped, xfailed) before the
# fixtures' teardown ran
BEFORE_TEARDOWN = "before-teardown"


@dataclass
class RankResult:
    """How the test went on one rank."""

    rank: int
    outcome: str  # "passed", "failed", "skipped", "xfailed"
    longrepr: str = ""  # the rank's own failure report, formatted where it happened
    message: str = ""  # one line: "AssertionError: assert 1 == 2"
    location: tuple[str, int] | None = None  # (path, line) of the failure or skip
    raised_at: tuple[str, int, str] | None = None  # (path, line, function) of user code a failure came through
    teardown_error: RankResult | None = None  # its fixtures' teardown failed too, after this failure
    markers: list[bytes] = field(default_factory=list)  # markers the rank added to the test, pickled
    duration: float = 0.0
    leaks: list[tuple[int, str]] = field(default_factory=list)  # (pid, command) left running, killed
    harness_error: bool = False  # the failure came from setting the rank up, not the test
    # where a failure (or a skip, an xfail) happened: fixture "setup", the body ("call"), "teardown"
    phase: str = "call"
    warnings: list[dict[str, Any]] = field(default_factory=list)  # warning_relay's wire form
    sections: list[tuple[str, str, str]] = field(default_factory=list)  # (when, key, text): captured logs
    highlights: list[dict[str, Any]] = field(default_factory=list)  # events a timeline assertion named
    measured: Any = None  # the rank's coverage, for the session's (coverage_relay.Measured)
    output_marks: list[tuple[str, int, int]] = field(default_factory=list)  # (phase, stdout, stderr) offsets
    ended_ns: int = 0  # when the body and its fixtures ended (time_ns); 0: not known
    properties: list[tuple[str, Any]] = field(default_factory=list)  # record_property and user_properties
    suite_properties: list[tuple[str, Any]] = field(default_factory=list)  # record_testsuite_property
    xml_attributes: list[tuple[str, str]] = field(default_factory=list)  # record_xml_attribute
    error_class: bytes | None = None  # the failure's exception class, pickled (xfail(raises=...) reads it)
    exit_request: tuple[str, int | None] | None = None  # pytest.exit(msg, returncode) in the rank
    # (group, seq) -> what each member called, of the collective mismatches the body looked at
    # itself (``collective_mismatches()``): the rank's recorder's
    mismatches_checked: dict[tuple[str, int], Calls] = field(default_factory=dict)

    def write(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(self, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)

    @staticmethod
    def read(path: str) -> RankResult | None:
        try:
            with open(path, "rb") as f:
                result = pickle.load(f)
        except (FileNotFoundError, EOFError, pickle.UnpicklingError):
            return None
        return result if isinstance(result, RankResult) else None


@dataclass
class RankExit:
    """How a rank process ended: ``code`` from exit(), or the ``signal`` that killed it."""

    rank: int
    pid: int
    code: int | None
    signal: int | None
    by_harness: bool = False  # killed by the harness while it still ran, not ended on its own

    @classmethod
    def from_status(cls, rank: int, pid: int, status: int, by_harness: bool = False) -> RankExit:
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            return cls(rank, pid, None, -code, by_harness)
        return cls(rank, pid, code, None, by_harness)

    @property
    def clean(self) -> bool:
        return self.signal is None and self.code == 0

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        return f"exit code {self.code}"


@dataclass
class Stall:
    """Ranks stopped early: they waited in a collective (or ``timeline()``) that ranks which
    had finished the test never entered."""

    waiting: dict[int, str]  # rank -> what it waits in: "all_reduce #3 on the default group"
    left: dict[int, str]  # rank -> how it finished: "passed", "skipped"


@dataclass
class RunReport:
    world_size: int
    limit: float  # the run's time limit, in seconds
    held_allowance: float = 0.0  # seconds added to it for a schedule's holds
    results: dict[int, RankResult] = field(default_factory=dict)
    # rank -> how its test failed, skipped or xfailed, of a rank that then died or was stopped in
    # its fixtures' teardown (written before the teardown ran; its result never came)
    before_teardown: dict[int, RankResult] = field(default_factory=dict)
    exits: dict[int, RankExit] = field(default_factory=dict)
    stopped: dict[int, str] = field(default_factory=dict)  # rank -> why the harness stopped it
    timed_out: bool = False
    interrupted: bool = False  # the user stopped the session (KeyboardInterrupt) while it ran
    desynced: bool = False  # stopped early: blocked in collectives that can never match
    stall: Stall | None = None  # stopped early: waiting for ranks that had finished
    deadlock: list[int] = field(default_factory=list)  # stopped early: these ranks wait for each other
    first_failure: int | None = None
    stacks: dict[int, Stacks] = field(default_factory=dict)
    frozen: set[int] = field(default_factory=set)  # ranks found stopped (SIGSTOP) when stopped
    exchanging: set[int] = field(default_factory=set)  # ranks inside timeline() when stopped
    outputs: dict[int, tuple[str, str]] = field(default_factory=dict)
    phase_outputs: dict[int, list[tuple[str, str, str]]] = field(default_factory=dict)  # (phase, out, err)
    timeline: Timeline | None = None
    thread_idents: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, lane) -> ident
    swept: list[tuple[int, str]] = field(default_factory=list)  # processes ranks abandoned, killed
    armed: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> faults armed on it
    fired: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> injected faults that acted
    held: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> where its schedule held it
    began_ns: dict[int, int] = field(default_factory=dict)  # rank -> when its recorder began (time_ns)
    ended_ns: dict[int, int] = field(default_factory=dict)  # rank -> when its body had ended (time_ns)
    duration: float = 0.0
    started_ns: int = 0  # when the run was handed to its ranks (time_ns)
    stopped_at_ns: int = 0
    prepared: bool = False  # the ranks were set up before the test came (``--ddp-prepare``)

    @property
    def stuck(self) -> bool:
        """The ranks were stopped while stuck: at the time limit, in a desync, or waiting for
        ranks that had left."""
        return self.timed_out or self.desynced or self.stall is not None or bool(self.deadlock)

    def taken_out(self, rank: int) -> str | None:
        """How an injected fault took the rank out of the test (``kill``, ``stop``), if one did."""
        fault = self.taking_fault(rank)
        return None if fault is None else str(fault["action"])

    def taking_fault(self, rank: int) -> dict[str, Any] | None:
        """What the injected fault that took the rank out said when it fired, if one did (a kill
        or a stop ends the rank: at most one acts in a run)."""
        return next((i for i in self.fired.get(rank, []) if i.get("action") in ("kill", "stop")), None)

    def told_before_teardown(self) -> dict[int, RankResult]:
        """Of the ranks whose result never came, how their test had ended before the teardown."""
        return {r: res for r, res in self.before_teardown.items() if r not in self.results}

    def died(self, rank: int) -> bool:
        if rank in self.stopped or self.taken_out(rank):
            return False
        ex = self.exits.get(rank)
        return rank not in self.results or (ex is not None and not ex.clean)
