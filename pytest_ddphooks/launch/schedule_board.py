"""The board a scheduled run's ranks share: each rank's place in its schedule, in a small file
every rank of the run maps, so that a held rank sees when the ranks that go first went through."""

from __future__ import annotations

import mmap
import os

from ..schedule import DONE
from . import procs

_STATES = DONE + 1  # a place is segment * _STATES + state
_WORDS = 2  # per rank: its pid, and its place in one word, written at once


class MappedBoard:
    """One rank's view of the run's board (``schedule.Board``)."""

    def __init__(self, path: str, rank: int, world_size: int) -> None:
        size = 8 * _WORDS * world_size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:  # each rank may be the first: extending to the same size is harmless
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")
        self._rank = rank
        self._words[_WORDS * rank] = os.getpid()

    def tell(self, segment: int, state: int) -> None:
        self._words[_WORDS * self._rank + 1] = segment * _STATES + state

    def place(self, rank: int) -> tuple[int, int]:
        word = self._words[_WORDS * rank + 1]
        return word // _STATES, word % _STATES

    def stopped(self, rank: int) -> bool:
        pid = self._words[_WORDS * rank]
        if not pid:  # not started yet: it will run
            return False
        return procs.state_of(pid) not in ("R", "D")
