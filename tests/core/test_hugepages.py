"""The fork server's memory in huge pages: what the kernel allows is done, nothing else."""

from __future__ import annotations

import subprocess
import sys

from pytest_ddphooks.launch import hugepages


def test_the_kernel_setting_is_read_from_its_brackets(tmp_path, monkeypatch) -> None:
    setting = tmp_path / "enabled"
    monkeypatch.setattr(hugepages, "THP_SETTING", str(setting))
    setting.write_text("always [madvise] never\n")
    assert hugepages.thp_mode() == "madvise"
    setting.write_text("garbage\n")
    assert hugepages.thp_mode() == ""


def test_without_transparent_huge_pages_nothing_is_done_and_the_reason_is_given(tmp_path, monkeypatch) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "THP_SETTING", str(setting))
    done = hugepages.collapse()
    assert (done.regions, done.reason) == (0, "transparent huge pages are never")
    monkeypatch.setattr(hugepages, "THP_SETTING", str(tmp_path / "missing"))
    assert hugepages.collapse().reason == "transparent huge pages are unavailable"


def test_regions_are_private_writable_anonymous_memory_in_whole_huge_pages() -> None:
    for start, end in hugepages._anonymous_regions():
        assert start % hugepages.HUGE == 0 and end % hugepages.HUGE == 0 and end > start


def test_a_process_with_torch_has_its_memory_collapsed_where_the_kernel_can() -> None:
    code = (
        "import torch\n"
        "from pytest_ddphooks.launch import hugepages\n"
        "done = hugepages.collapse()\n"
        "print(done.regions, done.huge_bytes, repr(done.reason))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 2)
    regions, huge_bytes, reason = int(out[0]), int(out[1]), out[2].strip()
    if hugepages.thp_mode() in ("always", "madvise") and regions:
        assert huge_bytes >= hugepages.HUGE and reason == "''"
    else:  # an older kernel or THP off: nothing done, and it says why
        assert regions == 0 and reason != "''"
