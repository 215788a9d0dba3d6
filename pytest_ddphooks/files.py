"""Reading what another process wrote to a file (a rank, a special test's interpreter)."""

from __future__ import annotations


def read_text(path: str) -> str:
    """The file's text, or "" when it was never written."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def read_bytes(path: str) -> bytes:
    """The file's bytes, or b"" when it was never written."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""
