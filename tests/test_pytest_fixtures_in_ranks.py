"""pytest's own fixtures work in a multirank body as in a plain test, each rank its own."""

from __future__ import annotations

import pytest


def test_capture_log_and_warning_fixtures_work_in_each_rank(inner) -> None:
    ran = inner(
        """
        import logging
        import os
        import warnings
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_capsys(rank, capsys):
            print(f"hello from {rank}")
            assert capsys.readouterr().out == f"hello from {rank}\\n"
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_capfd(rank, capfd):
            os.write(1, f"fd {rank}\\n".encode())
            assert capfd.readouterr().out == f"fd {rank}\\n"

        @pytest.mark.multirank(world_size=2)
        def test_caplog(rank, caplog):
            with caplog.at_level(logging.INFO):
                logging.getLogger("trainer").info("rank %d ready", rank)
            assert caplog.messages == [f"rank {rank} ready"]

        @pytest.mark.multirank(world_size=2)
        def test_recwarn(rank, recwarn):
            warnings.warn(f"careful {rank}", UserWarning)
            assert [str(w.message) for w in recwarn] == [f"careful {rank}"]

        @pytest.fixture(params=["a", "b"])
        def letter(request):
            return request.param

        @pytest.mark.multirank(world_size=2)
        def test_request_and_tmp_path(rank, request, letter, tmp_path, monkeypatch):
            monkeypatch.setenv("MINE", str(rank))
            assert request.node.name == f"test_request_and_tmp_path[{letter}]"
            (tmp_path / f"r{rank}").write_text("x")
            dist.barrier()
            assert sorted(p.name for p in tmp_path.iterdir()) == ["r0", "r1"]
            assert os.environ["MINE"] == str(rank)
        """
    )
    ran.result.assert_outcomes(passed=6)


def test_a_rank_s_logs_are_its_own_report_section(inner) -> None:
    ran = inner(
        """
        import logging
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_logs_then_fails(rank):
            logging.getLogger("trainer").warning("rank %d is about to fail", rank)
            assert rank == 0
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "*- Captured log rank 0 call -*",
        "WARNING  trainer:test_inner.py:6 rank 0 is about to fail",
        "*- Captured log rank 1 call -*",
        "WARNING  trainer:test_inner.py:6 rank 1 is about to fail",
    )


def test_autouse_and_usefixtures_fixtures_that_need_the_rank_run_in_each_rank(inner) -> None:
    """The test names neither fixture; both need ``rank``, so both are set up in every rank,
    before the body and in pytest's order, and torn down after it."""
    ran = inner(
        """
        import os
        import pytest

        order = []

        @pytest.fixture(autouse=True)
        def rank_env(rank, monkeypatch):
            monkeypatch.setenv("MY_RANK", str(rank))
            order.append("autouse")
            yield
            print(f"autouse torn down on {rank}")

        @pytest.fixture
        def seeded(rank):
            order.append(f"seeded {rank}")

        @pytest.mark.usefixtures("seeded")
        @pytest.mark.multirank(world_size=2)
        def test_body(rank):
            assert os.environ["MY_RANK"] == str(rank)
            assert order == ["autouse", f"seeded {rank}"]

        @pytest.mark.multirank(world_size=2)
        def test_fails_on_rank_1_to_show_teardown(rank):
            assert os.environ["MY_RANK"] == str(rank)
            assert rank == 0
        """,
        "-rA",
    )
    ran.result.assert_outcomes(passed=1, failed=1)
    ran.lines("*autouse torn down on 1*")
    ran.no_lines("*KeyError*MY_RANK*")


def test_class_attributes_a_class_fixture_sets_reach_the_ranks(inner) -> None:
    ran = inner(
        """
        import pytest

        class TestWithState:
            @pytest.fixture(scope="class", autouse=True)
            @classmethod
            def state(cls):
                cls.model = {"layers": 3}

            @pytest.mark.multirank(world_size=2)
            def test_uses_it(self, rank):
                assert self.model == {"layers": 3}

        @pytest.fixture(scope="class")
        def through_request(request):
            request.cls.optimizer = "sgd"

        @pytest.mark.usefixtures("through_request")
        class TestThroughRequest:
            @pytest.mark.multirank(world_size=2)
            def test_uses_it(self, rank):
                assert type(self).optimizer == "sgd"
        """
    )
    ran.result.assert_outcomes(passed=2)


def test_a_class_attribute_that_cannot_reach_the_ranks_is_named(inner) -> None:
    ran = inner(
        """
        import threading
        import pytest

        class TestWithLock:
            @pytest.fixture(scope="class", autouse=True)
            @classmethod
            def state(cls):
                cls.lock = threading.Lock()

            @pytest.mark.multirank(world_size=2)
            def test_uses_it(self, rank):
                pass
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines("*fixture 'TestWithLock.lock' cannot be sent to the ranks: TypeError: cannot pickle*lock*")


def test_getfixturevalue_in_a_fixture_evaluated_in_the_rank(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.fixture
        def shard(rank):
            return f"shard-{rank}"

        @pytest.fixture
        def loader(rank, request):
            return [request.getfixturevalue("shard"), request.getfixturevalue("tmp_path").name]

        @pytest.fixture
        def seven():
            return 7

        @pytest.mark.multirank(world_size=2)
        def test_loads(rank, loader, tmp_path):
            assert loader == [f"shard-{rank}", tmp_path.name]

        @pytest.mark.multirank(world_size=2)
        def test_body_asks_by_name(rank, request):
            assert request.getfixturevalue("seven") == 7
            assert request.getfixturevalue("shard") == f"shard-{rank}"
            assert request.node.name == "test_body_asks_by_name"
        """
    )
    ran.result.assert_outcomes(passed=2)


def test_a_shared_folder_asked_for_by_name_in_a_rank_is_refused_with_the_way_to_have_it(inner) -> None:
    """Made in the rank, each rank had a folder of its own (in a base folder of its own), and a
    ``tmp_path`` made so failed the test at teardown with a bare KeyError of pytest's. One the
    test's fixtures include reaches the ranks, named as an argument or not."""
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def workdir(tmp_path):
            return tmp_path / "work"

        @pytest.mark.multirank(world_size=2)
        @pytest.mark.parametrize("name", ["shared_tmp_path", "tmp_path", "tmp_path_factory"])
        def test_by_name(rank, request, name):
            request.getfixturevalue(name)

        @pytest.mark.multirank(world_size=2)
        def test_named_as_an_argument_too(rank, request, shared_tmp_path):
            paths = [None, None]
            dist.all_gather_object(paths, str(request.getfixturevalue("shared_tmp_path")))
            assert paths[0] == paths[1] == str(shared_tmp_path)

        @pytest.mark.multirank(world_size=2)
        def test_through_a_fixture(rank, request, workdir):
            assert request.getfixturevalue("tmp_path") == workdir.parent
            assert request.getfixturevalue("shared_tmp_path") == workdir.parent
            assert str(request.getfixturevalue("tmpdir")) == str(workdir.parent)

        @pytest.mark.multirank(world_size=2)
        @pytest.mark.usefixtures("tmp_path")
        def test_used(rank, request):
            paths = [None, None]
            dist.all_gather_object(paths, str(request.getfixturevalue("tmp_path")))
            assert paths[0] == paths[1]
        """
    )
    ran.result.assert_outcomes(failed=3, passed=3)
    for name in ("tmp_path", "tmp_path_factory"):
        ran.lines(
            f"*rank 0: failed: LookupError: fixture '{name}' cannot be set up inside a rank (request.getfixturevalue):"
            " its folder is the one every rank of the test sees, made before the ranks start; name it as an argument"
            " of the test, or of a fixture the test uses"
        )
    assert "KeyError" not in ran.result.stdout.str()


def test_a_projects_override_of_tmp_path_that_depends_on_the_rank_starts_from_one_folder(inner) -> None:
    """An override ``tmp_path(tmp_path, rank)`` (a folder per rank under the test's) is set up in
    each rank; pytest's own tmp_path it asks for was refused there (before: made anew in each
    rank, in a base folder of its own). It is made in the pytest process, once for the test."""
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def tmp_path(tmp_path, rank):
            folder = tmp_path / f"rank{rank}"
            folder.mkdir()
            return folder

        @pytest.mark.multirank(world_size=2)
        def test_per_rank(rank, tmp_path):
            assert tmp_path.name == f"rank{rank}"
            parents = [None, None]
            dist.all_gather_object(parents, str(tmp_path.parent))
            assert parents[0] == parents[1]
            assert sorted(p.name for p in tmp_path.parent.iterdir()) == ["rank0", "rank1"]

        @pytest.mark.multirank(world_size=2)
        @pytest.mark.parametrize("names_tmp_path", [True, False])
        def test_shared_stays_shared(rank, shared_tmp_path, request, names_tmp_path):
            # the folder every rank sees is pytest's own, where each rank's folder is made
            if names_tmp_path:
                assert request.getfixturevalue("tmp_path").parent == shared_tmp_path
            (shared_tmp_path / f"from{rank}").write_text("x")
            dist.barrier()
            assert {"from0", "from1"} <= {p.name for p in shared_tmp_path.iterdir()}

        def test_plain(tmp_path):  # outside a multirank test the one process is rank 0
            assert tmp_path.name == "rank0"
        """
    )
    ran.result.assert_outcomes(passed=4)


def test_tmp_path_factory_reaches_the_ranks_after_the_session_used_it(inner) -> None:
    ran = inner(
        """
        import pytest

        def test_plain_first(tmp_path):
            (tmp_path / "plain").write_text("p")

        @pytest.fixture(scope="session")
        def data_dir(tmp_path_factory):
            folder = tmp_path_factory.mktemp("data")
            (folder / "x").write_text("1")
            return folder

        @pytest.mark.multirank(world_size=2)
        def test_factory(rank, tmp_path_factory, data_dir):
            mine = tmp_path_factory.mktemp(f"rank{rank}")
            assert mine.parent == tmp_path_factory.getbasetemp() == data_dir.parent
            assert (data_dir / "x").read_text() == "1"
        """
    )
    ran.result.assert_outcomes(passed=2)


def test_properties_the_ranks_record_reach_the_junit_report(inner, pytester) -> None:
    import xml.etree.ElementTree as ET

    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_props(rank, record_property, record_testsuite_property, record_xml_attribute, request):
            record_property("loss", 0.5 + rank)
            record_property("backend", "gloo")  # the same on both ranks: once
            request.node.user_properties.append((f"seen_by_{rank}", True))
            record_testsuite_property("torch", "2.13")
            record_xml_attribute(f"rank{rank}", "here")
        """,
        "--junitxml=out.xml",
        "-o",
        "junit_family=xunit1",
    )
    ran.result.assert_outcomes(passed=1)
    root = ET.parse(pytester.path / "out.xml").getroot()
    case = root.find(".//testcase[@name='test_props']")
    assert case is not None
    props = sorted((p.get("name"), p.get("value")) for p in case.iter("property"))
    assert props == [
        ("backend", "gloo"),
        ("loss", "0.5"),
        ("loss", "1.5"),
        ("seen_by_0", "True"),
        ("seen_by_1", "True"),
    ]
    suite = [(p.get("name"), p.get("value")) for p in root.find(".//testsuite/properties")]
    assert suite == [("torch", "2.13")]
    assert (case.get("rank0"), case.get("rank1")) == ("here", "here")


def test_pytests_own_session_fixtures_work_in_ranks_and_subtests_is_refused_with_the_reason(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_config_and_cache(rank, pytestconfig, cache):
            assert pytestconfig.getoption("ddp_leaks") in (None, "fail")
            cache.set(f"ddp/{rank}", rank)
            assert cache.get(f"ddp/{rank}", None) == rank

        @pytest.mark.multirank(world_size=2)
        def test_xml_attribute_without_junit(rank, record_xml_attribute):
            record_xml_attribute("rank", str(rank))

        @pytest.mark.multirank(world_size=2)
        def test_subtests(rank, subtests):
            with subtests.test(msg="one"):
                pass
        """,
        "-p",
        "cacheprovider",
    )
    ran.result.assert_outcomes(passed=2, failed=1)
    ran.lines(
        "fixture 'subtests' cannot work in a multirank test: a sub-test reports its own outcome to the session, and a"
        " rank's reports would be lost or made once per rank; use parametrize, or assert per rank in the body"
    )


def test_ranks_are_seeded_as_pytest_randomly_seeds_the_session(pytester) -> None:
    # pytest-randomly's hooks, as its plugin registers them (by the name "randomly")
    pytester.makeconftest(
        """
        import random
        import zlib

        class Randomly:
            def pytest_runtest_setup(self, item):
                random.seed(zlib.crc32(item.nodeid.encode()) - 1)

            def pytest_runtest_call(self, item):
                random.seed(zlib.crc32(item.nodeid.encode()))

        def pytest_configure(config):
            config.pluginmanager.register(Randomly(), "randomly")
        """
    )
    pytester.makepyfile(
        test_seeded="""
        import random
        import zlib
        import pytest

        def expected(nodeid):
            return random.Random(zlib.crc32(nodeid.encode())).random()

        @pytest.mark.multirank(world_size=2)
        def test_drawn(rank, request):
            assert random.random() == expected(request.node.nodeid)

        def test_plain(request):
            assert random.random() == expected(request.node.nodeid)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_a_fixture_of_any_scope_may_use_rank_and_world_size_in_multirank_and_plain_tests(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.fixture(scope="session")
        def shard(rank, world_size):
            return (rank, world_size)

        @pytest.mark.multirank(world_size=[1, 2])
        def test_sizes(rank, world_size, shard):
            assert shard == (rank, world_size)

        @pytest.mark.multirank(world_size=3)
        def test_three(shard, rank):
            assert shard == (rank, 3)

        def test_plain(shard, rank, world_size):
            assert shard == (rank, world_size) == (0, 1)
        """
    )
    ran.result.assert_outcomes(passed=4)


@pytest.mark.parametrize(("disabled", "fixture"), [("logging", "caplog"), ("capture", "capsys")])
def test_a_fixture_whose_plugin_is_disabled_is_not_found_as_in_a_plain_test(inner, disabled, fixture) -> None:
    ran = inner(
        f"""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_ranks(rank, {fixture}):
            pass

        @pytest.mark.multirank(world_size=2)
        def test_without_it(rank):
            pass
        """,
        "-p",
        f"no:{disabled}",
    )
    ran.result.assert_outcomes(errors=1, passed=1)
    ran.lines(f"E       fixture '{fixture}' not found")
    ran.no_lines("*is not available in the rank*")


def test_an_async_fixture_set_up_in_the_ranks_is_refused_by_name(inner) -> None:
    """Ranks call fixtures directly, not through anyio's or pytest-asyncio's setup hook: an async
    fixture that depends on the rank was a coroutine never awaited (a test not looking at its
    value passed with the fixture's setup never run). One that does not is set up in the pytest
    process, by anyio, and reaches the ranks (silent)."""
    ran = inner(
        """
        import pytest

        @pytest.fixture
        def anyio_backend():
            return "asyncio"

        @pytest.fixture
        async def server(rank):
            yield f"server-{rank}"

        @pytest.fixture
        async def address():
            return "127.0.0.1:80"

        @pytest.mark.anyio
        @pytest.mark.multirank(world_size=2)
        async def test_uses_server(server):
            pass

        @pytest.mark.anyio
        @pytest.mark.multirank(world_size=2)
        async def test_uses_address(address):
            assert address == "127.0.0.1:80"
        """
    )
    ran.result.assert_outcomes(passed=1, errors=1)
    ran.lines(
        "  rank 0: failed in fixture setup: Failed: fixture 'server' is async and is set up inside the ranks (it"
        " depends on a fixture of the rank), where fixtures are called directly, not through anyio or"
        " pytest-asyncio, so it would never be awaited: *"
    )


def test_getfixturevalue_of_a_fixture_nowhere_raises_what_pytest_raises(inner) -> None:
    """The optional-fixture idiom catches pytest.FixtureLookupError: in a rank a bare LookupError
    ('not available in the rank') escaped it. Uncaught, it says what pytest says."""
    ran = inner(
        """
        import pytest

        def optional(request, name, default):
            try:
                return request.getfixturevalue(name)
            except pytest.FixtureLookupError:
                return default

        @pytest.mark.multirank(world_size=2)
        def test_optional(rank, request):
            assert optional(request, "gpu_device", "cpu") == "cpu"

        @pytest.mark.multirank(world_size=2)
        def test_required(rank, request):
            request.getfixturevalue("gpu_device")
        """
    )
    ran.result.assert_outcomes(passed=1, failed=1)
    ran.lines("  rank 0: failed: *fixture 'gpu_device' not found")
    ran.no_lines("*is not available in the rank*")


def test_request_in_a_fixture_set_up_in_the_ranks_has_what_fixtures_commonly_read(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.fixture
        def in_test_dir(monkeypatch, request):
            monkeypatch.chdir(request.path.parent)
            assert request.fspath.dirname == str(request.path.parent)
            assert request.session is request.node.session
            request.applymarker(pytest.mark.slow)
            return request.scope, request.param_index

        @pytest.fixture
        def uses_an_attribute_it_lacks(rank, request):
            import copy

            assert copy.copy(request).fixturename == "uses_an_attribute_it_lacks"
            return request._pyfuncitem

        @pytest.mark.multirank(world_size=2)
        def test_in_dir(rank, in_test_dir, request):
            assert in_test_dir == ("function", 0)
            assert request.node.get_closest_marker("slow") is not None

        @pytest.mark.multirank(world_size=2)
        def test_lacking(uses_an_attribute_it_lacks):
            pass
        """
    )
    ran.result.assert_outcomes(passed=1, errors=1)
    ran.lines(
        "  rank 0: failed in fixture setup: AttributeError: request._pyfuncitem is not available to fixture"
        " 'uses_an_attribute_it_lacks', which is set up inside the ranks *"
    )
