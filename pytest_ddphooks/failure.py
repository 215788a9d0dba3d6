"""A multirank run's outcome: ``classify`` turns what a run observed into a structured verdict
(the root cause, its consequences, where every rank was), ``render`` into what a user reads.

Failures win over xfail, xfail over skip, skip over pass. The first collective the ranks
disagree on is always said first, whether the ranks then hung or not. A rank that only
failed because a peer went away (gloo's "connection closed") is a consequence of that peer,
not a second culprit. Classification needs no ranks: tests build a ``RunReport`` by hand.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
from collections.abc import Set
from dataclasses import dataclass, field

from .faults import parse_point
from .progress import KILLED
from .recorder import collectives, events
from .recorder.clocks import collective_key
from .recorder.timeline import Mismatch, Span, Timeline
from .report import RankExit, RankResult, RunReport
from .stacks import Frame, Stacks, ThreadStack, fatal_error, format_stack, installed, user_frame

# gloo's words for a peer gone, and the store's (``timeline()`` waits on the run's store): a
# rank failing so is most likely a consequence of that peer
PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|Socket closed"
    r"|Connection was likely closed"
)

_STUCK = ("blocked", "running", "frozen", "exchanging")
# root causes, most telling first
DESYNC = "desync"  # the ranks called different collectives
HANG = "hang"  # stopped at the time limit
STALL = "stall"  # stopped early: waiting for ranks that had finished
DEATH = "death"  # a rank process died
FAILURE = "failure"  # a rank's test failed
UNFIRED = "unfired"  # an injected fault's point was never reached: the test tested nothing


@dataclass(frozen=True)
class Blocked:
    """The collective (or its wait, or a receive) a rank was blocked in."""

    op: str
    seq: int | None = None
    group: str = ""  # its label: "the default group", "group 1 (ranks 0,2)"
    waited: float = 0.0  # seconds, when it was stopped
    in_wait: bool = False  # in the wait of an asynchronous call
    peer: int | None = None  # the other end of a send or receive
    no_group: bool = False  # called before any process group existed
    missing: tuple[int, ...] = ()  # members that never entered it
    native: str = ""  # issued from native code (its operator), which waits for it unseen
    future: bool = False  # its completion was handed to a future, waited for unseen
    thread: str = ""  # the thread it was issued on, when not the main one


@dataclass(frozen=True)
class RankState:
    """Where one rank was when the run ended."""

    rank: int
    state: str  # "finished", "died", "blocked", "exchanging" (in timeline()), "running", "frozen", "delayed"
    outcome: str | None = None  # of its test, when it finished
    waited: bool = False  # it finished, then waited for the others
    reason: str = ""  # why the harness stopped it
    hooks: str = ""  # the calls it was inside: "Trainer.fit > Strategy.barrier"
    blocked: Blocked | None = None
    frame: Frame | None = None  # the innermost line of user code it was at
    caller: Frame | None = None  # where the user's project called the installed package ``frame`` is in
    thread_frame: Frame | None = None  # where the thread it is blocked in is, when not the main one
    exit: RankExit | None = None
    last: str = ""  # its last recorded event, for a rank that cannot show its stack
    injected: str = ""  # "killed by the injected fault kill(at=...) at event #14"
    # its body passed, skipped or xfailed (``ended``), or its test failed (``test_failed``): it was
    # tearing its fixtures down
    in_teardown: bool = False
    test_failed: bool = False
    # how its test ended, when it was tearing its fixtures down: "body skipped", "setup skipped"
    # (a skip in a fixture's setup)
    ended: str = "body passed"
    stopped_entering: bool = False  # frozen by an injected stop as it entered ``blocked``, before torch ran it


@dataclass(frozen=True)
class RankFailure:
    """A rank whose result is part of the failure."""

    rank: int
    how: str  # "failed", "died", "consequence" (it failed because ``after`` went away)
    result: RankResult | None = None
    exit: RankExit | None = None
    after: int | None = None
    fatal: tuple[str, ...] = ()  # a "Fatal Python error" with the test's frames
    stderr_tail: tuple[str, ...] = ()
    # it died (or was stopped) in a fixture's teardown: after its body passed, or after its test
    # had failed (``died_after_failing``)
    in_teardown: bool = False

    @property
    def died_after_failing(self) -> bool:
        """It died in its fixtures' teardown after its test had failed: ``result`` says how."""
        r = self.result
        failed = r is not None and r.outcome == "failed" and r.phase != "teardown"
        return self.how == "died" and self.in_teardown and failed


@dataclass
class RunFailure:
    cause: str  # DESYNC, HANG, STALL, DEATH or FAILURE
    phase: str  # where pytest reports it: "setup", "call" or "teardown"
    world_size: int
    limit: float
    duration: float
    culprits: list[int]  # the ranks at the root of it
    held_allowance: float = 0.0  # seconds a schedule's holds were given beyond the limit
    mismatches: list[Mismatch] = field(default_factory=list)
    paired_across_hooks: str | None = None  # a collective entered in different hooks, maybe mispaired
    failures: list[RankFailure] = field(default_factory=list)
    outcomes: dict[int, str] = field(default_factory=dict)  # rank -> outcome of its test, where it finished
    # rank -> a skip or xfail that came in a fixture's setup (no body ran), where it finished
    ended_in_setup: set[int] = field(default_factory=set)
    ranks: dict[int, RankState] = field(default_factory=dict)  # every rank when stuck, else the stopped ones
    stuck: bool = False  # the ranks were stopped as a hang (at the limit, or early)
    desynced: bool = False  # stopped early: blocked in collectives that can never match
    deadlock: list[int] = field(default_factory=list)  # stopped early: these ranks wait for each other
    first_failure: int | None = None
    stall: dict[int, str] = field(default_factory=dict)  # waiting rank -> what it waited in
    left: dict[int, str] = field(default_factory=dict)  # finished rank it waited for -> its outcome
    stacks: dict[int, Stacks] = field(default_factory=dict)  # of the stopped ranks that had not finished
    thread_names: dict[tuple[int, int], str] = field(default_factory=dict)  # (rank, ident) -> name
    main_threads: dict[int, int] = field(default_factory=dict)  # rank -> ident of its main thread
    timeline: Timeline | None = None  # drawn as swimlanes when it tells where ranks were
    trace: str | None = None  # where the timeline was written as a Chrome trace
    injections: list[str] = field(default_factory=list)  # what injected faults did, a line each
    unfired: list[str] = field(default_factory=list)  # faults whose point was never reached
    after_fault: str = ""  # "the injected SIGKILL of rank 1": what a hang came after
    attempts: list[str] = field(default_factory=list)  # how each earlier attempt ended (restarts)
    schedule: list[str] = field(default_factory=list)  # the schedule it failed under (--ddp-explore)
    holds: list[str] = field(default_factory=list)  # where that schedule held which rank
    # rank -> the phase of the other report of the test that holds its failure: beside a body's
    # failure (the call's), a rank whose fixture's teardown alone failed is the teardown's, and
    # the other way round; each report names the rank so, not as passed
    beside: dict[int, str] = field(default_factory=dict)


@dataclass
class Verdict:
    outcome: str  # "passed", "failed", "skipped", "xfailed"
    failure: RunFailure | None = None
    message: str = ""  # the reason of a skip or an xfail
    location: tuple[str, int] | None = None
    teardown: RunFailure | None = None  # a rank's fixture teardown failed (beside the call's outcome)
    # what the verdict is when the test's xfail marker expects its failure: the bodies' failures
    # alone are the call's (``raises`` is checked against them), and what ended the run after
    # them in a fixture's teardown (a death, a hang) is an error in teardown, judged there
    expected: Verdict | None = None


@dataclass
class Rendered:
    message: str  # the one line of the short summary
    text: str  # the whole report
    location: tuple[str, int] | None = None


# -- classification --------------------------------------------------------------------------


def first_failure(results: dict[int, RankResult]) -> int | None:
    """Where results came without the order of their ends (under torchrun): the first rank
    that failed on its own, not because a peer went away."""
    failed = [r for r, res in sorted(results.items()) if res.outcome == "failed"]
    return next((r for r in failed if not PEER_GONE.search(results[r].message)), failed[0] if failed else None)


def _gone_peer(report: RunReport, rank: int) -> int | None:
    """The peer whose end a rank's "connection closed" may follow: the first rank that failed
    or died, else one an injected fault killed."""
    killed = next((r for r in range(report.world_size) if r != rank and report.taken_out(r) == "kill"), None)
    first = report.first_failure
    if first is None or first == rank:
        if killed is not None:
            return killed
        # its error came in before the end of the peer that caused it was noticed: a rank that
        # died, else one that failed of its own (not of a peer gone too)
        others = [r for r in range(report.world_size) if r != rank]
        died = next((r for r in others if report.died(r)), None)
        if died is not None:
            return died
        return next(
            (
                r
                for r in others
                if (res := report.results.get(r)) is not None
                and res.outcome == "failed"
                and not PEER_GONE.search(res.message)
            ),
            None,
        )
    first_result = report.results.get(first)
    if killed is not None and first_result is not None and PEER_GONE.search(first_result.message):
        return killed  # the first to fail only lost its peer too: the killed one went first
    return first


def failed_before_teardown(report: RunReport) -> list[int]:
    """The ranks whose test failed of its own (not of a peer going away) in its body or a
    fixture's setup, whether or not their result came after the teardown."""
    ended = {**report.told_before_teardown(), **report.results}
    return [
        r
        for r, res in ended.items()
        if res.outcome == "failed" and res.phase != "teardown" and not _consequence(report, r, res)
    ]


def _consequence(report: RunReport, rank: int, result: RankResult) -> bool:
    return _gone_peer(report, rank) is not None and bool(PEER_GONE.search(result.message))


def _open_collective(spans: list[Span]) -> Span | None:
    """The call the rank is blocked in: on its main thread; else, when the main thread is in
    none (it joins a thread, or waits on a lock), the latest one another thread entered."""
    inside = [s for s in spans if s.kind in (events.COLLECTIVE, events.P2P, events.WAIT) or _joining(s)]
    main = [s for s in inside if s.start.lane == 0]
    if main:
        return main[-1]
    return max(inside, key=lambda s: s.start.index) if inside else None


def _joining(span: Span) -> bool:
    """init_process_group or new_group: each waits for every rank to call it."""
    info = span.start.info
    return span.kind == events.GROUP and info.get("op") in collectives.JOINS and not info.get("local_sync")


def _unseen_wait(timeline: Timeline, rank: int) -> Span | None:
    """The collective native code issued, or whose completion was handed to a future, last on
    the main thread, when nothing was recorded there after it: it is most likely being waited
    for out of sight (in C++, by DDP's reducer)."""
    main = [e for e in timeline.events_of(rank) if e.lane == 0]
    if not main or main[-1].kind not in (events.COLLECTIVE, events.WAIT) or main[-1].phase != events.END:
        return None
    last = main[-1]
    start = next((e for e in reversed(main) if e.call_id == last.call_id and e.phase == events.START), None)
    if start is None or not (start.info.get("native") or start.info.get("future")):
        return None
    return Span(rank, start.name, start.kind, start, last)


def _hooks(spans: list[Span]) -> str:
    names = [s.start.info.get("qualname") or s.name for s in spans if s.kind in (events.CALL, events.BARRIER)]
    return " > ".join(str(n) for n in names)


def _blocked(span: Span, timeline: Timeline, now_ns: int) -> Blocked:
    info = span.start.info
    op = str(info.get("op", span.name))
    waited = max(now_ns - span.start.t_ns, 0) / 1e9
    in_wait = span.kind == events.WAIT
    lane = span.start.lane
    thread = "" if lane == 0 else str(timeline.lanes.get((span.rank, lane)) or f"lane {lane}")
    if info.get("sync") in (collectives.SEND, collectives.RECV):
        peer = info.get("dst") if info.get("sync") == collectives.SEND else info.get("src")
        return Blocked(
            op,
            waited=waited,
            in_wait=in_wait,
            peer=None if peer is None else timeline.lane_of(peer, span.start),
            thread=thread,
        )
    if not info.get("effective", True):
        return Blocked(op, waited=waited, no_group=True, thread=thread)
    if span.kind == events.GROUP:
        return Blocked(op, waited=waited, thread=thread)
    label = collectives.group_label(str(info.get("group")), info.get("ranks"))
    missing: tuple[int, ...] = ()
    inst = timeline.instances.get(collective_key(info))
    if inst is not None:
        missing = tuple(m for m in inst.members if m not in inst.starts)
    seq = info.get("seq")
    native = str(info.get("native") or "")
    return Blocked(
        op,
        None if seq is None else int(seq),
        label,
        waited,
        in_wait,
        missing=missing,
        thread=thread,
        native=native,
        future=bool(info.get("future")),
    )


_FAULTS_FILE = os.path.join("pytest_ddphooks", "faults.py")


def _in_injected_delay(report: RunReport, rank: int, stack: ThreadStack | None) -> bool:
    """The rank sleeps in a delay a fault injected (its main thread is in the fault's sleep)."""
    fired = report.fired.get(rank)
    if not fired or fired[-1].get("action") != "delay" or stack is None or not stack.frames:
        return False
    return any(f.path.endswith(_FAULTS_FILE) for f in stack.frames[:3])


def rank_state(report: RunReport, rank: int) -> RankState:
    """Where one rank was: finished, died, blocked in a collective (and who never came),
    frozen, or running; with the calls it was inside and the line of user code."""
    result = report.results.get(rank)
    reason = report.stopped.get(rank, "")
    injected = injection_words(report, rank)
    if result is not None:
        return RankState(rank, "finished", result.outcome, waited=rank in report.stopped, reason=reason)
    if rank not in report.stopped:
        return RankState(rank, "died", exit=report.exits.get(rank), injected=injected)
    timeline = report.timeline
    spans = timeline.open_spans(rank) if timeline is not None else []
    span = _open_collective(spans)
    if span is None and timeline is not None:
        span = _unseen_wait(timeline, rank)
    blocked = _blocked(span, timeline, report.stopped_at_ns) if span is not None and timeline is not None else None
    stacks = report.stacks.get(rank)
    stack = stacks.main(report.thread_idents.get((rank, 0))) if stacks is not None else None
    frame = user_frame(stack) if stack is not None else None
    thread_frame = None
    if blocked is not None and blocked.thread and span is not None and stacks is not None:
        # blocked in another thread: where that thread is, beside where the main one is
        ident = report.thread_idents.get((rank, span.start.lane))
        other = next((t for t in stacks.threads if ident is not None and t.ident == ident), None)
        thread_frame = user_frame(other) if other is not None else None
    in_package = stack is not None and frame is not None and installed(frame.path)
    caller = user_frame(stack, outside_installed=True) if stack is not None and in_package else None
    state = (
        "frozen"
        if rank in report.frozen
        else "delayed"
        if _in_injected_delay(report, rank, stack)
        else "blocked"
        if blocked is not None
        else "exchanging"
        if rank in report.exchanging
        else "running"
    )
    last = ""
    if state == "frozen" and timeline is not None:
        seen = timeline.events_of(rank)
        last = seen[-1].describe() if seen else "nothing recorded"
    fault = report.taking_fault(rank) if state == "frozen" else None
    # an injected stop at a collective acts as the rank enters it, before torch is called
    entering = (
        fault is not None
        and span is not None
        and fault.get("phase") == events.START
        and fault.get("call_id") == span.start.call_id
    )
    return RankState(
        rank,
        state,
        reason=reason,
        hooks=_hooks(spans),
        blocked=blocked,
        frame=frame,
        caller=caller,
        thread_frame=thread_frame,
        last=last,
        injected=injected,
        stopped_entering=entering,
    )


_DONE_BY = {"kill": "killed by", "stop": "stopped by", "delay": "delayed by", "raise": "made to raise by"}


def _event_of(report: RunReport, rank: int, info: dict[str, object]) -> int | None:
    """The index of the event an injected fault acted at."""
    if report.timeline is None:
        return None
    for e in report.timeline.events_of(rank):
        if e.call_id == info.get("call_id") and e.phase == info.get("phase"):
            return e.index
    return None


def injection_words(report: RunReport, rank: int) -> str:
    """``killed by the injected fault kill(at='dist.all_reduce#2') at event #14``"""
    fired = report.fired.get(rank)
    if not fired:
        return ""
    info = fired[-1]
    index = _event_of(report, rank, info)
    where = f" at event #{index}" if index is not None else ""
    if info.get("action") == "kill" and rank in report.results:
        # a signal the rank handles or ignores (SIGWINCH, SIGCONT, its own SIGTERM handler)
        return (
            f"sent the signal of the injected fault {info.get('fault')}{where}, and lived on (it handles or ignores it)"
        )
    return f"{_DONE_BY.get(str(info.get('action')), 'hit by')} the injected fault {info.get('fault')}{where}"


def _calls_of(report: RunReport, rank: int, at: str) -> str:
    """How often the rank reached what a point counts: ``rank 1 made 1 all_reduce call``."""
    point = parse_point(at)
    found = report.timeline.events_of(rank) if report.timeline is not None else []
    matching = [e for e in found if point.matches(e.kind, e.phase, e.name)]
    n = len(matching)
    if point.name.startswith("dist.") and point.phase == "start":
        op = point.name.removeprefix("dist.")
        # read from torch's flight recorder afterwards: no point a fault could act at
        unseen = sum(1 for e in matching if e.info.get("native"))
        if not unseen:
            return f"rank {rank} made {n} {op} call{'' if n == 1 else 's'}"
        return (
            f"rank {rank} made {n - unseen} {op} call{'' if n - unseen == 1 else 's'} a fault can act at, and"
            f" {unseen} more that native code issued (DDP's gradient buckets, a compiled graph) or that a Recorder"
            " of the test's own took, which the harness sees only afterwards (for DDP, a Python comm hook makes"
            " each bucket's all-reduce a point)"
        )
    what = {"start": "started", "end": "ended", "point": "marked"}[point.phase]
    return f"rank {rank} {what} {point.name!r} {n} time{'' if n == 1 else 's'}"


def _unfired(report: RunReport) -> list[str]:
    """Faults armed on a rank that finished the test without reaching their point."""
    out = _armed_elsewhere(report)
    n = report.world_size
    if n and all(report.taken_out(r) for r in range(n)):
        out.append(
            f"no rank finished the test: injected faults took out {ranks_words(list(range(n)))}, so nothing"
            " after them was tested (leave a rank to see what follows the fault)"
        )
    for rank, armed in sorted(report.armed.items()):
        # an injected fault that took the rank out leaves its later faults nothing to act on
        taken = report.taking_fault(rank)
        if taken is None and not _finished_well(report, rank):
            continue  # it did not finish, or failed: whatever ended it is the story
        fired = {info.get("fault") for info in report.fired.get(rank, [])}
        for info in armed:
            if "for" in info or info.get("refused"):
                continue  # armed for others, or refused as armed past its point (the test saw why)
            if taken is not None:
                if "later" not in info and info.get("call") not in fired:
                    out.append(
                        f"injected fault {info.get('fault')} never fired: rank {rank} was"
                        f" {_DONE_BY.get(str(taken.get('action')), 'hit by')} the injected fault {taken.get('fault')}"
                        " first"
                    )
                continue
            if "later" in info:
                out.append(
                    f"injected fault {info.get('fault')} never fired: attempt {info['later']} never ran"
                    f" (the test ended in attempt {info.get('now')})"
                )
            elif info.get("call") not in fired:
                out.append(
                    f"injected fault {info.get('fault')} never fired: {_calls_of(report, rank, str(info['at']))}"
                )
    return out


def _finished_well(report: RunReport, rank: int) -> bool:
    """The rank ran the test to its end (a failure before the fault's point, the FaultError of
    arming it late, or a skip is the story then)."""
    result = report.results.get(rank)
    return result is not None and result.outcome == "passed"


def _armed_elsewhere(report: RunReport) -> list[str]:
    """Faults a rank armed for other ranks that finished the test without arming them: a
    fault acts only where it is armed, so it never could."""
    own = {(r, info.get("call")) for r, armed in report.armed.items() for info in armed if "for" not in info}
    out: dict[tuple[str, int], list[int]] = {}
    for by, armed in sorted(report.armed.items()):
        for info in armed:
            for target in info.get("for", ()):
                if _finished_well(report, target) and (target, info.get("call")) not in own:
                    out.setdefault((str(info.get("call")), target), []).append(by)
    return [
        f"injected fault {call.replace('(', f'(rank={target}, ', 1)} never fired: rank {target}, where it acts,"
        " never armed it"
        f" ({ranks_words(sorted(set(by)))} did; a fault acts only on a rank that arms it: arm it on every rank)"
        for (call, target), by in sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    ]


def _tail(text: str, lines: int = 25) -> tuple[str, ...]:
    rows = text.rstrip("\n").splitlines()
    if len(rows) > lines:
        return (f"[... {len(rows) - lines} earlier lines]", *rows[-lines:])
    return tuple(rows)


def _phase(report: RunReport, cause: str, failures: list[RankFailure], setup_done: set[int] | None) -> str:
    """Where pytest reports the failure: in the fixture setup or teardown when every rank
    at its root failed there, or stopped before it had set up; else in the call."""
    if cause in (FAILURE, DEATH):
        roots = [f for f in failures if f.how != "consequence"]
        phases = {_rank_phase(f, setup_done) for f in roots}
        if len(phases) == 1 and None not in phases:
            return str(phases.pop())
        return "setup" if "setup" in phases else "call"
    if setup_done is not None and any(r not in setup_done and r not in report.results for r in report.stopped):
        return "setup"
    return "call"


def _rank_phase(f: RankFailure, setup_done: set[int] | None) -> str | None:
    """Where one rank failed: its result says (a skip or xfail, of its body or in a fixture's
    setup, that it then died after: its teardown); a rank that died without one, what it had reached (None: not known,
    the call)."""
    if f.result is not None and f.result.outcome != "failed" and f.in_teardown:
        return "teardown"  # a skip (of its body, or in a fixture's setup) is the call's; the death came after it
    if f.result is not None:
        return f.result.phase
    if setup_done is not None and f.rank not in setup_done:
        return "setup"
    return "teardown" if f.in_teardown else None


def classify(report: RunReport, setup_done: set[int] | None = None, body_passed: Set[int] = frozenset()) -> Verdict:
    """The verdict of a run. ``setup_done``: the ranks known to have set up their fixtures
    (None when the run does not say), to tell a failure during setup from one in the call;
    ``body_passed``: those whose body passed, so that dying then was in a fixture's teardown."""
    split = _teardown_apart(report, setup_done, body_passed)
    if split is not None:
        return split
    n = report.world_size
    timeline = report.timeline
    mismatches = timeline.collective_mismatches() if timeline is not None else []
    # ranks whose body failed, skipped or xfailed, then died, were stopped or taken out by a
    # fault in their fixtures' teardown; those whose failure was a peer going away failed after
    # it, as ever
    told = report.told_before_teardown()
    failed_first = {r: res for r, res in told.items() if res.outcome == "failed"}
    after_peer = {r for r, res in failed_first.items() if _consequence(report, r, res)}
    died = [r for r in range(n) if report.died(r) and r not in after_peer]
    results = {**told, **report.results}
    failed = sorted(
        r for r, res in results.items() if res.outcome == "failed" and (r in report.results or r not in died)
    )
    primary = [r for r in failed if not _consequence(report, r, results[r])]
    if mismatches and not failed and not died and not report.stuck and _expected(report):
        mismatches = []  # the test provoked them and looked at them itself (gloo ran them): it passes
    failures = []
    for r in range(n):
        if r in died:
            ex = report.exits.get(r)
            err = report.outputs.get(r, ("", ""))[1]
            fatal = tuple(fatal_error(err))
            tail = () if fatal else _tail(err)
            result = results.get(r)
            torn = r in body_passed or r in told
            failures.append(RankFailure(r, "died", result, ex, fatal=fatal, stderr_tail=tail, in_teardown=torn))
        elif r in failed:
            how = "failed" if r in primary else "consequence"
            after = None if how == "failed" else _gone_peer(report, r)
            torn = r in failed_first  # then stopped or taken out in its teardown
            failures.append(RankFailure(r, how, results[r], report.exits.get(r), after, in_teardown=torn))
    unfired = _unfired(report)
    if mismatches:
        cause = DESYNC
    elif report.timed_out or report.desynced or report.deadlock:
        cause = HANG
    elif report.stall is not None:
        cause = STALL
    elif died:
        cause = DEATH
    elif failed:
        cause = FAILURE
    elif unfired:
        cause = UNFIRED
    else:
        return _quiet_verdict(report)
    if report.stuck:
        states = {r: rank_state(report, r) for r in range(n)}
        culprits = sorted(r for r, st in states.items() if st.state in _STUCK)
    else:
        states = {r: rank_state(report, r) for r in sorted(report.stopped)}
        culprits = sorted(set(primary) | set(died)) or failed
    states = {
        r: dataclasses.replace(st, in_teardown=True, test_failed=r in failed_first, ended=_ended(told.get(r)))
        if st.state in _STUCK and (r in body_passed or r in told)
        else st
        for r, st in states.items()
    }
    phase = _phase(report, cause, failures, setup_done)
    if cause in (HANG, STALL) and n and all(_body_ended(report, r, body_passed) for r in range(n)):
        phase = "teardown"  # no body failed or ran on: what never ended was a fixture's teardown
    failure = RunFailure(
        cause=cause,
        phase=phase,
        world_size=n,
        limit=report.limit,
        duration=report.duration,
        held_allowance=report.held_allowance,
        culprits=culprits,
        mismatches=mismatches,
        paired_across_hooks=(
            timeline.entered_in_different_hooks() if timeline is not None and cause in (DESYNC, HANG, STALL) else None
        ),
        failures=failures,
        outcomes={r: res.outcome for r, res in report.results.items()},
        ended_in_setup={r for r, res in report.results.items() if res.outcome != "failed" and res.phase == "setup"},
        ranks=states,
        stuck=report.stuck,
        desynced=report.desynced,
        deadlock=list(report.deadlock),
        first_failure=report.first_failure,
        stall=_stalled(report, states),
        left=dict(report.stall.left) if report.stall is not None else {},
        stacks={r: s for r, s in report.stacks.items() if r not in report.results},
        thread_names=_thread_names(report),
        main_threads={r: ident for (r, lane), ident in report.thread_idents.items() if lane == 0},
        timeline=timeline if timeline is not None and timeline.events else None,
        injections=[f"rank {r} was {injection_words(report, r)}" for r in sorted(report.fired)],
        unfired=unfired,
        after_fault=", ".join(
            f"the injected {report.fired[r][-1].get('sign')} of rank {r}"
            for r in sorted(report.fired)
            if report.fired[r]
        ),
    )
    if failure.phase == "teardown" and cause in (FAILURE, DEATH, HANG, STALL):
        # the call is what the bodies did (passed, or skipped or xfailed on some ranks)
        return dataclasses.replace(_quiet_verdict(_bodies(report)), teardown=failure)
    verdict = Verdict("failed", failure)
    ended = all(r in report.results or r in body_passed or r in told for r in range(n))
    if cause in (DEATH, HANG, STALL) and phase == "call" and ended:
        # every rank that never ended its test was in its teardown: the bodies' failures are
        # the call, the death or hang an error in teardown, when an xfail expects the failure
        bodies = _bodies(report)
        call = classify(RunReport(n, report.limit, results=bodies.results))
        if call.failure is not None:
            call.failure.first_failure = report.first_failure
            verdict.expected = dataclasses.replace(call, teardown=dataclasses.replace(failure, phase="teardown"))
    return verdict


def _bodies(report: RunReport) -> RunReport:
    """The run as its bodies ended: a rank whose fixture's teardown alone failed, or that was
    tearing down when it died or was stopped, passed; one that said its body's outcome before
    its teardown has that outcome."""
    results = {}
    for r in range(report.world_size):
        res = report.results.get(r) or report.before_teardown.get(r)
        if res is None or (res.outcome == "failed" and res.phase == "teardown"):
            res = RankResult(r, "passed")
        results[r] = dataclasses.replace(res, teardown_error=None)
    return RunReport(report.world_size, report.limit, results=results)


def _ended(result: RankResult | None) -> str:
    """How a rank's test ended before its fixtures' teardown: ``body passed``, ``body xfailed``,
    ``setup skipped`` (a skip in a fixture's setup: no body ran)."""
    if result is None:
        return "body passed"
    return f"{'setup' if result.phase == 'setup' else 'body'} {result.outcome}"


def _teardown_apart(report: RunReport, setup_done: set[int] | None, body_passed: Set[int]) -> Verdict | None:
    """The verdict of a run where fixtures' teardown failed beside what the bodies did, as pytest
    reports a plain test's failing finalizer: the call is what the bodies (or fixtures' setup)
    did, the teardown's error is that of the ranks whose teardown failed after their body or
    setup had failed or skipped, or after another rank's body had failed (an exception, or a
    death after the rank's body ended well). A rank whose teardown error is a peer going away
    after another rank's failure stays that failure's consequence, in the call. None: nothing to
    part. Each report names the ranks whose failure the other holds (``RunFailure.beside``)."""
    n = report.world_size
    told = report.told_before_teardown()
    own = failed_before_teardown(report)
    errors = {r: res.teardown_error for r, res in report.results.items() if res.teardown_error is not None}
    alone = {
        r: res
        for r, res in report.results.items()
        if res.outcome == "failed" and res.phase == "teardown" and not (own and _consequence(report, r, res))
    }
    # a rank that died in its teardown after its body passed, skipped or xfailed (a hang is one
    # story of every rank: it stays whole)
    dead = [
        r
        for r in range(n)
        if r not in report.results
        and report.died(r)
        and not report.stuck
        and (r in body_passed or (r in told and told[r].outcome != "failed"))
    ]
    if not errors and not ((alone or dead) and own):
        return None
    calls = {
        r: dataclasses.replace(res, outcome="passed", longrepr="", message="", phase="call", teardown_error=None)
        if r in alone
        else dataclasses.replace(res, teardown_error=None)
        for r, res in report.results.items()
    }
    calls.update((r, told.get(r) or RankResult(r, "passed")) for r in dead)
    call = classify(
        dataclasses.replace(
            report,
            results=calls,
            before_teardown={r: res for r, res in report.before_teardown.items() if r not in dead},
            exits={r: ex for r, ex in report.exits.items() if r not in dead},
            # a rank that had finished, stopped as the run ended at a death: the teardown's story
            stopped={r: why for r, why in report.stopped.items() if r not in report.results or not dead},
        ),
        setup_done,
        body_passed,
    )
    torn = {**{r: err for r, err in errors.items() if err is not None}, **alone}
    # the other ranks as their bodies ended; one whose body failed passed as far as the teardown goes
    others = {r: dataclasses.replace(res, teardown_error=None) for r, res in calls.items() if r not in torn}
    results = {
        **{r: RankResult(r, "passed") if res.outcome == "failed" else res for r, res in others.items()},
        **torn,
    }
    # ranks the harness stopped before they ended (the run ended at the failure): stopped in this
    # report too, never taken for dead
    gone = {r for r in report.stopped if r not in report.results and r not in dead}
    apart = RunReport(
        n,
        report.limit,
        results={r: res for r, res in results.items() if r not in dead},
        before_teardown={r: res for r, res in told.items() if r in dead},
        exits={r: ex for r, ex in report.exits.items() if r in dead or r in gone},
        stopped={r: why for r, why in report.stopped.items() if r in gone},
        outputs=report.outputs,
        timeline=report.timeline if dead else None,
        duration=report.duration,
    )
    held = classify(apart, setup_done, body_passed)
    teardown = held.teardown or held.failure
    assert teardown is not None
    teardown.phase = "teardown"
    if call.failure is not None:
        failing = {rf.rank for rf in call.failure.failures}
        torn_down = {rf.rank for rf in teardown.failures}
        teardown.beside = {r: call.failure.phase for r in failing - torn_down}
        call.failure.beside = {r: "teardown" for r in torn_down - failing}
    return dataclasses.replace(call, teardown=call.teardown or teardown)


def _expected(report: RunReport) -> bool:
    """The test's body found every mismatch of the run itself (``collective_mismatches()``), as
    the members finally called it, and every member completed it (gloo ran it to its end)."""
    assert report.timeline is not None
    seen = {key: calls for result in report.results.values() for key, calls in result.mismatches_checked.items()}
    return all(done and seen.get(key) == calls for key, (calls, done) in report.timeline.mismatched().items())


def _body_ended(report: RunReport, rank: int, body_passed: Set[int]) -> bool:
    """The rank's body ended without failing: it said so (it passed, or it skipped or xfailed
    before its teardown), or it finished the whole test passing, skipped or xfailed."""
    result = report.results.get(rank) or report.before_teardown.get(rank)
    return rank in body_passed or (result is not None and result.outcome in ("passed", "skipped", "xfailed"))


def _stalled(report: RunReport, states: dict[int, RankState]) -> dict[int, str]:
    """Who waited for ranks that had finished, and in what: as the watchdog saw it, and every
    other rank found blocked in a call those ranks never entered once all were stopped."""
    if report.stall is None:
        return {}
    out = dict(report.stall.waiting)
    left = set(report.stall.left)
    for r, st in states.items():
        b = st.blocked
        if r in out or st.state != "blocked" or b is None:
            continue
        if b.peer is not None and b.op in ("recv", "send") and b.peer in left:
            out[r] = f"{b.op} {'from' if b.op == 'recv' else 'to'} rank {b.peer}"
        elif b.peer is None and set(b.missing) & left:
            out[r] = f"{b.op} #{b.seq} on {b.group}"
    return out


def _thread_names(report: RunReport) -> dict[tuple[int, int], str]:
    if report.timeline is None:
        return {}
    return {(r, ident): report.timeline.lanes.get((r, lane), "") for (r, lane), ident in report.thread_idents.items()}


def _quiet_verdict(report: RunReport) -> Verdict:
    results = sorted(report.results.items())
    for outcome in ("xfailed", "skipped"):
        ranks = [r for r, res in results if res.outcome == outcome]
        if ranks:
            first = report.results[ranks[0]]
            return Verdict(outcome, message=_merged_reasons(report, ranks), location=first.location)
    return Verdict("passed")


def _merged_reasons(report: RunReport, ranks: list[int]) -> str:
    """Why ``ranks`` skipped (or xfailed), as one reason: each rank's own where they differ,
    and which ranks when not all did (the others passed)."""
    reasons: dict[str, list[int]] = {}
    for r in ranks:
        reasons.setdefault(report.results[r].message, []).append(r)
    passed = "; the other ranks passed" if len(ranks) < report.world_size else ""
    if len(reasons) == 1:
        return report.results[ranks[0]].message + (f" (on {ranks_words(ranks)}{passed})" if passed else "")
    # each as pytest shows a skip's reason: without the "Skipped: " it only strips at the start
    text = "; ".join(f"{why.removeprefix('Skipped: ')} (on {ranks_words(rs)})" for why, rs in reasons.items())
    return text + passed


# -- rendering -------------------------------------------------------------------------------


def ranks_words(ranks: list[int]) -> str:
    """``rank 2``, ``ranks 0,1``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def _sameness(result: RankResult) -> tuple[object, ...]:
    """What makes two ranks' failures the same: the phase, the line, and the traceback but
    for the rank's own number (``rank = 1``) and where objects happen to live in memory."""
    text = _OWN_RANK.sub("", result.longrepr)
    return (result.phase, result.location, _ADDRESS.sub(" at 0x", text))


_OWN_RANK = re.compile(r"^\s*rank\s*= \d+\n", re.MULTILINE)
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _first(message: str, limit: int = 300) -> str:
    """A failure's message on one line: its first, and when that only announces what follows
    (it ends in ':'), the lines of its first paragraph after it."""
    lines = message.splitlines()
    if not lines:
        return message
    said = lines[0]
    if said.endswith(":"):
        for line in lines[1:]:
            if not line.strip():
                break
            said += " " + line.strip()
    return said if len(said) <= limit else said[: limit - 3] + "..."


def _exit_words(ex: RankExit | None) -> str:
    return ex.describe() if ex is not None else "no exit status"


def describe_blocked(b: Blocked) -> str:
    what = f"the wait of {b.op}" if b.in_wait else b.op
    waited = f"{b.waited:.1f} s" + (f", in thread {b.thread}" if b.thread else "")
    if b.peer is not None:
        return f"blocked in {what} (peer {b.peer}) for {waited}"
    if b.no_group:
        return f"blocked in {b.op} without a process group for {waited}"
    if b.native:
        return f"waiting in {b.op} #{b.seq} on {b.group}, issued from native code ({b.native}), for {waited}"
    if b.future:
        return f"waiting for {b.op} #{b.seq} on {b.group}, handed to a future (Work.get_future), for {waited}"
    if b.seq is None:  # init_process_group, new_group: every rank's call of it is awaited
        return f"blocked in {what} for {waited}"
    return f"blocked in {what} #{b.seq} on {b.group} for {waited}"


def describe_state(s: RankState, stuck: bool) -> list[str]:
    """The lines saying where a rank was (``stuck``: the run was stopped as a hang)."""
    if s.state == "finished":
        waited = ", then waited for the other ranks" if s.waited else ""
        return [f"rank {s.rank}: finished the test body ({s.outcome}){waited}"]
    if s.state == "died":
        if s.injected:
            return [f"rank {s.rank}: {s.injected}"]
        return [f"rank {s.rank}: died ({_exit_words(s.exit)})"]
    where = f", in {s.hooks}" if s.hooks else ""
    if s.in_teardown:
        where += ", in a fixture's teardown after its " + ("test failed (below)" if s.test_failed else s.ended)
    head = f"rank {s.rank}: " if stuck else f"rank {s.rank}: {s.reason}; it was "
    lines = []
    if s.state == "frozen":
        lines.append(f"{head}stopped (SIGSTOP){where}" + (f": {s.injected}" if s.injected else ""))
        if s.blocked is not None:
            b = s.blocked
            place = f"{b.op} #{b.seq} on {b.group}" if b.seq is not None else b.op
            # frozen, it waits for nothing: how long it has been inside says nothing about its peers
            if s.stopped_entering:
                lines.append(f"  it was stopped as it entered {place}, not yet inside it")
            else:
                lines.append(f"  it was stopped inside {'the wait of ' if b.in_wait else ''}{place}")
        if s.last:
            lines.append(f"  its last recorded event: {s.last}")
    elif s.state == "delayed":
        entering = f" as it entered {s.blocked.op} #{s.blocked.seq} on {s.blocked.group}" if s.blocked else ""
        lines.append(f"{head}{s.injected}: sleeping there{entering}, not yet inside it{where}")
    elif s.blocked is not None:
        lines.append(f"{head}{describe_blocked(s.blocked)}{where}")
        if s.blocked.missing:
            who = ", ".join(str(m) for m in s.blocked.missing)
            lines.append(f"  ranks that never entered {s.blocked.op} #{s.blocked.seq}: {who}")
    elif s.state == "exchanging":
        lines.append(f"{head}waiting in timeline() for the other ranks to call it{where}")
    else:
        lines.append(f"{head}{'still running' if stuck else 'running'}{where}")
    if s.frame is not None:
        lines.append(f"  {'stuck at' if stuck else 'at'} {s.frame.describe()}")
    if s.caller is not None:
        lines.append(f"    called from {s.caller.describe()}")
    if s.thread_frame is not None and s.blocked is not None:
        lines.append(f"  thread {s.blocked.thread} at {s.thread_frame.describe()}")
    return lines


def interrupted_lines(label: str, report: RunReport) -> tuple[list[str], Frame | None]:
    """Where each rank of a run the user interrupted (Ctrl-C) was, as a hang says it; and the
    line of the test's code the first rank that was at one was at (pytest names a plain test's)."""
    lines = [f"ddphooks: {label} was interrupted after {report.duration:.1f} s; where its ranks were:"]
    states = [rank_state(report, rank) for rank in range(report.world_size)]
    for state in states:
        lines.extend("  " + line for line in describe_state(state, stuck=True))
    return lines, next((st.caller or st.frame for st in states if st.frame is not None), None)


_P2P_HALVES = {"recv from ": "a send to", "send to ": "a recv from"}


def _stall_lines(f: RunFailure) -> list[str]:
    """``rank 1 finished the test without calling timeline(); rank 0 waits in it``"""
    killed = sorted(r for r, how in f.left.items() if how == KILLED)
    finished = sorted(r for r in f.left if r not in killed)
    who = ranks_words(finished)
    waiting: dict[str, list[int]] = {}
    for rank, what in sorted(f.stall.items()):
        waiting.setdefault(what, []).append(rank)
    lines = []
    for what, ranks in waiting.items():
        wait = f"wait{'s' if len(ranks) == 1 else ''}"
        if killed:
            lines.append(
                f"{ranks_words(killed)}, killed by the injected fault, can never take part in {what};"
                f" {ranks_words(ranks)} {wait} in it"
            )
            if not finished:
                continue
        # of a receive or a send, what the finished rank left out is the other half
        half = next((other for mine, other in _P2P_HALVES.items() if what.startswith(mine)), None)
        if half is not None:
            them = ranks_words(ranks)
            lines.append(f"{who} finished the test without {half} {them}; {them} {wait} in {what}")
        else:
            lines.append(f"{who} finished the test without calling {what}; {ranks_words(ranks)} {wait} in it")
    return lines


def _hang_lines(f: RunFailure) -> list[str]:
    early = f"hang: the ranks were stopped after {f.duration:.1f} s, not at the {f.limit:g} s limit:"
    if f.stall:
        gone = "were killed by an injected fault" if set(f.left.values()) == {KILLED} else "finished the test"
        head = [early + f" they wait for ranks that {gone}", *("  " + ln for ln in _stall_lines(f))]
    elif f.desynced and any(st.state == "finished" for st in f.ranks.values()):
        # gloo let one side of the mismatched collective return: the other waits for ever
        head = [early + " they are blocked in a collective that can never match what the finished ranks called"]
    elif f.desynced:
        head = [early + " they are blocked in collectives that can never match"]
    elif f.deadlock and any(f.ranks[r].state == "exchanging" for r in f.deadlock if r in f.ranks):
        head = [early + f" {ranks_words(f.deadlock)} wait for each other (a deadlock): timeline() against a collective"]
    elif f.deadlock:
        head = [early + f" {ranks_words(f.deadlock)} wait for each other in different collectives (a deadlock)"]
    else:
        head = [f"hang: the test did not finish within {f.limit:g} s ({f.world_size} ranks)"]
        if f.held_allowance:
            head[0] += f", nor in the {f.held_allowance:.1f} s more given to the schedule's holds"
    if f.after_fault and not f.stall and not f.desynced and not f.deadlock:
        head[0] += f", after {f.after_fault}"
    for rank in sorted(f.ranks):
        head.extend("  " + line for line in describe_state(f.ranks[rank], stuck=True))
    return head


def _stack_lines(f: RunFailure) -> list[str]:
    lines: list[str] = []
    for rank in sorted(r for r, st in f.ranks.items() if st.state == "frozen"):
        lines.extend(["", f"rank {rank}: no stack (stopped by SIGSTOP: it runs no code until continued)"])
    for rank in sorted(f.stacks):
        stacks = f.stacks[rank]
        lines.append("")
        if not stacks.threads:
            lines.append(f"rank {rank}: no stack (the rank did not answer)")
            continue
        main = f.main_threads.get(rank)
        shown = [
            t
            for t in sorted(stacks.threads, key=lambda t: t.ident != main)
            if t.ident == main or not _harness_thread(t)
        ]
        for i, t in enumerate(shown):
            label = f.thread_names.get((rank, t.ident)) or (
                "MainThread" if t.ident == main else f"thread {t.name}" if t.name else f"thread 0x{t.ident:x}"
            )
            if i:
                lines.append("")
            lines.extend(format_stack(t, f"rank {rank} stack, {label}"))
    return lines


_HARNESS = os.path.join("pytest_ddphooks", "")
_DETAIL_CRASH = (
    "TORCH_DISTRIBUTED_DEBUG=DETAIL is set: with it torch 2.13 crashes (SIGSEGV) building DDP in a process"
    " forked from one that had loaded torch.distributed, as ranks here are (torch.multiprocessing with"
    " start_method='fork' crashes the same): unset it for this test"
)


def _harness_thread(t: ThreadStack) -> bool:
    """A thread of the harness itself in a rank (it answers the watchdog): not the test's."""
    return user_frame(t) is None and any(_HARNESS in frame.path for frame in t.frames)


def _died_lines(rf: RankFailure) -> list[str]:
    when = ""
    if rf.result is None:
        when = " in a fixture's teardown, after its body passed" if rf.in_teardown else " before it could report"
    elif rf.died_after_failing:
        when = " in a fixture's teardown, after its test had failed (below)"
    elif rf.in_teardown and rf.result.outcome in ("skipped", "xfailed"):
        when = f" in a fixture's teardown, after its {_ended(rf.result)}"
    lines = [f"rank {rf.rank} died: {_exit_words(rf.exit)}{when}"]
    if getattr(rf.exit, "signal", None) == signal.SIGSEGV and os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL":
        lines.append(f"  {_DETAIL_CRASH}")
    if rf.fatal:
        lines.extend("  " + ln for ln in rf.fatal)
    elif rf.stderr_tail:
        lines.append(f"  last output of rank {rf.rank} on stderr:")
        lines.extend("    " + ln for ln in rf.stderr_tail)
    return lines


def _summary(f: RunFailure) -> list[str]:
    """'multirank test failed on ...', then a line per rank."""
    lines = [f"multirank test failed on {ranks_words(f.culprits)} of {f.world_size}"]
    by_rank = {rf.rank: rf for rf in f.failures}
    for r in range(f.world_size):
        rf = by_rank.get(r)
        if rf is not None and rf.died_after_failing:
            assert rf.result is not None
            lines.append(f"  rank {r}: failed: {_first(rf.result.message)}")
            lines.append(f"    then died in fixture teardown ({_exit_words(rf.exit)})")
        elif rf is not None and rf.how == "died":
            ended = rf.result is None or rf.result.outcome in ("skipped", "xfailed")
            where = " in fixture teardown" if rf.in_teardown and ended else ""
            lines.append(f"  rank {r}: died{where} ({_exit_words(rf.exit)})")
        elif rf is not None and rf.how == "consequence":
            message = _first(rf.result.message) if rf.result is not None else ""
            lines.append(f"  rank {r}: failed after rank {rf.after}, because its peer went away: {message}")
            at = rf.result.raised_at if rf.result is not None else None
            if at is not None:
                lines.append(f"    at {Frame(*at).describe()}")
        elif rf is not None and rf.result is not None:
            where = "" if rf.result.phase == "call" else f" in fixture {rf.result.phase}"
            lines.append(f"  rank {r}: failed{where}: {_first(rf.result.message)}")
        elif r in f.beside:
            how = f"{'setup' if r in f.ended_in_setup else 'body'} {f.outcomes.get(r, 'passed')}"
            lines.append(f"  rank {r}: {_beside_words(f.beside[r], how)}")
        elif r in f.outcomes:
            lines.append(f"  rank {r}: {f.outcomes[r]}")
        elif r in f.ranks:
            lines.extend("  " + ln for ln in describe_state(f.ranks[r], stuck=False))
    return lines


def _beside_words(phase: str, ended: str) -> str:
    """A rank whose failure the test's other report holds (at ``phase``), as this one names it;
    ``ended``: how its body (or, for a skip there, its setup) ended."""
    if phase == "teardown":
        return f"{ended}; its fixture teardown failed (see the error at teardown)"
    if phase == "setup":
        return "its fixture setup failed (see the error at setup)"
    return "its body failed (see the call)"


def _message(f: RunFailure) -> tuple[str, tuple[str, int] | None]:
    if f.mismatches:
        return f"desync: {f.mismatches[0]}", None
    if f.cause == UNFIRED:
        return f.unfired[0], None
    if f.stall:
        return _stall_lines(f)[0], None
    if f.stuck:
        head = f"deadlock of {ranks_words(f.deadlock)}" if f.deadlock else f"hang after {f.limit:g} s"
        for rank in sorted(f.ranks):
            st = f.ranks[rank]
            if st.state in _STUCK:
                return f"{head}; {describe_state(st, stuck=True)[0]}", None
        return head, None
    dead = [rf for rf in f.failures if rf.how == "died"]
    first_result = dead[0].result if dead and dead[0].died_after_failing else None
    if first_result is not None:
        # said on the first line: a summary shows only that one
        line, _, rest = first_result.message.partition("\n")
        then = f"then it died in fixture teardown: {_exit_words(dead[0].exit)}"
        return f"rank {dead[0].rank}: {line} ({then})" + (f"\n{rest}" if rest else ""), None
    if dead:
        message = f"rank {dead[0].rank} died ({_exit_words(dead[0].exit)})"
        # a rank that failed on its own beside it is a cause too
        raised = [rf for rf in f.failures if rf.how == "failed" and rf.result is not None]
        if raised and raised[0].result is not None:
            message += f"; rank {raised[0].rank}: {_first(raised[0].result.message)}"
        return message, None
    primary = [rf for rf in f.failures if rf.how == "failed" and rf.result is not None]
    failing = primary or [rf for rf in f.failures if rf.result is not None]
    if not failing:
        return "multirank test failed", None
    first = failing[0]
    assert first.result is not None
    # whole, as pytest's own for a plain test (junit's message); a summary line takes the first
    message = f"rank {first.rank}: {first.result.message}"
    if len(primary) > 1:
        message = f"{ranks_words([rf.rank for rf in primary])} failed; {message}"
    return message, first.result.location if primary else None


def attempt_summary(report: RunReport, attempt: int) -> str:
    """``attempt 0: rank 0 stopped, rank 1 killed by the injected fault ...``"""
    parts = []
    for rank in range(report.world_size):
        result = report.results.get(rank)
        if report.fired.get(rank) and report.taken_out(rank):
            parts.append(f"rank {rank} {injection_words(report, rank)}")
        elif result is not None and result.outcome == "failed" and _consequence(report, rank, result):
            # as the verdict words it: its result is in, whether or not it was then stopped
            parts.append(f"rank {rank} failed after rank {_gone_peer(report, rank)}, because its peer went away")
        elif result is not None:  # it finished the test: being stopped afterwards (to end the run) changes nothing
            parts.append(f"rank {rank} {result.outcome}")
        elif rank in report.stopped:
            why = report.stopped[rank]
            parts.append(f"rank {rank} {why}" if why.startswith("stopped") else f"rank {rank} stopped ({why})")
        else:
            ex = report.exits.get(rank)
            parts.append(f"rank {rank} died ({_exit_words(ex)})")
    return f"attempt {attempt}: " + "; ".join(parts)


def render(f: RunFailure) -> Rendered:
    lines: list[str] = [*f.schedule, *f.attempts, *([""] if f.attempts else [])]
    lines.extend(f"desync: {m}" for m in f.mismatches)
    if f.paired_across_hooks:
        lines.append(f"note: {f.paired_across_hooks}")
    lines.extend(f.unfired)
    lines.extend(f.injections)
    if f.stuck:
        lines.extend(_hang_lines(f))
    elif f.failures:
        lines.extend(_summary(f))
    for rf in f.failures:
        if rf.how == "died":
            lines.append("")
            lines.extend(_died_lines(rf))
    failing = [rf for rf in f.failures if rf.how == "failed" or rf.died_after_failing]
    shown = failing or [rf for rf in f.failures if rf.how == "consequence"]
    # which of ranks that failed on their own was first is only worth saying where others
    # failed because of it
    several = any(rf.how == "consequence" for rf in f.failures)
    told: dict[tuple[object, ...], int] = {}  # a failure already shown whole -> its rank
    for rf in shown:
        if rf.result is None:
            continue
        label = f" rank {rf.rank}" + (" (first failure)" if rf.rank == f.first_failure and several else "")
        if rf.result.harness_error:
            label += ": the harness could not set the rank up"
        elif rf.result.phase != "call":
            label += f": error in fixture {rf.result.phase} inside the rank"
        lines.append("")
        lines.append(f"{'-' * 20}{label} {'-' * 20}")
        same = _sameness(rf.result)
        if same in told:
            # every rank asserting one thing about the one merged timeline fails alike
            lines.append(f"the same failure as rank {told[same]}, at the same line (its traceback is above)")
            continue
        told.setdefault(same, rf.rank)
        lines.extend(rf.result.longrepr.rstrip("\n").splitlines())
    lines.extend(_stack_lines(f))
    if f.holds:
        lines.extend(["", "where the schedule held the ranks:", *(f"  {h}" for h in f.holds)])
    dead = any(rf.how == "died" for rf in f.failures)
    stopped = any(st.reason for st in f.ranks.values())
    timed_out = f.stuck and not f.desynced and not f.stall and not f.deadlock
    # where each rank was when one died, was stopped or lost its peer
    consequence = any(rf.how == "consequence" for rf in f.failures)
    if f.timeline is not None and (f.mismatches or timed_out or f.stall or dead or stopped or consequence):
        lines.append("")
        lines.append("recorded timeline:")
        lines.extend(f.timeline.swimlanes(max_rows=80).splitlines())
    if f.trace:
        lines.extend(["", f"Chrome trace of the timeline: {f.trace}"])
    message, location = _message(f)
    if f.schedule:
        message = f"{f.schedule[0].split(';')[0]}: {message}"
    return Rendered(message, "\n".join(lines).strip("\n"), location)
