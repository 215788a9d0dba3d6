"""The fixtures users get. In a multirank test launched by the plugin, ``rank``, ``recorder``
and ``node_tmp_path`` are resolved inside each rank (``rankbody``); the bodies below serve
plain tests and the torchrun mode, where the pytest process is itself a rank."""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path

import pytest

from ..faults import OUTSIDE_MULTIRANK, UNDER_TORCHRUN, UnavailableFaults
from ..recorder import Recorder
from .markers import RUN_KEY
from .spmd import SpmdHooks


# session-scoped: constant in a process (a fixture of any scope may use them); in the ranks the
# plugin launches, each test's own values are given in the rank (see rankfixtures.RANK_LOCAL)
@pytest.fixture(scope="session")
def rank() -> int:
    """This process's global rank (0 outside a multirank test)."""
    return int(os.environ.get("RANK", 0))


@pytest.fixture(scope="session")
def world_size() -> int:
    """The number of ranks of the test (1 outside a multirank test)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def _spmd_for(request: pytest.FixtureRequest) -> SpmdHooks | None:
    """The torchrun coordination, when this multirank test runs on launched ranks."""
    hooks = request.config.pluginmanager.get_plugin(SpmdHooks.NAME)
    if isinstance(hooks, SpmdHooks) and RUN_KEY in request.node.stash:
        return hooks
    return None


@pytest.fixture
def recorder(request: pytest.FixtureRequest) -> Generator[Recorder, None, None]:
    """Records hooks, barriers, marks and torch.distributed calls; ``timeline()`` merges ranks."""
    spmd = _spmd_for(request)
    rec = Recorder(exchange=spmd.exchange if spmd is not None else None).activate()
    yield rec
    rec.close()


@pytest.fixture
def faults(request: pytest.FixtureRequest) -> UnavailableFaults:
    """Inject faults at recorded points of the ranks (in a multirank test; an error elsewhere)."""
    return UnavailableFaults(UNDER_TORCHRUN if _spmd_for(request) is not None else OUTSIDE_MULTIRANK)


@pytest.fixture
def restart_count() -> int:
    """How many times the ranks were restarted (``multirank(restarts=K)``), as torchrun's
    ``TORCHELASTIC_RESTART_COUNT``."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


@pytest.fixture
def shared_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """One folder every rank sees (the same as ``tmp_path``; rank 0's under torchrun)."""
    spmd = _spmd_for(request)
    if spmd is None:
        return tmp_path
    return Path(spmd.coord.all_gather("shared-dir", str(tmp_path).encode(), spmd.start_timeout)[0].decode())


@pytest.fixture
def node_tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """One folder per simulated node (``tmp_path`` itself outside a multirank test; under
    torchrun the folder of the node's local rank 0)."""
    spmd = _spmd_for(request)
    if spmd is None:
        return tmp_path
    dirs = spmd.coord.all_gather("node-dir", str(tmp_path).encode(), spmd.start_timeout)
    first_of_node = (spmd.rank // spmd.local_world_size) * spmd.local_world_size
    return Path(dirs[first_of_node].decode())
