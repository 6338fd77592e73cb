"""The order xdist workers take the modules in (tests/conftest.py) and the durations file it reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._tools_helpers import load_tool
from tests.conftest import SUITE_DURATIONS, suite_order


def test_longest_modules_first_new_ones_last_in_their_order() -> None:
    known = sorted(SUITE_DURATIONS, key=lambda n: -SUITE_DURATIONS[n])[:3]
    order = suite_order(["test_new_b.py", *reversed(known), "test_new_a.py", known[0]])
    assert order == [*known, "test_new_b.py", "test_new_a.py"]


def test_structured_outputs_waits_for_the_first_round() -> None:
    order = suite_order(sorted(SUITE_DURATIONS))
    assert order.index("test_structured_outputs.py") == 8
    assert order.index("test_demo_learning.py") == 0
    assert sorted(order) == sorted(SUITE_DURATIONS)


def test_durations_file_is_written_from_a_durations_log() -> None:
    tool = load_tool("suite_durations.py")
    log = ("============ slowest durations ============\n"
           "12.50s call     tests/test_a.py::test_x[p-1]\n"
           "2.00s setup    tests/test_b.py::test_y\n"
           "1.25s teardown tests/test_a.py::test_z\n"
           "(3 durations < 0.005s hidden.)\n")
    assert tool.file_durations(log) == {"test_a.py": 13.8, "test_b.py": 2.0}


def test_cpu_table_sums_each_modules_tests(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tool = load_tool("suite_cpu.py")
    (tmp_path / "gw0.json").write_text('[["tests/test_a.py::x", 3.0], ["tests/test_b.py::y", 1.0]]')
    (tmp_path / "gw1.json").write_text('[["tests/test_a.py::z", 4.0]]')
    monkeypatch.setattr("sys.argv", ["suite_cpu.py", str(tmp_path)])
    tool.main()
    assert capsys.readouterr().out.splitlines() == ["8 cpu-s in 2 modules", "    7.0   87.5%  tests/test_a.py",
                                                    "    1.0  100.0%  tests/test_b.py"]
