"""With -s every line a rank prints reaches the terminal as it is printed, prefixed [rank N];
without it, rank output stays in the report's sections."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import pytest

WAITS_FOR_THE_READER = """
import os
import time
import pytest

@pytest.mark.multirank(world_size=2, timeout=60)
def test_prints_then_waits(rank, tmp_path_factory):
    print(f"ready on {rank}", flush=True)
    os.write(2, f"and on stderr {rank}\\n".encode())
    go = os.path.join(os.environ["GO_DIR"], "go")
    deadline = time.monotonic() + 30
    while not os.path.exists(go):  # only a reader who saw the line live creates it
        assert time.monotonic() < deadline, "nobody saw the line while the test ran"
        time.sleep(0.01)
    print("after the go")
"""


def _run_until_seen(pytester: pytest.Pytester, args: list[str], wanted: list[bytes]) -> tuple[int, str]:
    """Run pytest with ``args``; once every ``wanted`` line was on its stdout, let the test go
    on (it waits for that, see ``WAITS_FOR_THE_READER``). Its exit code and whole output."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "GO_DIR": str(pytester.path)},
    )
    assert proc.stdout is not None
    seen = b""
    deadline = time.monotonic() + 60
    while not all(line in seen for line in wanted):
        assert time.monotonic() < deadline, seen.decode(errors="replace")
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            seen += proc.stdout.read1(65536)
    (pytester.path / "go").write_text("seen")
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, (seen + out).decode()


def test_rank_lines_reach_the_terminal_while_the_test_runs(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_live=WAITS_FOR_THE_READER)
    code, text = _run_until_seen(pytester, ["-s", "test_live.py"], [b"[rank 0] ready on 0", b"[rank 1] ready on 1"])
    assert code == 0, text
    for rank in (0, 1):
        assert f"[rank {rank}] and on stderr {rank}" in text
        assert f"[rank {rank}] after the go" in text


def test_with_tee_sys_rank_lines_reach_the_terminal_and_stay_in_the_sections(pytester: pytest.Pytester) -> None:
    """As a plain test's under --capture=tee-sys: printed as they come and kept for the report."""
    fails_on_rank_1 = WAITS_FOR_THE_READER.replace('print("after the go")', 'print("after the go"); assert rank == 0')
    pytester.makepyfile(test_live=fails_on_rank_1)
    code, text = _run_until_seen(
        pytester, ["--capture=tee-sys", "test_live.py"], [b"[rank 0] ready on 0", b"[rank 1] ready on 1"]
    )
    assert code == 1, text
    assert "[rank 1] after the go" in text
    section = text.split("Captured stdout rank 1 call")[1]
    assert "ready on 1" in section.splitlines()[1], text


LIVE_LOG = ("-o", "log_cli=true", "--log-cli-level=INFO")  # pytest's live logging on, from INFO
LOGS_THEN_WAITS = WAITS_FOR_THE_READER.replace(
    'print(f"ready on {rank}", flush=True)', 'logging.getLogger("app").info("ready on %d", rank)'
).replace("import os\n", "import logging\nimport os\n", 1)


def test_live_logging_shows_rank_records_while_the_test_runs(pytester: pytest.Pytester) -> None:
    """``log_cli``: a rank's records reach pytest's live log as they are logged, in its
    section and format, prefixed by rank; the captured output stays captured."""
    pytester.makepyfile(test_live=LOGS_THEN_WAITS)
    code, text = _run_until_seen(
        pytester,
        [*LIVE_LOG, "test_live.py"],
        [b"[rank 0] INFO     app:test_live.py:", b"[rank 1] INFO     app:test_live.py:"],
    )
    assert code == 0, text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "live log call" in line)
    shown = [line for line in lines[header:] if line.startswith("[rank ")]
    line = LOGS_THEN_WAITS.strip().splitlines().index('    logging.getLogger("app").info("ready on %d", rank)') + 1
    assert sorted(shown) == [
        f"[rank 0] INFO     app:test_live.py:{line} ready on 0",
        f"[rank 1] INFO     app:test_live.py:{line} ready on 1",
    ], text
    assert "live log setup" not in text  # logged in the call, although a peer may still set up
    assert "after the go" not in text  # printed, not logged: captured as before


def test_live_logging_keeps_pytest_levels_phases_and_format(inner) -> None:
    ran = inner(
        """
        import logging
        import pytest

        log = logging.getLogger("app")

        @pytest.fixture
        def prepared(rank):
            log.warning("set up on %d", rank)
            yield
            log.warning("torn down on %d", rank)

        @pytest.mark.multirank(world_size=2)
        def test_logs(rank, prepared):
            log.debug("too quiet on %d", rank)
            try:
                raise ValueError("kept")
            except ValueError:
                log.exception("failed on %d", rank)
        """,
        *LIVE_LOG,
        "--log-cli-format=%(levelname)s|%(name)s|%(message)s",
        "-s",
        subprocess=True,
    )
    ran.result.assert_outcomes(passed=1)
    for rank in (0, 1):
        ran.lines(
            "*- live log setup -*",
            f"[[]rank {rank}[]] WARNING|app|set up on {rank}",
            "*- live log call -*",
            f"[[]rank {rank}[]] ERROR|app|failed on {rank}",
            f"[[]rank {rank}[]] Traceback (most recent call last):",
            f"[[]rank {rank}[]] ValueError: kept",
            "*- live log teardown -*",
            f"[[]rank {rank}[]] WARNING|app|torn down on {rank}",
        )
    ran.no_lines("*too quiet*")


def test_live_logging_shows_a_special_tests_records_and_its_ranks(inner) -> None:
    ran = inner(
        """
        import logging
        import pytest

        @pytest.mark.special
        @pytest.mark.multirank(world_size=2)
        def test_special_ranks(rank):
            logging.getLogger("app").warning("special rank %d", rank)

        @pytest.mark.special
        def test_special_plain():
            logging.getLogger("app").warning("special alone")
        """,
        *LIVE_LOG,
        "--log-cli-format=%(levelname)s|%(message)s",
        "-v",
        subprocess=True,
    )
    ran.result.assert_outcomes(passed=2)
    for rank in (0, 1):
        ran.lines("*::test_special_ranks*", "*- live log call -*", f"[[]rank {rank}[]] WARNING|special rank {rank}")
    ran.lines("*::test_special_plain*", "*- live log call -*", "WARNING|special alone", "PASSED*")
    ran.no_lines("*Captured stdout*")


def test_without_live_logging_no_rank_record_reaches_the_terminal(inner) -> None:
    ran = inner(
        """
        import logging
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_logs(rank):
            logging.getLogger("app").warning("said by %d", rank)
        """,
        "-v",
    )
    ran.result.assert_outcomes(passed=1)
    ran.no_lines("*said by*")
    ran.no_lines("*live log*")


def test_without_s_rank_output_is_in_the_report_sections(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_prints(rank):
            print(f"said by {rank}")
            assert rank == 0
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines("*- Captured stdout rank 1 call -*", "said by 1")
    ran.no_lines("[[]rank 1[]] said by 1")


def test_with_s_a_special_test_prints_to_the_terminal_too(pytester: pytest.Pytester) -> None:
    """Its own interpreter prints where pytest does: a plain special test's lines as they are,
    a special multirank test's prefixed by rank; the child's own pytest banner does not."""
    pytester.makepyfile(
        test_special_live="""
        import pytest
        import torch.distributed as dist

        @pytest.mark.special
        def test_fails_after_printing():
            print("DEBUG-VALUE 42")
            assert 1 == 2

        @pytest.mark.special
        @pytest.mark.multirank(world_size=2)
        def test_ranks_print(rank):
            print(f"hello from {rank}")
            dist.barrier()
        """
    )
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*DEBUG-VALUE 42"])
    result.stdout.fnmatch_lines(["*[[]rank 0[]] hello from 0*"])
    result.stdout.fnmatch_lines(["*[[]rank 1[]] hello from 1*"])
    assert result.stdout.str().count("test session starts") == 1


@pytest.mark.parametrize("special", [False, True])
def test_with_s_a_ranks_stderr_is_the_sessions_stderr(pytester: pytest.Pytester, special: bool) -> None:
    pytester.makepyfile(
        test_streams=f"""
        import sys
        import pytest

        {"@pytest.mark.special" if special else ""}
        @pytest.mark.multirank(world_size=2)
        def test_prints_to_both(rank):
            print(f"OUT-LINE {{rank}}")
            print(f"ERR-LINE {{rank}}", file=sys.stderr)
        """
    )
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*[[]rank 0[]] OUT-LINE 0"])
    result.stderr.fnmatch_lines(["[[]rank 0[]] ERR-LINE 0"])
    result.stderr.fnmatch_lines(["[[]rank 1[]] ERR-LINE 1"])
    assert "ERR-LINE" not in result.stdout.str() and "OUT-LINE" not in result.stderr.str()


def test_capsys_disabled_in_a_rank_prints_on_the_terminal_as_in_a_plain_test(inner) -> None:
    ran = inner(
        """
        import sys
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_rank(rank, capsys):
            print(f"kept {rank}")
            with capsys.disabled():
                print(f"shown at once by rank {rank}")
                print(f"and on stderr by rank {rank}", file=sys.stderr)
            print(f"kept again {rank}")
            assert capsys.readouterr().out == f"kept {rank}\\nkept again {rank}\\n"
            assert rank == 0

        def test_plain(capfd):
            with capfd.disabled():
                print("shown at once by the plain test")
        """,
        subprocess=True,
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    for r in (0, 1):
        assert ran.text.count(f"shown at once by rank {r}") == 1, "on the terminal, not in a captured section"
        assert f"and on stderr by rank {r}" in ran.result.stderr.str()
    assert "shown at once by the plain test" in ran.text


def test_a_rank_that_dies_loses_nothing_it_printed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_dies="""
        import os
        import signal
        import pytest

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_prints_then_dies(rank):
            for i in range(2000):
                print(f"line {i} of rank {rank}")
            print("no end of line", end="")
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        """
    )
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    for rank in (0, 1):
        assert all(f"[rank {rank}] line {i} of rank {rank}\n" in out for i in range(2000)), rank
        assert f"[rank {rank}] no end of line" in out
