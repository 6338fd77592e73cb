"""tools/suite_cpu.py's table of a suite run's CPU seconds per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._tools_helpers import load_tool


def test_cpu_table_sums_each_modules_tests(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tool = load_tool("suite_cpu.py")
    (tmp_path / "gw0.json").write_text('[["tests/test_a.py::x", 3.0, 100.0, 104.0], '
                                       '["tests/test_b.py::y", 1.0, 104.0, 110.5]]')
    (tmp_path / "gw1.json").write_text('[["tests/test_a.py::z", 4.0, 101.0, 103.0]]')
    monkeypatch.setattr("sys.argv", ["suite_cpu.py", str(tmp_path)])
    tool.main()
    assert capsys.readouterr().out.splitlines() == ["8 cpu-s in 2 modules", "    7.0   87.5%  tests/test_a.py",
                                                    "    1.0  100.0%  tests/test_b.py",
                                                    "workers' tests ran (s from the first start): gw0 0-10, gw1 1-3"]
