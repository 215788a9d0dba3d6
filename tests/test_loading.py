"""The plugin loads through its entry point, can be turned off, and may also be named."""

from __future__ import annotations

from xml.etree import ElementTree

import pytest

BODY = """
import pytest

@pytest.mark.multirank(world_size=2)
def test_ranks(rank, world_size):
    assert world_size == 2
"""


def test_loads_through_the_entry_point(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.multirank(world_size=2, *, backend='gloo'*", "@pytest.mark.special*"])
    help_text = pytester.runpytest("--help").stdout.str()
    for option in ("--ddp-timeout=SECONDS", "--ddp-leaks={fail,warn,off}", "--ddp-trace-dir=DIR"):
        assert option in help_text


def test_no_ddphooks_turns_it_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_off=BODY)
    result = pytester.runpytest("-p", "no:ddphooks")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'rank' not found*"])


def test_no_ddphooks_where_a_conftest_names_the_plugin_says_how_to_turn_it_off(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["pytest_ddphooks.plugin"]')
    pytester.makepyfile(test_off=BODY)
    result = pytester.runpytest("-p", "no:ddphooks")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: -p no:ddphooks turns pytest-ddphooks off, but it is also loaded as pytest_ddphooks.plugin"
            " (pytest_plugins in a conftest, or -p): add -p no:pytest_ddphooks.plugin to turn it off there too"
        ]
    )
    result = pytester.runpytest("-p", "no:ddphooks", "-p", "no:pytest_ddphooks.plugin")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'rank' not found*"])


def test_named_in_conftest_and_loaded_by_entry_point_is_harmless(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["pytest_ddphooks.plugin"]')
    pytester.makepyfile(test_twice=BODY)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_named_in_conftest_without_autoload(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest('pytest_plugins = ["pytest_ddphooks.plugin"]')
    pytester.makepyfile(test_explicit=BODY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_recorder_imports_without_pytest() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import pytest_ddphooks; from pytest_ddphooks import Recorder, Timeline;"
        "assert 'pytest' not in sys.modules and '_pytest' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


TORCH_PROBE = """
import os
import sys


def pytest_sessionfinish(session):
    role = os.environ.get("PYTEST_XDIST_WORKER", "controller")
    with open(os.path.join(str(session.config.rootpath), f"torch-{role}.txt"), "w") as f:
        f.write(str("torch" in sys.modules))
"""


def test_an_xdist_controller_leaves_torch_to_the_workers_that_run_tests(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this suite itself under xdist
    pytester.makeconftest(TORCH_PROBE)
    pytester.makepyfile(test_ranks=BODY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=1)
    seen = {path.name: path.read_text() for path in pytester.path.glob("torch-*.txt")}
    assert seen == {"torch-controller.txt": "False", "torch-gw0.txt": "True", "torch-gw1.txt": "True"}


def test_without_pytests_terminal_a_multirank_test_still_passes(pytester) -> None:
    pytester.makepyfile(
        test_quiet="""
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=30)
        def test_all_reduce(rank, world_size):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == world_size
        """
    )
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:terminal", "-p", "no:cacheprovider", f"--junitxml={junit}")
    assert result.ret == 0, junit.read_text()
    suite = ElementTree.parse(junit).getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("1", "0", "0")
