"""A warning raised inside a recorded call points at the code that made the call, as it
would without the recorder: ``warnings.warn(..., stacklevel=n)`` counts frames, and the
recorder's wrappers add some between a function and its caller (torch's deprecation
warnings would otherwise name ``distpatch.py``, and a filter such as
``-W error::FutureWarning:mypkg`` would no longer match).

``warnings.warn`` is replaced only while a recorder exists (``hold`` / ``release``): a
session that records nothing keeps the interpreter's own."""

from __future__ import annotations

import operator
import sys
import warnings
from typing import Any

_wrapper_files: set[str] = set()
_original_warn: Any = None
_holders = 0


def skip_frames_of(*files: str) -> None:
    """``warnings.warn``, while held, steps over frames of these files to find a warning's
    location."""
    _wrapper_files.update(files)


def hold() -> None:
    global _holders, _original_warn
    _holders += 1
    if _original_warn is None:
        _original_warn = warnings.warn
        warnings.warn = _warn


def release() -> None:
    global _holders, _original_warn
    _holders = max(_holders - 1, 0)
    if _holders == 0 and _original_warn is not None:
        if warnings.warn is _warn:  # else someone replaced it after us: theirs stays
            warnings.warn = _original_warn
        _original_warn = None


def _warn(
    message: Any, category: Any = None, stacklevel: Any = 1, source: Any = None, *args: Any, **kwargs: Any
) -> None:
    __tracebackhide__ = True  # a warning turned into an error is raised here: pytest shows the caller
    original = _original_warn
    if original is None:  # released while this call was under way
        from _warnings import warn as original
    if kwargs.get("skip_file_prefixes"):
        # (3.12) the frames of those prefixes are skipped after the first: ours are skipped as
        # theirs, and this function stands in for the caller it skips as well
        kwargs["skip_file_prefixes"] = (*kwargs["skip_file_prefixes"], *sorted(_wrapper_files))
        original(message, category, stacklevel, source, *args, **kwargs)
        return
    try:
        level = max(operator.index(stacklevel), 1)  # 0 and below mean the caller, as 1 does
    except TypeError:
        original(message, category, stacklevel, source, *args, **kwargs)  # warn says what is wrong
        return
    try:
        frame: Any = sys._getframe(level)  # where the warning would point (0 is this function)
        while frame.f_code.co_filename in _wrapper_files and frame.f_back is not None:
            frame = frame.f_back
            level += 1
    except ValueError:
        pass  # a stack shorter than asked: as warn decides
    original(message, category, level + 1, source, *args, **kwargs)
