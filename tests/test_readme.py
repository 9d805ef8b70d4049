"""The README's examples run as written: the script (on a free port) and the
Quick start's notebook cells (in a real kernel)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_ports

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.multiprocess
def test_readme_example_runs(tmp_path: Path) -> None:
    text = README.read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start:text.index("```", start)]
    (port,) = free_ports(1)
    script = tmp_path / "example.py"
    script.write_text(code.replace('MASTER_PORT="29500"', f'MASTER_PORT="{port}"'))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["tensor([2., 2.])", "tensor([3., 3.]) tensor([0., 0., 0.])"]


def quick_start_cells(text: str) -> list[str]:
    """The ``ipython`` blocks of the README's Quick start, one cell each.

    >>> quick_start_cells("## Quick start\\n```ipython\\na\\n```\\n```text\\nb\\n```\\n## Next\\n")
    ['a']
    """
    section = text[text.index("## Quick start\n"):]
    section = section[:section.index("\n## ", 1)]
    return [cell.strip() for cell in re.findall(r"```ipython\n(.*?)```", section, flags=re.S)]


@pytest.mark.cluster
def test_readme_quick_start_runs_in_a_kernel(tmp_path: Path) -> None:
    """The Quick start's cells, as a new notebook in a real kernel: no cell fails,
    the remote call answers as the README shows, the views display, and the
    cluster stops. Its time is printed (the README says "well under a minute")."""
    import nbformat
    from nbclient import NotebookClient

    cells = quick_start_cells(README.read_text())
    assert [c.splitlines()[0] for c in cells] == [
        "%load_ext nbrpc", "from nbrpc import rpc", "import nbrpc, torch",
        "from nbrpc import debug", "%rpc_cluster stop"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    t0 = time.monotonic()
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    print(f"\nREADME quick start: {time.monotonic() - t0:.1f} s in a fresh kernel")
    outputs = [cell.outputs for cell in nb.cells]
    assert [o["data"]["text/plain"] for o in outputs[1] if o["output_type"] == "execute_result"] \
        == ["'hello from worker1'"]
    for i in (0, 2, 3):  # the cluster view, the RRef graph, the trace: widgets
        shown = [o for o in outputs[i] if o["output_type"] in ("display_data", "execute_result")]
        assert any("application/vnd.jupyter.widget-view+json" in o["data"] for o in shown), \
            f"cell {i} showed no widget: {outputs[i]}"
    assert not [o for cell in outputs for o in cell if o["output_type"] == "error"]
