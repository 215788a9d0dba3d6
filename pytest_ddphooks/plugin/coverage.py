"""Coverage of ranks and special tests' interpreters, combined into the session's own at the
end of the test loop: inside pytest-cov's own wrapper of it, so before it saves and reports.
Under torchrun every rank's session measures itself: rank 0 reports them all."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from .. import coverage_relay
from ..spmd import RanksMissing, say
from .session import DdpSession
from .spmd import SpmdHooks

SAVING_LIMIT = 30.0  # seconds the session waits, at most, for ranks still leaving


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
        try:
            return (yield)
        finally:
            spmd = session.config.pluginmanager.get_plugin(SpmdHooks.NAME)
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
        mine = b""
        if spmd.rank != 0:
            mine = coverage_relay.take_session() or b""
            cov_plugin = session.config.pluginmanager.get_plugin("_cov")
            if getattr(cov_plugin, "cov_controller", None) is not None:
                cov_plugin.cov_controller = _ReportedByRankZero()  # type: ignore[union-attr]
        try:
            taken = spmd.exchange(mine, name="coverage", what="hand over its coverage")
        except RanksMissing as exc:
            if spmd.rank == 0:
                say(f"ddphooks: the coverage report holds rank 0's lines only: {exc}")
            return
        if spmd.rank == 0:
            for blob in taken[1:]:
                coverage_relay.merge_taken(blob)
