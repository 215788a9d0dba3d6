"""--ddp-report: one self-contained HTML page of the session's multirank tests, checked in a
real browser (headless Chromium) where one is installed; pytest-html's report carries the
same timeline for each failed multirank test."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree

import pytest
from synth import Sim

from pytest_ddphooks.htmlreport import multirank_view, static_svg, write_report

SUITE = """
import time
import pytest
import torch.distributed as dist


class Trainer:
    def prepare_data(self):
        time.sleep(0.01)

    def setup(self):
        time.sleep(0.005)


@pytest.mark.multirank(world_size=2)
def test_no_barrier(rank, recorder):
    trainer = recorder.instrument(Trainer())
    if rank == 0:
        trainer.prepare_data()
    trainer.setup()
    dist.barrier()
    recorder.timeline().assert_happens_before("prepare_data@0", "setup")


@pytest.mark.multirank(world_size=2)
def test_with_barrier(rank, recorder):
    trainer = recorder.instrument(Trainer())
    if rank == 0:
        trainer.prepare_data()
    dist.barrier()
    trainer.setup()
    recorder.timeline().assert_happens_before("prepare_data@0", "setup")


def test_plain():
    pass
"""


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-headless-shell")
    if found is None:
        pytest.skip("Chromium is not installed here, and ci/setup.sh could not install it")
    return found


def _browser(page: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = page.parent / "chromium-profile"
    command = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
        "--virtual-time-budget=5000",
        *args,
        page.as_uri(),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


class _Elements(HTMLParser):
    """Elements of a DOM dump by class."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, {k: v or "" for k, v in attrs}))

    def of_class(self, name: str) -> list[dict[str, str]]:
        return [a for _, a in self.found if name in a.get("class", "").split()]


def _dom(page: Path) -> _Elements:
    done = _browser(page, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = _Elements()
    parsed.feed(done.stdout)
    return parsed


@pytest.fixture
def report(pytester: pytest.Pytester) -> Path:
    pytester.makepyfile(test_suite=SUITE)
    page = pytester.path / "out" / "report.html"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--ddp-report={page}")
    result.assert_outcomes(failed=1, passed=2)
    return page


def _embedded(page: Path) -> dict:
    text = page.read_text()
    found = re.search(r'<script id="data" type="application/json">(.*?)</script>', text, re.S)
    assert found is not None
    return json.loads(found.group(1).replace("<\\/", "</"))


def test_the_page_holds_the_sessions_multirank_tests_and_needs_no_network(report: Path) -> None:
    data = _embedded(report)
    outcomes = {t["id"]: t["outcome"] for t in data["tests"]}
    assert outcomes == {"test_suite.py::test_no_barrier": "failed", "test_suite.py::test_with_barrier": "passed"}
    failed = next(t for t in data["tests"] if t["outcome"] == "failed")
    assert "'prepare_data@0' does not happen before 'setup'" in failed["text"]
    assert failed["highlights"] and failed["highlights"][0]["a"][0] == 0 and failed["highlights"][0]["b"][0] == 1
    assert {lane[0] for lane in failed["timeline"]["lanes"]} == {0, 1}
    text = report.read_text()
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', text), "nothing is fetched from elsewhere"
    assert not re.search(r"https?://", text), "the page names no address at all (not even a namespace's)"


def test_multirank_tests_that_never_reached_their_ranks_are_on_the_page_too(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_unrun="""
        import pytest

        @pytest.fixture
        def broken():
            raise ValueError("broken on the pytest side")

        @pytest.mark.multirank(world_size=2)
        def test_fixture_error(rank, broken):
            pass

        @pytest.mark.skip(reason="not today")
        @pytest.mark.multirank(world_size=2)
        def test_skipped(rank):
            pass

        @pytest.mark.multirank(world_size=0)
        def test_bad_marker(rank):
            pass

        @pytest.mark.multirank(world_size=2)
        def test_ran(rank):
            pass

        def test_plain():
            pass
        """
    )
    page = pytester.path / "report.html"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--ddp-report={page}")
    result.assert_outcomes(passed=2, skipped=1, errors=2)
    data = _embedded(page)
    assert data["title"] == "pytest-ddphooks: 4 multirank tests"
    outcomes = {t["id"].split("::")[1]: t["outcome"] for t in data["tests"]}
    assert outcomes == {
        "test_fixture_error": "error",
        "test_skipped": "skipped",
        "test_bad_marker": "error",
        "test_ran": "passed",
    }
    error = next(t for t in data["tests"] if t["id"].endswith("test_fixture_error"))
    assert "broken on the pytest side" in error["text"]
    dom = _dom(page)  # the page draws them: a test without ranks or timeline breaks nothing
    assert sorted(a["data-nodeid"].split("::")[1] for a in dom.of_class("test")) == sorted(outcomes)


def test_the_page_renders_lanes_spans_and_the_missing_connection_in_a_browser(report: Path) -> None:
    dom = _dom(report)
    failed = [a for a in dom.of_class("test") if "failed" in a["class"].split()]
    assert [a["data-nodeid"] for a in failed] == ["test_suite.py::test_no_barrier"]
    lanes = dom.of_class("lane")
    assert sorted(a["data-rank"] for a in lanes) == ["0", "1"], "a lane per rank of the opened failure"
    names = {(a["data-rank"], a["data-name"]) for a in dom.of_class("span")}
    assert {("0", "prepare_data"), ("0", "setup"), ("1", "setup"), ("0", "dist.barrier")} <= names
    hot = {(a["data-rank"], a["data-name"]) for a in dom.of_class("highlight")}
    assert hot == {("0", "prepare_data"), ("1", "setup")}
    assert dom.of_class("missing-sync"), "the missing connection is drawn"
    assert dom.of_class("coll"), "the barrier joins the lanes"
    shot = report.parent / "shot.png"
    done = _browser(report, f"--screenshot={shot}")
    assert done.returncode == 0 and shot.stat().st_size > 10_000


def test_a_timeline_of_8_ranks_and_10000_events_each_draws_only_what_is_visible(tmp_path: Path) -> None:
    sim = Sim(8)
    for step in range(2500):
        for rank in range(8):
            sim.call(rank, f"step_{step % 7}")
        sim.coll("all_reduce")
    timeline = sim.timeline()
    assert len(timeline.for_rank(0)) >= 10_000
    view = multirank_view("test_big.py::test_big", timeline, world_size=8)
    view["outcome"] = "failed"
    page = tmp_path / "big.html"
    write_report(str(page), [view], "big")
    dom = _dom(page)
    assert len(dom.of_class("lane")) == 8
    drawn = len(dom.of_class("span"))
    assert 0 < drawn <= 8 * 4000, "drawn, and not every one of the 100,000 spans at once"


def test_a_nan_in_a_mark_does_not_break_the_page(tmp_path: Path) -> None:
    sim = Sim(2)
    sim.mark(0, "step", loss=float("nan"))
    sim.coll("all_reduce")
    view = multirank_view("test_nan.py::test_nan", sim.timeline(), world_size=2)
    view["outcome"] = "failed"
    page = tmp_path / "nan.html"
    write_report(str(page), [view], "nan")
    dom = _dom(page)  # the page's data parsed: its lanes are drawn
    assert len(dom.of_class("lane")) == 2


def test_an_unwritable_report_path_keeps_the_outcomes_and_warns(pytester: pytest.Pytester, tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--ddp-report={blocked}/report.html")
    result.assert_outcomes(failed=1, passed=2, warnings=1)
    result.stdout.fnmatch_lines([f"*PytestWarning: --ddp-report: cannot write {blocked}/report.html: *"])
    result.stdout.no_fnmatch_line("*notices.py*")  # no line of the plugin's own is shown as where


def test_pytest_html_reports_carry_the_timeline_of_failed_multirank_tests(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pytest_html", reason="pytest-html is installed with the test extras")
    pytester.makepyfile(test_suite=SUITE)
    page = pytester.path / "pytest-html.html"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--html={page}", "--self-contained-html")
    result.assert_outcomes(failed=1, passed=2)
    text = page.read_text()
    assert text.count("ddphooks-timeline") == 1, "the failed multirank test, and only it"


def test_a_hung_call_lasts_until_the_stop_and_waiting_ahead_of_the_test_is_cut() -> None:
    sim = Sim(2)
    sim.coll("barrier")  # prepared ranks: set up long before the test came
    sim.t += 3_000_000_000
    started = sim.t
    sim.mark(0, "go")
    hung = sim.cstart(0, "all_reduce")
    stopped = sim.t + 2_000_000_000
    view = multirank_view("t.py::t", sim.timeline(), world_size=2, started_ns=started, stopped_ns=stopped)["timeline"]
    assert view["t1"] == 2_000_001.0  # microseconds from the test's first event to the stop
    names = view["names"]
    (span,) = [s for s in view["spans"] if names[s[2]] == "dist.all_reduce"]
    assert span[3] == 1.0 and span[4] is None  # never ended: drawn to t1
    before = [s for s in view["spans"] if names[s[2]] == "dist.barrier"]
    assert before and all(s[3] == 0.0 and s[4] == 0.0 for s in before)  # what came before sits at 0
    assert hung.name == "dist.all_reduce"


def test_the_page_says_why_a_test_skipped_xfailed_or_also_erred_in_teardown(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_reasons="""
        import subprocess
        import pytest

        @pytest.fixture
        def leaves_a_process():
            subprocess.Popen(["sleep", "100"])
            yield

        @pytest.mark.multirank(world_size=2)
        def test_skips(rank):
            pytest.skip("whole test skipped")

        @pytest.mark.xfail(reason="known bad")
        @pytest.mark.multirank(world_size=2)
        def test_xfails(rank):
            assert False

        @pytest.mark.multirank(world_size=2)
        def test_fails_and_leaks(rank, leaves_a_process):
            assert rank == 0
        """
    )
    page = pytester.path / "report.html"
    traces = pytester.path / "traces"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", f"--ddp-report={page}", f"--ddp-trace-dir={traces}"
    )
    result.assert_outcomes(skipped=1, xfailed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines([f"*- ddphooks report: {page} -*"])
    views = {t["id"].split("::")[1]: t for t in _embedded(page)["tests"]}
    assert views["test_skips"]["outcome"] == "skipped" and "skipped: whole test skipped" in views["test_skips"]["text"]
    assert views["test_xfails"]["outcome"] == "xfailed" and "xfailed: known bad" in views["test_xfails"]["text"]
    both = views["test_fails_and_leaks"]
    assert both["outcome"] == "failed"  # its call failed; the teardown error is shown beside
    assert "rank 1: failed: assert 1 == 0" in both["text"]
    assert "--- teardown ---" in both["text"] and "leaked" in both["text"]
    # a trace for the failed test, none for the one whose xfail expected its failure
    assert [p.name for p in traces.iterdir()] == ["test_reasons.py_test_fails_and_leaks.json"]


def test_junit_gets_a_rank_failures_whole_message(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_junit="""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_two_lines(rank):
            raise AssertionError("first line ends with colon:\\n  the real reason is here")
        """
    )
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--junitxml={junit}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["FAILED test_junit.py::test_two_lines - ranks 0,1 failed; rank 0: *"])
    failure = ElementTree.parse(junit).getroot().find(".//failure")
    assert failure is not None
    assert failure.get("message", "").endswith("first line ends with colon:\n  the real reason is here")


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["plain", "xdist"])
def test_junit_labels_each_ranks_output(pytester: pytest.Pytester, workers: list[str]) -> None:
    # under xdist too: a worker once sent the report on labelled, and the terminal showed it so
    pytester.makepyfile(
        test_out="""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_prints(rank):
            print(f"loss={0.5 + rank}")
            print("page\\x0cbreak and\\u2028separator")  # one line, as the terminal shows it
            print("no newline at the end", end="")
        """
    )
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_logging=system-out", "-rA", *workers
    )
    result.assert_outcomes(passed=1)
    out = ElementTree.parse(junit).getroot().find(".//system-out")
    assert out is not None and "[rank 0] loss=0.5" in (out.text or "") and "[rank 1] loss=1.5" in (out.text or "")
    lines = (out.text or "").splitlines()
    assert sum(ln.startswith("[rank 0] ") for ln in lines) == 3, out.text  # loss, page..., no newline
    assert "[rank 0] no newline at the end" in lines and "[rank 1] no newline at the end" in lines, out.text
    # the terminal's sections are titled by rank, their lines as printed
    result.stdout.fnmatch_lines(["*Captured stdout rank 0 call*", "loss=0.5"])
    result.stdout.no_fnmatch_line("[[]rank 0[]] loss=0.5")


def test_html_a_test_printed_cannot_break_the_page(pytester: pytest.Pytester) -> None:
    """A failing rank's output is shown on the page as text; an unclosed comment and a script
    tag in it (a fragment of a page the code under test made) once blanked the whole page."""
    pytester.makepyfile(
        test_html="""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_prints_html(rank):
            print('<!--[if IE]><script src="ie.js"></script><![endif]')
            assert rank == 0

        @pytest.mark.multirank(world_size=2)
        def test_passes(rank):
            pass
        """
    )
    page = pytester.path / "report.html"
    pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--ddp-report={page}").assert_outcomes(failed=1, passed=1)
    assert "<!--" not in page.read_text().split('<script id="data"', 1)[1]
    outputs = json.dumps(_embedded(page))
    assert '<!--[if IE]><script src=\\"ie.js\\"></script><![endif]' in outputs
    dom = _dom(page)
    rows = sorted(a["data-nodeid"] for a in dom.of_class("test"))
    assert rows == ["test_html.py::test_passes", "test_html.py::test_prints_html"]


def test_a_call_inside_a_hook_is_drawn_inside_it_and_the_hook_keeps_its_name(tmp_path: Path) -> None:
    sim = Sim(2)
    for rank in range(2):
        with sim.span(rank, "Trainer.setup"):
            pass
    handles = {}
    with sim.span(0, "Trainer.fit"):
        handles[0] = sim.cstart(0, "barrier")
        handles[1] = sim.cstart(1, "barrier")
        for h in handles.values():
            sim.cend(h)
    view = multirank_view("test_nest.py::test_nest", sim.timeline(), world_size=2)
    view["outcome"] = "failed"
    page = tmp_path / "nest.html"
    write_report(str(page), [view], "nest")
    dom = _dom(page)
    spans = {(a["data-rank"], a["data-name"]): a for a in dom.of_class("span")}
    hook, inside = spans[("0", "Trainer.fit")], spans[("0", "dist.barrier")]
    assert (hook["data-depth"], inside["data-depth"], spans[("1", "dist.barrier")]["data-depth"]) == ("0", "1", "0")
    assert float(inside["height"]) < float(hook["height"])
    assert float(inside["y"]) > float(hook["y"])
    assert "Trainer.fit" in static_svg(view)
