"""Coverage of ranks and special tests' interpreters, combined into the session's own at the
end of the test loop: inside pytest-cov's own wrapper of it, so before it saves and reports."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from .. import coverage_relay
from .session import DdpSession


class CoverageHooks:
    def __init__(self, ddp: DdpSession) -> None:
        self.ddp = ddp

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        try:
            return (yield)
        finally:
            if self.ddp.child_env():
                coverage_relay.combine_into_session(self.ddp.coverage_folder())
