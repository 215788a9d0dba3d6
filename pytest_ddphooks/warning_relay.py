"""Warnings caught in another process (a rank, a special test's interpreter), carried back
as plain data and rebuilt for the session's warnings summary."""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

WireWarning = dict[str, Any]


def dump(message: warnings.WarningMessage) -> WireWarning:
    category = message.category
    return {
        "module": category.__module__,
        "qualname": category.__qualname__,
        "text": str(message.message),
        "filename": message.filename,
        "lineno": message.lineno,
        "line": message.line,
    }


def _category(module: str, qualname: str) -> type[Warning]:
    """The warning class itself when this process has it, else a stand-in of that name."""
    try:
        owner: Any = sys.modules.get(module) or importlib.import_module(module)
        for part in qualname.split("."):
            owner = getattr(owner, part)
        if isinstance(owner, type) and issubclass(owner, Warning):
            return owner
    except Exception:
        pass
    return type(qualname.rsplit(".", 1)[-1], (UserWarning,), {"__module__": module})


def load(wire: WireWarning) -> warnings.WarningMessage:
    category = _category(str(wire["module"]), str(wire["qualname"]))
    try:
        instance: Warning = category(wire["text"])
    except Exception:
        instance = UserWarning(wire["text"])
    return warnings.WarningMessage(instance, category, wire["filename"], wire["lineno"], line=wire.get("line"))


def unique(wires: list[WireWarning]) -> list[WireWarning]:
    """Each warning once: every rank raising the same one is one warning."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for w in wires:
        key = (w["module"], w["qualname"], w["text"], w["filename"], w["lineno"])
        if key not in seen:
            seen.add(key)
            out.append(w)
    return out
