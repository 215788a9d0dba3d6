"""pytest's live logging (``log_cli``) for ranks: each rank ships the records it logs at the
live level, and they reach the session's live log as they come, prefixed ``[rank N]``, in
pytest's own sections ("live log setup", "live log call") and format."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import pytest
from _pytest.logging import catching_logs

from ..launch.livelog import LIVE_LOG, LIVE_LOG_ENV, PHASE, RANK, ShippingHandler, record_from_line
from ..launch.output import LineSink, LiveTail


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


def live_log_sink(config: pytest.Config, by_file: bool = True) -> LineSink | None:
    """What hands the records ranks ship to pytest's live log; None when live logging is off.
    A record is prefixed by the rank that logged it: the one it names, else (``by_file``) the
    rank whose file it came from; a special test's interpreter's own records by none."""
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
            who = getattr(record, RANK, None)
            if who is None and by_file:
                who = rank
            # the handler's lock: the session's own records wait while its format is the rank's
            with handler.lock or contextlib.nullcontext():
                own = handler.formatter
                if isinstance(who, int):
                    handler.formatter = _RankPrefixed(own, who)
                    setattr(record, RANK, who)  # kept, should this process ship it on
                try:
                    _in_rank_section(handler, getattr(record, PHASE, None), shown, record)
                finally:
                    handler.formatter = own

    return emit


class _OneFile:
    """A run of one file to follow (``LiveTail`` follows a run's files)."""

    world_size = 1

    def __init__(self, file: str) -> None:
        self.file = file

    def path(self, rank: int, what: str) -> str:
        return self.file


@contextlib.contextmanager
def following_special(config: pytest.Config, folder: str, env: dict[str, str]) -> Iterator[None]:
    """While a special test's interpreter runs: what it logs live (its own records and its
    ranks') reaches this session's live log as it comes."""
    sink = live_log_sink(config, by_file=False)
    if sink is None:
        yield
        return
    file = os.path.join(folder, LIVE_LOG)
    env[LIVE_LOG_ENV] = file
    tail = LiveTail(_OneFile(file), sink, kinds=(LIVE_LOG,))
    tail.start()
    try:
        yield
    finally:
        tail.stop()


def ship_live_log(config: pytest.Config) -> None:
    """In a special test's interpreter the parent follows: what its live log handler would
    write to this interpreter's terminal is shipped to the parent instead."""
    file = os.environ.pop(LIVE_LOG_ENV, None)
    live = _live_handler(config)
    if file is None or live is None:
        return
    handler, _ = live
    shipper = ShippingHandler(file, logging.NOTSET, phase_of=lambda: getattr(handler, "_when", None))
    handler.emit = shipper.emit  # type: ignore[method-assign]


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


__all__ = ["LIVE_LOG", "following_special", "live_log_sink", "ship_live_log", "shipping_logs"]
