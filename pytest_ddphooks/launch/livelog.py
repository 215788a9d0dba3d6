"""Live logging (``log_cli``) of a rank's records: the rank ships each record it logs at the
live level as one JSON line into a file of its run folder; the pytest process follows the
files and hands each record, rebuilt, to pytest's own live log handler, which formats it as
it formats the session's own records."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

LIVE_LOG = "livelog"  # the kind of a rank's file of shipped records (``Job.path(rank, LIVE_LOG)``)
PHASE = "ddp_phase"  # the record's field saying the rank's phase: ranks and pytest keep their own pace
RANK = "ddp_rank"  # the record's field naming the rank that logged it, where it travels further
LIVE_LOG_ENV = "DDPHOOKS_LIVE_LOG"  # a special test's interpreter ships its live log to this file

phase = "setup"  # in a rank: the phase of the test it is in (set as each begins)

# what a record's formatting can ask of it; the message travels already merged with its args
_FIELDS = (
    "name",
    "levelno",
    "levelname",
    "pathname",
    "filename",
    "module",
    "lineno",
    "funcName",
    "created",
    "msecs",
    "relativeCreated",
    "thread",
    "threadName",
    "process",
    "processName",
    "taskName",
)


class ShippingHandler(logging.Handler):
    """Writes each record it handles to ``path`` as one JSON line (one ``write``: a rank that
    dies loses no whole record it logged), with the phase ``phase_of()`` says (by default the
    rank's) unless the record carries one."""

    def __init__(self, path: str, level: int, phase_of: Callable[[], object] | None = None) -> None:
        super().__init__(level)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._phase_of = phase_of or _rank_phase

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, Any] = {f: getattr(record, f, None) for f in _FIELDS}
            fields["msg"] = record.getMessage()
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            fields["exc_text"] = record.exc_text
            fields["stack_info"] = record.stack_info
            fields[PHASE] = getattr(record, PHASE, None) or self._phase_of()
            if getattr(record, RANK, None) is not None:
                fields[RANK] = getattr(record, RANK)
            line = json.dumps(fields, default=str).encode() + b"\n"
            while line:
                line = line[os.write(self._fd, line) :]
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()


def _rank_phase() -> str:
    return phase


def record_from_line(line: bytes) -> logging.LogRecord | None:
    """The record a rank shipped, as a record of this process (None for a line that is not one)."""
    try:
        fields = json.loads(line)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    fields["args"] = None
    fields["exc_info"] = None
    return logging.makeLogRecord(fields)
