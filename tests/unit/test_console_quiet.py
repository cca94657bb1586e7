"""The console while and after a run: rank 0's INFO records stay in its log files (`-v` shows
them), a rank's traceback holds none, and the run names its folder and page at its end."""

from __future__ import annotations

import io
import json

import pytest

from launcher.report import console
from launcher.report.run_page import write_result_and_page
from launcher.run import launch, tee

from .test_verdict_renderers import huge_value_in_cache


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rank0_info_records_stay_in_the_log_unless_verbose(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text("03:39:28 rank0 INFO phase layer done (0.04s)\n03:39:28 rank0 WARNING slow\nan impl's print\n")
    quiet, loud = _Terminal(), io.StringIO()
    with tee.Tee([(str(log), quiet)], "[rank0]:", poll_s=0.005):
        pass
    assert quiet.getvalue() == "\r\x1b[2K[rank0]:03:39:28 rank0 WARNING slow\n[rank0]:an impl's print\n"
    tee.show_log_records()
    try:
        with tee.Tee([(str(log), loud)], "[rank0]:", poll_s=0.005):
            pass
    finally:
        tee.show_log_records(False)
    assert "INFO phase layer done" in loud.getvalue() and "\x1b" not in loud.getvalue()


def test_a_ranks_traceback_holds_no_info_records(tmp_path):
    (tmp_path / "stderr.log").write_text("03:39:28 rank1 INFO phase layer ...\nTraceback (most recent call last):\n"
                                         "RuntimeError: boom\n")
    assert launch._stderr_tail(str(tmp_path)) == "Traceback (most recent call last):\nRuntimeError: boom"


@pytest.mark.parametrize("bench", [None, {"profiles": ["profile/rank0.json"]}])
def test_the_folder_line_names_the_page_and_the_profiles(tmp_path, bench):
    result = {**huge_value_in_cache(), **({"bench": bench} if bench else {})}
    write_result_and_page(str(tmp_path), result)
    text = console.where_line(str(tmp_path), json.loads((tmp_path / "result.json").read_text()))
    assert text.startswith(f"run folder: {tmp_path}; page: {tmp_path / 'report.html'}")
    assert (f"profiles: {tmp_path / 'profile' / 'rank0.json'}" in text) == bool(bench)
