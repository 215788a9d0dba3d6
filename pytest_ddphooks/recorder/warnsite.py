"""A warning raised inside a recorded call points at the code that made the call, as it
would without the recorder: ``warnings.warn(..., stacklevel=n)`` counts frames, and the
recorder's wrappers add some between a function and its caller (torch's deprecation
warnings would otherwise name ``distpatch.py``, and a filter such as
``-W error::FutureWarning:mypkg`` would no longer match)."""

from __future__ import annotations

import sys
import warnings
from typing import Any

_wrapper_files: set[str] = set()
_original_warn: Any = None


def skip_frames_of(*files: str) -> None:
    """From now on, ``warnings.warn`` steps over frames of these files when it finds the
    warning's location."""
    global _original_warn
    _wrapper_files.update(files)
    if _original_warn is None:
        _original_warn = warnings.warn
        warnings.warn = _warn


def _warn(
    message: Any, category: Any = None, stacklevel: int = 1, source: Any = None, *args: Any, **kwargs: Any
) -> None:
    __tracebackhide__ = True  # a warning turned into an error is raised here: pytest shows the caller
    try:
        frame = sys._getframe(stacklevel)  # where the warning would point (0 is this function)
        while frame.f_code.co_filename in _wrapper_files and frame.f_back is not None:
            frame = frame.f_back
            stacklevel += 1
    except (ValueError, TypeError):
        pass  # a stack shorter than asked, or a stacklevel that is not an int: as warn decides
    _original_warn(
        message, category, stacklevel + 1 if isinstance(stacklevel, int) else stacklevel, source, *args, **kwargs
    )
