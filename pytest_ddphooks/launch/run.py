"""One multirank run from the pytest process's side: start, watch, stop, collect.

A rank that dies stops the others at once. A rank whose body failed gives the others a
short grace (they often fail the same way a moment later, or error out of a collective
with it), then they are stopped. At the time limit every live rank's stacks are taken and
the whole tree is killed. Ranks that sit in collectives that can never match (a desync:
rank 0 in all_reduce #3, rank 1 in broadcast #3) are stopped as soon as that is seen twice
in a row with no progress, instead of at the limit. In every case what the ranks wrote
survives: results, output, and the events they recorded up to the end.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from .. import hangs
from ..recorder.events import RawEvent, read_new, read_raw
from ..recorder.timeline import Timeline
from .job import Job, RankResult, read_text
from .zygote import Launcher, RankExit

# how often a waiting run looks for a desync; two looks in a row must agree
DESYNC_POLL_SECONDS = 0.5


@dataclass
class RunReport:
    job: Job
    pids: dict[int, int]
    results: dict[int, RankResult] = field(default_factory=dict)
    exits: dict[int, RankExit] = field(default_factory=dict)
    stopped: dict[int, str] = field(default_factory=dict)  # rank -> why the harness stopped it
    timed_out: bool = False
    desynced: bool = False  # stopped early: blocked in collectives that can never match
    first_failure: int | None = None
    stacks: dict[int, hangs.Stacks] = field(default_factory=dict)
    outputs: dict[int, tuple[str, str]] = field(default_factory=dict)
    timeline: Timeline | None = None
    thread_idents: dict[tuple[int, int], int] = field(default_factory=dict)
    swept: list[tuple[int, str]] = field(default_factory=list)
    duration: float = 0.0
    stopped_at_ns: int = 0

    @property
    def stuck(self) -> bool:
        """The ranks were stopped while stuck: at the time limit, or early in a desync."""
        return self.timed_out or self.desynced

    def died(self, rank: int) -> bool:
        ex = self.exits.get(rank)
        if rank in self.stopped:
            return False
        return rank not in self.results or (ex is not None and (ex.signal is not None or ex.code != 0))


def _events(job: Job) -> dict[int, list[RawEvent]]:
    return {r: list(read_raw(job.path(r, "events"))) for r in range(job.world_size)}


def run_job(launcher: Launcher, job: Job, *, grace: float = 1.0, desync_poll: float = DESYNC_POLL_SECONDS) -> RunReport:
    started = time.monotonic()
    pids = launcher.spawn(job)
    report = RunReport(job, pids)
    deadline = started + job.timeout
    failed_at: float | None = None
    next_poll = started + desync_poll
    seen_stuck: tuple[object, ...] | None = None
    watch = hangs.DesyncWatch()
    offsets = dict.fromkeys(range(job.world_size), 0)
    stop_reason = ""
    while len(report.exits) < job.world_size:
        wake = deadline if failed_at is None else min(deadline, failed_at + grace)
        if failed_at is None:
            wake = min(wake, next_poll)
        ex = launcher.next_exit(job.test_id, max(wake - time.monotonic(), 0.0))
        if ex is None:
            now = time.monotonic()
            if now >= deadline:
                report.timed_out = True
                stop_reason = f"timed out after {job.timeout:g} s"
                break
            if failed_at is None:
                next_poll = now + desync_poll
                for r in offsets:
                    records, offsets[r] = read_new(job.path(r, "events"), offsets[r])
                    watch.feed(r, records)
                stuck = watch.stuck()
                if stuck is not None and stuck == seen_stuck:
                    report.desynced = True
                    stop_reason = "stopped: blocked in collectives that can never match"
                    break
                seen_stuck = stuck
                continue
            stop_reason = f"stopped after rank {report.first_failure} failed"
            break
        report.exits[ex.rank] = ex
        result = RankResult.read(job.path(ex.rank, "result"))
        if result is not None:
            report.results[ex.rank] = result
        died = result is None or ex.signal is not None or ex.code != 0
        if died or result.outcome == "failed":
            if report.first_failure is None:
                report.first_failure = ex.rank
                failed_at = time.monotonic()
            if died:
                stop_reason = f"stopped after rank {ex.rank} died ({ex.describe()})"
                break
    live = {r: p for r, p in pids.items() if r not in report.exits}
    if live:
        report.stopped_at_ns = time.time_ns()
        report.stacks = hangs.collect_stacks(live, job)
        for r in live:
            report.stopped[r] = stop_reason
        for ex in launcher.kill(job.test_id):
            report.exits.setdefault(ex.rank, ex)
            if not ex.by_harness and (ex.signal is not None or ex.code != 0):
                report.stopped.pop(ex.rank, None)  # it died on its own before it was stopped
        for r in live:
            late = RankResult.read(job.path(r, "result"))
            if late is not None:
                report.results[r] = late
    report.swept = launcher.finish(job.test_id)
    report.duration = time.monotonic() - started
    for r in range(job.world_size):
        out, err = read_text(job.path(r, "out")), read_text(job.path(r, "err"))
        if out or err:
            report.outputs[r] = (out, err)
    raw = _events(job)
    report.timeline = Timeline.from_raw(raw)
    report.thread_idents = {
        (r, int(rec[2])): int(rec[6]["ident"])
        for r, recs in raw.items()
        for rec in recs
        if rec[3] == "meta" and rec[6] and "ident" in rec[6]
    }
    return report


def remove_run_dir(job: Job) -> None:
    """Delete a run's folder; only ever called after its ranks are gone."""
    for name in os.listdir(job.run_dir):
        os.unlink(os.path.join(job.run_dir, name))
    os.rmdir(job.run_dir)
