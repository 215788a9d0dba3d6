"""--ddp-trace-dir writes a Chrome trace for every failed multirank test, and only those."""

from __future__ import annotations

import json
import re

import pytest


def test_trace_of_each_failed_test_is_written(inner, tmp_path) -> None:
    traces = tmp_path / "traces"
    ran = inner(
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_fails(rank, recorder):
            recorder.mark("step")
            dist.all_reduce(torch.ones(1))
            assert rank == 0

        @pytest.mark.multirank(world_size=2)
        def test_passes(rank):
            dist.barrier()
        """,
        f"--ddp-trace-dir={traces}",
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    files = sorted(p.name for p in traces.iterdir())
    assert files == ["test_inner.py_test_fails.json"]
    ran.lines(f"Chrome trace of the timeline: {traces}/test_inner.py_test_fails.json")
    trace = json.loads((traces / files[0]).read_text())
    events = trace["traceEvents"]
    names = {(e["ph"], e.get("name")) for e in events}
    assert ("M", "process_name") in names
    assert ("X", "dist.all_reduce") in names and ("i", "step") in names
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    starts = {e["id"] for e in events if e["ph"] == "s"}
    ends = {e["id"] for e in events if e["ph"] == "f"}
    assert starts and starts == ends, "collectives are drawn as flow arrows between ranks"


def test_a_run_that_fails_in_a_ranks_fixture_teardown_leaves_a_trace(inner, tmp_path) -> None:
    traces = tmp_path / "traces"
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def closes_alone(rank):
            yield
            if rank == 0:
                dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_lonely_teardown(rank, closes_alone):
            pass
        """,
        f"--ddp-trace-dir={traces}",
    )
    ran.result.assert_outcomes(passed=1, errors=1)
    assert [p.name for p in traces.iterdir()] == ["test_inner.py_test_lonely_teardown.json"]
    ran.lines(f"Chrome trace of the timeline: {traces}/test_inner.py_test_lonely_teardown.json")


def test_ini_twin(inner, pytester, tmp_path) -> None:
    traces = tmp_path / "from-ini"
    pytester.makeini(f"[pytest]\nddp_trace_dir = {traces}\n")
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_fails(rank):
            assert False
        """
    )
    ran.result.assert_outcomes(failed=1)
    assert [p.name for p in traces.iterdir()] == ["test_inner.py_test_fails.json"]


def test_relative_paths_are_read_as_pytest_reads_paths(pytester, monkeypatch) -> None:
    """In the ini file, relative to the ini file's folder; on the command line, relative to
    where pytest was run: the same wherever in the project the session is started from."""
    pytester.makeini("[pytest]\nddp_trace_dir = ci/traces\n")
    tests = pytester.mkdir("tests")
    (tests / "test_fails.py").write_text(
        "import pytest\n\n@pytest.mark.multirank(world_size=2)\ndef test_fails(rank):\n    assert False\n"
    )
    monkeypatch.chdir(tests)
    result = pytester.runpytest("-p", "no:cacheprovider", "test_fails.py")
    result.assert_outcomes(failed=1)
    names = [p.name for p in (pytester.path / "ci" / "traces").iterdir()]
    assert len(names) == 1 and re.fullmatch(r"tests_test_fails\.py_test_fails-[0-9a-f]{10}\.json", names[0]), names
    assert not (tests / "ci").exists()
    result = pytester.runpytest("-p", "no:cacheprovider", "test_fails.py", "--ddp-trace-dir=here")
    assert [p.name for p in (tests / "here").iterdir()] == names


def test_a_hung_collective_lasts_until_the_ranks_were_stopped(inner, tmp_path) -> None:
    traces = tmp_path / "traces"
    ran = inner(
        """
        import time
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_rank1_never_arrives(rank):
            if rank == 1:
                time.sleep(100)
            dist.barrier()
        """,
        f"--ddp-trace-dir={traces}",
    )
    ran.result.assert_outcomes(failed=1)
    (path,) = traces.iterdir()
    events = json.loads(path.read_text())["traceEvents"]
    (barrier,) = [e for e in events if e["ph"] == "X" and e["name"] == "dist.barrier"]
    assert barrier["args"]["never_ended"] is True
    (stopped,) = [e for e in events if e["name"] == "ranks stopped"]
    # it lasts until the stop (the limit, 2 s, less the rank's start), not until the last event
    assert barrier["ts"] + barrier["dur"] == pytest.approx(stopped["ts"], abs=0.01)
    assert barrier["dur"] > 1_000_000


def test_ids_that_flatten_alike_get_a_trace_file_each(pytester, tmp_path) -> None:
    failing = """
import pytest

@pytest.mark.multirank(world_size=2)
def test_y(rank):
    assert rank == 0
"""
    (pytester.path / "sub").mkdir()
    (pytester.path / "sub" / "test_x.py").write_text(failing)
    (pytester.path / "sub_test_x.py").write_text(failing)
    traces = tmp_path / "traces"
    result = pytester.runpytest("-p", "no:cacheprovider", f"--ddp-trace-dir={traces}", "sub/test_x.py", "sub_test_x.py")
    result.assert_outcomes(failed=2)
    assert len(list(traces.iterdir())) == 2


def test_a_trace_shows_the_injected_fault_and_ends_a_killed_ranks_call_with_it(inner, tmp_path) -> None:
    traces = tmp_path / "traces"
    ran = inner(
        """
        import time
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=30)
        def test_killed_peer(rank, faults):
            faults.kill(rank=1, at="dist.all_reduce#2")
            dist.all_reduce(torch.ones(1))
            dist.all_reduce(torch.ones(1))
        """,
        f"--ddp-trace-dir={traces}",
    )
    ran.result.assert_outcomes(failed=1)
    (trace,) = traces.iterdir()
    events = json.loads(trace.read_text())["traceEvents"]
    fault = [e for e in events if e["ph"] == "i" and e["name"] == "injected fault kill(at='dist.all_reduce#2')"]
    assert [e["pid"] for e in fault] == [1]
    (killed_in,) = [e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["args"].get("never_ended")]
    assert killed_in["name"] == "dist.all_reduce" and killed_in["args"]["ended_with_the_rank"] is True
    # it ends where the rank was killed, not where the run ended
    assert killed_in["ts"] + killed_in["dur"] == pytest.approx(fault[0]["ts"], abs=1.0)


def test_two_tests_never_share_a_trace_file_even_in_two_processes() -> None:
    """xdist's workers each name their own tests' files, each knowing only its own: names
    that flattening could make one carry a hash of the whole id."""
    from pytest_ddphooks.plugin.reports import trace_file_name

    ids = [
        "test_a/test_same.py::test_y",
        "test_a_test_same.py::test_y",
        "test_x.py::TestA::test_b",
        "test_x.py::TestA_test_b",
        "test_x.py::test_p[a/b]",
        "test_x.py::test_p[a_b]",
    ]
    names = [trace_file_name(nodeid, {}) for nodeid in ids]  # a process of its own each
    assert len(set(names)) == len(ids), names
    assert trace_file_name("test_a_test_same.py::test_y", {}) == "test_a_test_same.py_test_y.json"
