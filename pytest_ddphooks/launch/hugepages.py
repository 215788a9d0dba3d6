"""Huge pages for the fork server's memory, so that forking a rank copies a few hundred page
table entries instead of tens of thousands (and a rank's exit frees as few).

After ``import torch`` a process holds 150+ MiB of anonymous memory in 4 KiB pages; fork
copies one page table entry per page and takes a reference on each, which is most of the
cost of starting a rank. ``MADV_COLLAPSE`` (Linux 6.1) moves those pages into 2 MiB huge
pages once, synchronously. A page a rank later writes is still copied alone: the kernel
splits the huge mapping on the first write. Where the kernel cannot do it nothing changes.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

MADV_COLLAPSE = 25
HUGE = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass
class Collapsed:
    """What one call did."""

    regions: int = 0
    huge_bytes: int = 0  # how much of the anonymous memory is in huge pages afterwards
    seconds: float = 0.0
    reason: str = ""  # why nothing was done


def thp_mode() -> str:
    """The kernel's transparent huge page setting: always, madvise or never ('' if unknown)."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def _anonymous_regions() -> list[tuple[int, int]]:
    """Private writable anonymous mappings (the heap among them), aligned to huge pages."""
    regions = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            perms = fields[1]
            name = fields[5] if len(fields) > 5 else ""
            if perms[:2] != "rw" or perms[3] != "p" or name not in ("", "[heap]"):
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            start, end = (low + HUGE - 1) & ~(HUGE - 1), high & ~(HUGE - 1)
            if end > start:
                regions.append((start, end))
    return regions


def _anon_huge_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def collapse() -> Collapsed:
    """Move this process's anonymous memory into huge pages where the kernel allows it."""
    done = Collapsed()
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        done.reason = f"transparent huge pages are {mode or 'unavailable'}"
        return done
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    began = time.perf_counter()
    for start, end in _anonymous_regions():
        # only what is there now: marking the region MADV_HUGEPAGE as well would make every
        # later fault in a rank try for a huge page, with direct compaction (stalls of seconds).
        # Refused for a region the kernel will not back with huge pages, and before Linux 6.1.
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            done.regions += 1
    done.seconds = time.perf_counter() - began
    done.huge_bytes = _anon_huge_bytes()
    if not done.regions:
        done.reason = "the kernel collapsed no memory into huge pages (MADV_COLLAPSE needs Linux 6.1)"
    return done
