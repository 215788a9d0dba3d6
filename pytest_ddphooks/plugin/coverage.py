"""Coverage of ranks and special tests' interpreters, combined into the session's own at the
end of the test loop: inside pytest-cov's own wrapper of it, so before it saves and reports.
Under torchrun every rank's session measures itself: rank 0 reports them all."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Generator, Iterable
from typing import Any

import pytest

from .. import coverage_relay
from ..failure import ranks_words
from ..spmd import RanksMissing, say
from .session import DdpSession
from .spmd import SpmdHooks

SAVING_LIMIT = 30.0  # seconds the session waits, at most, for ranks still leaving
HANDOVER_WAIT = 5.0  # seconds rank 0 waits, after a hang, for a rank's measurement not handed over yet


class _ReportedByRankZero:
    """Stands in for pytest-cov's controller on a torchrun rank other than 0, whose
    measurements went to rank 0: nothing is saved, combined or reported here (every rank
    saving and combining the same files loses some of them), and this rank's partial total
    never fails the run; rank 0's total does."""

    def finish(self) -> None:
        pass

    def summary(self, stream: Any) -> float:
        return 100.0


class CoverageHooks:
    def __init__(self, ddp: DdpSession) -> None:
        self.ddp = ddp

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        spmd = session.config.pluginmanager.get_plugin(SpmdHooks.NAME)
        try:
            return (yield)
        except pytest.Session.Failed:
            if spmd is None or spmd.hung is None or coverage_relay.measuring() is None:
                raise
            # under torchrun a hang ends the loop as a failure (Session.Failed), which skips
            # what pytest-cov does after the loop (save, report, --cov-fail-under): the loop
            # ends here as one that ran out of tests instead, the hung test's failure
            # counted and the run's stop still said
            return True
        finally:
            if spmd is not None:
                self._join_launched_ranks(session, spmd)
            elif self.ddp.child_env():
                if self.ddp.launcher is not None:
                    # ranks save their measurements as they leave, after their test's report
                    self.ddp.launcher.settle(timeout=SAVING_LIMIT)
                coverage_relay.combine_into_session(self.ddp.coverage_folder())

    @staticmethod
    def _join_launched_ranks(session: pytest.Session, spmd: SpmdHooks) -> None:
        if coverage_relay.measuring() is None:
            return
        if spmd.hung is not None:
            # a hang ended the run: the ranks handed their measurements over as it did (the
            # hung ones end then, so no exchange here could complete)
            if spmd.rank == 0:
                _take_handed_over(spmd, range(1, spmd.world_size))
            return
        mine = b""
        if spmd.rank != 0:
            mine = coverage_relay.take_session() or b""
            _reported_by_rank_zero(session)
        try:
            taken = spmd.exchange(mine, name="coverage", what="hand over its coverage")
        except RanksMissing as exc:
            if spmd.rank == 0:
                say(f"ddphooks: the coverage report holds rank 0's lines only: {exc}")
            return
        if spmd.rank == 0:
            for blob in taken[1:]:
                coverage_relay.merge_taken(blob)


def _reported_by_rank_zero(session: pytest.Session) -> None:
    cov_plugin = session.config.pluginmanager.get_plugin("_cov")
    if getattr(cov_plugin, "cov_controller", None) is not None:
        cov_plugin.cov_controller = _ReportedByRankZero()  # type: ignore[union-attr]


def hand_over_after_hang(session: pytest.Session, spmd: SpmdHooks) -> None:
    """Under torchrun, on a rank other than 0 as a hang ends the run: its session's
    measurement goes to rank 0 now (the rank ends with ``os._exit`` once rank 0 reported,
    or torchrun stops it; the end of its test loop may never come)."""
    if coverage_relay.measuring() is None:
        return
    _reported_by_rank_zero(session)
    blob = b""
    with contextlib.suppress(Exception):
        blob = coverage_relay.take_session() or b""
    spmd.coord.hand_over("coverage", blob)  # even empty: rank 0 waits for nothing then


def report_after_hang(session: pytest.Session, spmd: SpmdHooks, ranks: Iterable[int]) -> None:
    """Under torchrun, on rank 0, from the thread that reports a hung test (the main one is
    stuck in it, and the process ends with ``os._exit``): the measurements ``ranks`` handed
    over join rank 0's, then pytest-cov saves and reports them, and its total decides
    ``--cov-fail-under``, as at the end of the test loop."""
    if coverage_relay.measuring() is None:
        return
    _take_handed_over(spmd, ranks)
    cov_plugin = session.config.pluginmanager.get_plugin("_cov")
    loop = getattr(cov_plugin, "pytest_runtestloop", None)
    if getattr(cov_plugin, "cov_controller", None) is not None and inspect.isgeneratorfunction(loop):
        assert loop is not None  # a generator function
        # pytest-cov's own wrapper of the test loop, around no loop: what it does after the
        # loop (save, combine, the reports, --cov-fail-under) is its own code, run as it is
        wrapper = loop(session)
        next(wrapper)
        with contextlib.suppress(StopIteration):
            wrapper.send(None)
    else:  # `coverage run -m pytest`: its saving as the interpreter ends never comes
        coverage_relay.save(coverage_relay.measuring())


def _take_handed_over(spmd: SpmdHooks, ranks: Iterable[int]) -> None:
    """On rank 0: what the other ranks handed over as a hang ended the run, into its own
    measurement; a rank that handed none over is named."""
    taken = spmd.coord.handed_over("coverage", ranks, HANDOVER_WAIT)
    for blob in taken.values():
        coverage_relay.merge_taken(blob)
    missing = [r for r in range(1, spmd.world_size) if r not in taken]
    if missing:
        what = "holds rank 0's lines only" if len(missing) == spmd.world_size - 1 else "lacks some ranks' lines"
        say(
            f"ddphooks: the coverage report {what}: {ranks_words(missing)} handed none over as the hang ended the run"
            " (stuck in native code, or gone)"
        )
