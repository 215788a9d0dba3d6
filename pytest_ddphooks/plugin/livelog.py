"""pytest's live logging (``log_cli``) for ranks: each rank ships the records it logs at the
live level, and they reach the session's live log as they come, prefixed ``[rank N]``, in
pytest's own sections ("live log setup", "live log call") and format."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
from _pytest.logging import catching_logs

from ..launch.livelog import LIVE_LOG, PHASE, ShippingHandler, record_from_line
from ..launch.output import LineSink


def _live_handler(config: pytest.Config) -> tuple[logging.Handler, int] | None:
    """pytest's live log handler and level, when live logging is on."""
    plugin = config.pluginmanager.get_plugin("logging-plugin")
    handler = getattr(plugin, "log_cli_handler", None)
    if handler is None or isinstance(handler, logging.NullHandler):
        return None
    level = getattr(plugin, "log_cli_level", None)
    return handler, (level if isinstance(level, int) else logging.NOTSET)


class _RankPrefixed(logging.Formatter):
    """The session's live log format, each line of it prefixed ``[rank N]``."""

    def __init__(self, inner: logging.Formatter | None, rank: int) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.prefix = f"[rank {rank}] "

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(self.prefix + line for line in self.inner.format(record).split("\n"))


def live_log_sink(config: pytest.Config) -> LineSink | None:
    """What hands the records ranks ship to pytest's live log; None when live logging is off."""
    live = _live_handler(config)
    if live is None:
        return None
    handler, _ = live
    shown: list[str | None] = [None]  # the section of the last rank record shown

    def emit(rank: int, kind: str, lines: list[bytes]) -> None:
        for line in lines:
            record = record_from_line(line)
            if record is None:
                continue
            # the handler's lock: the session's own records wait while its format is the rank's
            with handler.lock or contextlib.nullcontext():
                own = handler.formatter
                handler.formatter = _RankPrefixed(own, rank)
                try:
                    _in_rank_section(handler, getattr(record, PHASE, None), shown, record)
                finally:
                    handler.formatter = own

    return emit


def _in_rank_section(
    handler: logging.Handler, phase: object, shown: list[str | None], record: logging.LogRecord
) -> None:
    """Handle ``record`` under the section of the rank's own phase: a rank that began its call
    while the pytest process still waits for a peer's setup logs in "live log call"."""
    when = getattr(handler, "_when", None)
    if not isinstance(phase, str) or when is None or phase == when:
        handler.handle(record)
        shown[0] = when
        return
    handler._when = phase  # type: ignore[attr-defined]
    handler._section_name_shown = shown[0] == phase  # type: ignore[attr-defined]
    try:
        handler.handle(record)
    finally:
        handler._when = when  # type: ignore[attr-defined]
        handler._section_name_shown = False  # type: ignore[attr-defined]  # the session's next record names its own
        shown[0] = phase


@contextlib.contextmanager
def shipping_logs(config: pytest.Config, path_of: str) -> Iterator[None]:
    """In a rank: the records it logs at the live level are shipped to ``path_of`` meanwhile."""
    live = _live_handler(config)
    if live is None:
        yield
        return
    _, level = live
    handler = ShippingHandler(path_of, level)
    try:
        with catching_logs(handler, level=level):
            yield
    finally:
        handler.close()


__all__ = ["LIVE_LOG", "live_log_sink", "shipping_logs"]
