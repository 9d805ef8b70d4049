"""The README's example runs as written (on a free port)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.multiprocess
def test_readme_example_runs(tmp_path: Path) -> None:
    text = README.read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start:text.index("```", start)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "example.py"
    script.write_text(code.replace('MASTER_PORT="29500"', f'MASTER_PORT="{port}"'))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["tensor([2., 2.])", "tensor([3., 3.]) tensor([0., 0., 0.])"]
