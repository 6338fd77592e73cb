"""A CLI start that fails in a test says why: the helper that waits for a command's announcement
(tests/_cli_helpers.wait_for) fails with the command's own output, not only its exit status."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests._cli_helpers import CLI, output_lines, wait_for


def test_a_serve_that_exits_before_its_url_shows_its_output(tmp_path: Path) -> None:
    proc = subprocess.Popen([str(CLI), "serve", "--config", str(tmp_path / "missing.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = output_lines(proc)
    with pytest.raises(AssertionError) as failed:
        wait_for(lines, "openai_base_url:", 120, proc)
    message = str(failed.value)
    assert "exited early with 2" in message
    assert f"config file not found: {tmp_path / 'missing.yaml'}" in message  # the command's own words


def test_a_line_that_never_comes_shows_the_output_so_far() -> None:
    last_line = subprocess.run([str(CLI), "model", "--help"], capture_output=True, text=True,
                               timeout=120).stdout.rstrip().splitlines()[-1]
    proc = subprocess.Popen([str(CLI), "model", "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = output_lines(proc)
    try:
        with pytest.raises((AssertionError, TimeoutError)) as failed:
            wait_for(lines, "no such line:", 30, proc)
        assert last_line in str(failed.value)
    finally:
        proc.wait(timeout=60)
