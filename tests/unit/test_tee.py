"""The console's tee of rank 0's log files (`launcher.run.tee`)."""

from __future__ import annotations

import io
import time

import pytest

from launcher.run.tee import Tee


def _append(path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_every_line_reaches_its_stream_whole_with_the_prefix(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    stdout, stderr = tmp_path / "stdout.log", tmp_path / "stderr.log"
    _append(stdout, "first\nsec")
    with Tee([(str(stdout), out), (str(stderr), err)], "[rank0]:", poll_s=0.005):
        time.sleep(0.05)  # the tee has seen half a line by now
        _append(stdout, "ond\n\nthird\n")
        _append(stderr, "a warning\r with a carriage return\n")  # created after the tee started
        time.sleep(0.05)
        _append(stdout, "last, without its newline")
    assert out.getvalue() == "[rank0]:first\n[rank0]:second\n[rank0]:\n[rank0]:third\n[rank0]:last, without its newline\n"
    assert err.getvalue() == "[rank0]:a warning\r with a carriage return\n"


@pytest.mark.timeout(20)
def test_the_end_of_the_block_copies_the_rest_without_waiting_for_a_poll(tmp_path):
    # A tee that slept between polls would end a minute after its block (the timeout fails it).
    out = io.StringIO()
    path = tmp_path / "stdout.log"
    with Tee([(str(path), out)], "[rank0]:", poll_s=60):
        time.sleep(0.05)  # the tee found nothing and waits for its next poll
        _append(path, "written at the very end\n")
    assert out.getvalue() == "[rank0]:written at the very end\n"


def test_a_file_that_never_appears_is_no_error(tmp_path):
    out = io.StringIO()
    with Tee([(str(tmp_path / "absent.log"), out)], "[rank0]:", poll_s=0.005):
        time.sleep(0.02)
    assert out.getvalue() == ""
