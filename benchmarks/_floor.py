"""The naive floor of a fresh-rank test: a forkserver with torch preloaded forks fresh ranks
that initialise a gloo group, run one barrier and destroy the group. Nothing else: no test
framework, no recording, no output capture. What any harness that gives each test fresh
processes and a fresh group must at least pay, done the obvious way."""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import time


def _rank(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def floor_per_test(world_size: int, tests: int, warmup: int = 3) -> float:
    """Median seconds of one fresh-rank test (fork, init, barrier, destroy, join)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    times = []
    for i in range(warmup + tests):
        port = _free_port()
        started = time.perf_counter()
        procs = [ctx.Process(target=_rank, args=(r, world_size, port)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a floor rank failed: exit codes {[p.exitcode for p in procs]}")
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


if __name__ == "__main__":
    for size in (2, 8):
        print(size, f"{floor_per_test(size, 10) * 1e3:.0f} ms")
