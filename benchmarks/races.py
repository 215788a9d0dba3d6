"""Race bugs for ``bench_explore.py``: small multirank tests whose assertion is about a result,
never about the timeline, and which pass under normal timing. ``source(bug=True)`` is the suite
with the bugs, ``source(bug=False)`` the same suite fixed.

The ranks that read are busy for a moment first (a tokenizer to load, a model to build), as
real ones are, which is why the bugs hide on a developer's machine.
"""

from __future__ import annotations

# name -> (depth: inversions needed to fail, world size, what the bug is)
RACES: dict[str, tuple[int, int, str]] = {
    "missing_barrier": (1, 2, "rank 0 writes a file, the others read it without a barrier between"),
    "barrier_on_some_paths": (1, 2, "the barrier is on the slow path only; the cached path skips it"),
    "checkpoint_read_while_written": (1, 2, "rank 1 loads the checkpoint while rank 0 may still write it"),
    "cache_filled_by_rank0": (1, 2, "rank 0 fills a cache (an instrumented method), the others read it unsynchronised"),
    "flag_polled": (1, 2, "rank 0 raises a ready flag before its data is complete; rank 1 polls the flag"),
    "two_group_pipeline": (1, 3, "stage 1 syncs with stage 2 on their group before writing what stage 2 reads"),
    "ranks_2_and_3": (1, 4, "at 4 ranks, rank 2 writes and rank 3 reads without a barrier"),
    "two_inversions": (2, 2, "a reader with a fallback: it fails only if both of two unsynchronised reads are early"),
}

HEADER = """
import json
import os

import pytest
import torch
import torch.distributed as dist

BUG = {bug}


def busy(n=300_000):
    return sum(i * i for i in range(n))


def sync():
    dist.barrier()
"""

TESTS = """

@pytest.mark.multirank(world_size=2, timeout=60)
def test_missing_barrier(rank, shared_tmp_path):
    data = shared_tmp_path / "data.txt"
    if rank == 0:
        data.write_text("42")
    if not BUG:
        sync()
    if rank == 1:
        busy()
        assert data.read_text() == "42"
    sync()


@pytest.mark.multirank(world_size=2, timeout=60)
def test_barrier_on_some_paths(rank, shared_tmp_path):
    cached = True  # every rank takes the cached path
    vocab = shared_tmp_path / "vocab.json"
    if rank == 0:
        vocab.write_text(json.dumps({{"a": 1}}))
    if not cached or not BUG:
        sync()
    if rank == 1:
        busy()
        assert json.loads(vocab.read_text()) == {{"a": 1}}
    sync()


@pytest.mark.multirank(world_size=2, timeout=60)
def test_checkpoint_read_while_written(rank, shared_tmp_path, recorder):
    ckpt = shared_tmp_path / "last.pt"
    sync()
    if rank == 0:
        torch.save({{"step": 7, "w": torch.arange(1000.0)}}, ckpt)
    if not BUG:
        sync()
    if rank == 1:
        busy()
        state = torch.load(ckpt)
        assert state["step"] == 7
    sync()


class Cache:
    def __init__(self, folder):
        self.folder = folder

    def fill(self):
        for i in range(4):
            (self.folder / f"shard{{i}}.txt").write_text(str(i))

    def read(self):
        return [int((self.folder / f"shard{{i}}.txt").read_text()) for i in range(4)]


@pytest.mark.multirank(world_size=2, timeout=60)
def test_cache_filled_by_rank0(rank, shared_tmp_path, recorder):
    cache = recorder.instrument(Cache(shared_tmp_path), "fill", "read")
    if rank == 0:
        cache.fill()
    if not BUG:
        sync()
    if rank == 1:
        busy()
        assert cache.read() == [0, 1, 2, 3]
    sync()


@pytest.mark.multirank(world_size=2, timeout=60)
def test_flag_polled(rank, shared_tmp_path, recorder):
    flag, data = shared_tmp_path / "ready", shared_tmp_path / "data.txt"
    if rank == 0:
        if BUG:
            flag.touch()  # too early: the data is not written yet
            recorder.mark("flag raised")
            data.write_text("complete")
        else:
            data.write_text("complete")
            recorder.mark("data written")
            flag.touch()
    else:
        busy()
        while not flag.exists():
            pass
        assert data.exists() and data.read_text() == "complete"
    sync()


@pytest.mark.multirank(world_size=3, timeout=60)
def test_two_group_pipeline(rank, shared_tmp_path):
    first, second = dist.new_group([0, 1]), dist.new_group([1, 2])
    acts = shared_tmp_path / "acts.txt"
    if rank in (0, 1):
        dist.barrier(group=first)  # stage 0 hands over to stage 1
    if rank == 1:
        if BUG:
            dist.barrier(group=second)  # too early: stage 2 goes on before the write
            acts.write_text("stage1")
        else:
            acts.write_text("stage1")
            dist.barrier(group=second)
    if rank == 2:
        dist.barrier(group=second)
        busy()
        assert acts.read_text() == "stage1"
    sync()


@pytest.mark.multirank(world_size=4, timeout=60)
def test_ranks_2_and_3(rank, shared_tmp_path):
    sync()
    part = shared_tmp_path / "part.txt"
    if rank == 2:
        part.write_text("from 2")
    if not BUG:
        sync()
    if rank == 3:
        busy()
        assert part.read_text() == "from 2"
    sync()


@pytest.mark.multirank(world_size=2, timeout=60)
def test_two_inversions(rank, shared_tmp_path):
    config, fallback = shared_tmp_path / "config.txt", shared_tmp_path / "fallback.txt"
    if rank == 0:
        config.write_text("tuned")
    if not BUG:
        sync()
    seen = []
    if rank == 1:
        busy()
        seen.append(config.exists())
    sync()
    if rank == 0:
        fallback.write_text("defaults")
    if not BUG:
        sync()
    if rank == 1:
        busy()
        seen.append(fallback.exists())
        assert any(seen), "neither the tuned config nor the fallback was there"
    sync()
"""


def source(bug: bool) -> str:
    return (HEADER + TESTS).format(bug=bug)
