"""What a fresh interpreter's ``import torch`` sets per process, in processes forked from one
that imported torch already (ranks, forked from the fork server).

A fresh interpreter seeds torch's generators from the operating system as it imports torch;
ranks forked from one process inherit one state, so unseeded draws (a layer's initial
weights) would agree on every rank and in every test, and a test of code meant to make ranks
agree would pass without it. A rank whose torch nobody seeded since its import draws a seed
of its own, as a process torchrun starts does; a seed a conftest set stays. Likewise the
thread count: a rank changes it only where nobody changed it since the import.
"""

from __future__ import annotations

import sys
import types

_import_seed: int | None = None  # torch's seed as its import made it
_import_threads: int | None = None  # torch's intra-op thread count as its import made it


def note_import_state(random_module: types.ModuleType) -> None:
    """``torch.random`` loaded inside ``import torch``, before any other code could touch
    torch: the default generator holds the seed the import made. Once torch was imported
    already (before this plugin loaded), what it holds may be a seed code set since: nothing
    is noted, and ranks keep what they inherit."""
    global _import_seed, _import_threads
    torch = sys.modules.get("torch")
    importing = getattr(getattr(torch, "__spec__", None), "_initializing", False)
    c = getattr(torch, "_C", None)
    generator = getattr(c, "default_generator", None)
    if importing and _import_seed is None and generator is not None:
        _import_seed = int(generator.initial_seed())
        _import_threads = int(c.get_num_threads())  # type: ignore[union-attr]


def reseed_if_unseeded() -> None:
    """In a process just forked: a fresh seed for torch, unless code seeded it since import."""
    torch = sys.modules.get("torch")
    if torch is not None and _import_seed is not None and int(torch.initial_seed()) == _import_seed:
        torch.seed()


def threads_as_imported() -> bool:
    """Whether torch's thread count is still the one its import chose (no code set it)."""
    torch = sys.modules.get("torch")
    return torch is not None and _import_threads is not None and int(torch.get_num_threads()) == _import_threads
