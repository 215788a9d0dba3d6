"""One outcome for a multirank run, and the report a user reads when it failed.

Failures win over xfail, xfail over skip, skip over pass. A hang, a death, a failed rank and
a desync are each explained; the first collective the ranks disagree on is always said
first, whether the ranks then hung or not. A rank that only failed because a peer went away
(gloo's "connection closed") is named as a consequence, not as a second culprit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import hangs
from .launch.job import RankResult
from .launch.run import RunReport

_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|Socket closed")


@dataclass
class Verdict:
    outcome: str  # "passed", "failed", "skipped", "xfailed"
    text: str = ""
    message: str = ""
    location: tuple[str, int] | None = None


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def _first(message: str) -> str:
    return message.splitlines()[0] if message else message


def _tail(text: str, lines: int = 25) -> list[str]:
    rows = text.rstrip("\n").splitlines()
    if len(rows) > lines:
        return [f"[... {len(rows) - lines} earlier lines]", *rows[-lines:]]
    return rows


def _consequence(report: RunReport, rank: int, result: RankResult) -> bool:
    first = report.first_failure
    return first is not None and first != rank and bool(_PEER_GONE.search(result.message))


def _died_lines(report: RunReport, rank: int) -> list[str]:
    ex = report.exits.get(rank)
    how = ex.describe() if ex is not None else "no exit status"
    lines = [f"rank {rank} died: {how}" + ("" if rank in report.results else " before it could report")]
    err = report.outputs.get(rank, ("", ""))[1]
    fatal = hangs.fatal_error(err)
    if fatal:
        lines.extend("  " + ln for ln in fatal)
    elif err.strip():
        lines.append(f"  last output of rank {rank} on stderr:")
        lines.extend("    " + ln for ln in _tail(err))
    return lines


def decide(report: RunReport) -> Verdict:
    n = report.job.world_size
    timeline = report.timeline
    mismatches = timeline.collective_mismatches() if timeline is not None else []
    failed = [r for r, res in sorted(report.results.items()) if res.outcome == "failed"]
    died = [r for r in range(n) if report.died(r)]
    primary = [r for r in failed if not _consequence(report, r, report.results[r])]
    lines: list[str] = [f"desync: {m}" for m in mismatches]
    message = f"desync: {mismatches[0]}" if mismatches else ""
    location: tuple[str, int] | None = None

    if report.stuck:
        diagnosis = hangs.diagnose(report)
        lines.extend(diagnosis)
        if not message:
            stuck = next((ln.strip() for ln in diagnosis[1:] if ": blocked in" in ln or ": still running" in ln), "")
            message = f"hang after {report.job.timeout:g} s" + (f"; {stuck}" if stuck else "")
    elif died or failed:
        culprits = sorted(set(primary) | set(died))
        lines.append(f"multirank test failed on {_ranks(culprits or failed)} of {n}")
        for r in range(n):
            res = report.results.get(r)
            if r in died:
                ex = report.exits.get(r)
                lines.append(f"  rank {r}: died ({ex.describe() if ex else 'no exit status'})")
            elif res is not None and res.outcome == "failed":
                if _consequence(report, r, res):
                    lines.append(
                        f"  rank {r}: failed after rank {report.first_failure},"
                        f" because its peer went away: {_first(res.message)}"
                    )
                else:
                    lines.append(f"  rank {r}: failed: {_first(res.message)}")
            elif res is not None:
                lines.append(f"  rank {r}: {res.outcome}")
            elif r in report.stopped:
                lines.extend("  " + ln for ln in hangs.rank_status(report, r, report.stopped_at_ns))
    for r in died:
        lines.append("")
        lines.extend(_died_lines(report, r))
        if not message:
            ex = report.exits.get(r)
            message = f"rank {r} died ({ex.describe() if ex else 'no exit status'})"
    if primary and not message:
        first = report.results[primary[0]]
        message = f"rank {primary[0]}: {_first(first.message)}"
        if len(primary) > 1:
            message = f"{_ranks(primary)} failed; rank {primary[0]}: {_first(first.message)}"
        location = first.location
    elif failed and not message:
        message = f"rank {failed[0]}: {_first(report.results[failed[0]].message)}"
    for r in primary or failed:
        res = report.results[r]
        label = f" rank {r}" + (" (first failure)" if r == report.first_failure and len(failed) > 1 else "")
        if res.harness_error:
            label += ": the harness could not set the rank up"
        lines.append("")
        lines.append(f"{'-' * 20}{label} {'-' * 20}")
        lines.extend(res.longrepr.rstrip("\n").splitlines())
    lines.extend(hangs.stack_sections(report))
    if mismatches or report.stuck or died or failed:
        if timeline is not None and timeline.events and (mismatches or report.timed_out or died or report.stopped):
            lines.append("")
            lines.append("recorded timeline:")
            lines.extend(timeline.swimlanes(max_rows=80).splitlines())
        return Verdict("failed", "\n".join(lines).strip("\n"), message, location)
    xfailed = [r for r, res in sorted(report.results.items()) if res.outcome == "xfailed"]
    if xfailed:
        return Verdict("xfailed", message=report.results[xfailed[0]].message)
    skipped = [r for r, res in sorted(report.results.items()) if res.outcome == "skipped"]
    if skipped:
        first = report.results[skipped[0]]
        text = first.message
        if len(skipped) < n:
            text = f"{text} (on {_ranks(skipped)}; the other ranks passed)"
        return Verdict("skipped", message=text, location=first.location)
    return Verdict("passed")
