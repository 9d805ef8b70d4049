"""tests/rerun_report.py: a test that failed once and passed on its rerun leaves
the end of its first failure in the log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_rerun_tests_first_failure_is_printed_after_the_run(tmp_path: Path) -> None:
    (tmp_path / "test_once.py").write_text(
        "import pytest\n"
        "@pytest.mark.flaky(reruns=1)\n"
        "def test_fails_the_first_time(tmp_path_factory):\n"
        f"    mark = __import__('pathlib').Path({str(tmp_path / 'mark')!r})\n"
        "    if not mark.exists():\n"
        "        mark.write_text('seen')\n"
        "        raise AssertionError('a failure seen once: the marker was missing')\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "rerun_report",
                        "-p", "no:cacheprovider", str(tmp_path / "test_once.py")],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 1 rerun" in r.stdout, r.stdout
    summary = r.stdout[r.stdout.index("why test_once.py::test_fails_the_first_time ran again"):]
    assert "AssertionError: a failure seen once: the marker was missing" in summary
