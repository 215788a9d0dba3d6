"""The GitHub Actions recipe a user copies (examples/ci/github-actions.yml) runs as written:
its pytest command, on a small suite, leaves the traces and the report it uploads."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "ci" / "github-actions.yml"


def _pytest_command() -> list[str]:
    text = RECIPE.read_text()
    found = re.search(r"- name: Test\n(?:\s+#.*\n)*\s+run: >\n((?:\s{10}.*\n)+)", text)
    assert found is not None, "the recipe has a Test step running pytest"
    words = shlex.split(" ".join(line.strip() for line in found.group(1).splitlines()))
    assert words[0] == "pytest"
    return words[1:]


def test_the_recipes_command_runs_and_leaves_what_it_uploads(pytester: pytest.Pytester) -> None:
    args = _pytest_command()
    assert "--ddp-trace-dir=ddp-traces" in args and "--ddp-report=ddp-report.html" in args
    args = [a.replace("--cov=src", "--cov=mypkg") for a in args]
    args = ["2" if a == "auto" else a for a in args]  # -n auto: this machine's 2 cores, said plainly
    pytester.mkpydir("mypkg")
    (pytester.path / "mypkg" / "code.py").write_text("def value(rank):\n    return rank\n")
    pytester.makepyfile(
        test_ci="""
        import pytest
        import torch.distributed as dist
        from mypkg.code import value

        @pytest.mark.multirank(world_size=2)
        def test_passes(rank):
            dist.barrier()
            assert value(rank) == rank

        @pytest.mark.multirank(world_size=2)
        def test_fails(rank):
            assert value(rank) == 0
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=1, failed=1)
    assert [p.name for p in (pytester.path / "ddp-traces").iterdir()] == ["test_ci.py_test_fails.json"]
    assert "test_ci.py::test_fails" in (pytester.path / "ddp-report.html").read_text()
    assert (pytester.path / "junit.xml").exists() and (pytester.path / "coverage.xml").exists()
    result.stdout.fnmatch_lines(["mypkg/code.py * 2 * 0 * 100%"])
