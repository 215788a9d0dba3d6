"""A rank's garbage collector leaves the objects it inherited from the fork server alone.

A forked rank shares the fork server's heap (torch, the test modules: about 200,000 objects)
until it writes to a page. A collection of the oldest generation visits every object, writes
to each one's header and so copies nearly every page of that heap: about 110 ms per
collection in a rank, against 9 ms for the rank's own objects, and a rank that keeps some
50,000 objects alive (a model, a Trainer) runs one or more. Each rank therefore moves what
it inherited into the permanent generation as it starts (``gc.freeze``, which relinks two
lists and copies nothing), as a server that pre-forks workers would.

What a test asks the collector is answered as in a fresh process: ``gc.get_objects``,
``gc.get_referrers`` and a full ``gc.collect()`` (looked up on the module when called) first
put those objects back (``gc.unfreeze``), then act on the whole heap; ``gc.get_freeze_count``
says 0 until the test freezes something itself; a test's own ``gc.freeze`` / ``gc.unfreeze``
act as they would. What differs: the collections the interpreter starts by itself skip the
inherited objects, so a cycle of them a test lets go (a module-level object it drops) is freed
by an explicit ``gc.collect()`` only, and its finalizers run then or not at all. Where
something was frozen before the fork (by a conftest), nothing is done;
``--ddp-freeze-inherited=off`` turns it off.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

_original: dict[str, Callable[..., Any]] = {}
_ours = False  # what is in the permanent generation is only what this module put there
_others_froze = False  # the test (or code before the fork) froze objects: leave them be


def install() -> None:
    """In the fork server, before any rank is forked: learn whether anything is frozen, and
    put the wrappers on ``gc`` that keep what a test observes as in a fresh process."""
    global _others_froze
    if _original:
        return
    _others_froze = gc.get_freeze_count() > 0
    for name, wrapper in (
        ("get_objects", _whole_heap),
        ("get_referrers", _whole_heap),
        ("collect", _full_collection),
        ("get_freeze_count", _freeze_count),
        ("freeze", _freeze),
        ("unfreeze", _unfreeze),
    ):
        original = getattr(gc, name)
        _original[name] = original
        setattr(gc, name, _in_place_of(original, wrapper))


def _in_place_of(original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper(original, ...)`` as a function named as ``original`` is (``gc.collect``): pickled,
    and found, by that name."""

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    return call


def freeze_in_rank() -> None:
    """In a rank, right after its fork."""
    global _ours
    if _original and not _others_froze:
        _original["freeze"]()
        _ours = True


def _give_back() -> None:
    global _ours
    if _ours:
        _ours = False
        _original["unfreeze"]()


def _whole_heap(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _give_back()
    return original(*args, **kwargs)


def _full_collection(original: Callable[..., int], generation: int = 2, *args: Any, **kwargs: Any) -> int:
    if not isinstance(generation, int) or generation >= 2:
        _give_back()
    return original(generation, *args, **kwargs)


def _freeze_count(original: Callable[[], int]) -> int:
    return 0 if _ours else original()


def _freeze(original: Callable[[], None]) -> None:
    global _ours, _others_froze
    _ours, _others_froze = False, True  # everything is frozen now, as the caller asked
    original()


def _unfreeze(original: Callable[[], None]) -> None:
    global _ours, _others_froze
    _ours, _others_froze = False, False
    original()
