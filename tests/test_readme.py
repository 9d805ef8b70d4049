"""The README's examples run as written: the script (on a free port) and the
Quick start's notebook cells (in a real kernel). And the documentation holds
together: every relative link of the README, ``docs/`` and the tutorials'
text names a file that exists (and a heading of it, where it names one), and
every Markdown table has its header row."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_ports

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


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


def markdown_prose(text: str) -> str:
    """``text`` without its fenced code blocks (whose brackets are code, not links).

    >>> markdown_prose("a\\n```python\\nx[1](2)\\n```\\nb")
    'a\\nb'
    """
    return re.sub(r"^```.*?^```\n?", "", text, flags=re.S | re.M)


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading.

    >>> heading_anchor("GPUs: `gpus=True` and `device_maps`")
    'gpus-gpustrue-and-device_maps'
    >>> heading_anchor("PyTorch's own tests")
    'pytorchs-own-tests'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def relative_links(text: str) -> list[str]:
    """The targets of ``[text](target)`` links and images that are not URLs.

    >>> relative_links("see [a](docs/a.md#x), ![i](img/i.png) and [w](https://x.org)")
    ['docs/a.md#x', 'img/i.png']
    """
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", markdown_prose(text))
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def broken_links(source: Path, text: str) -> list[str]:
    """Each relative link of ``text`` (found in ``source``) that names a missing
    file, or a heading its file does not have."""
    broken = []
    for target in relative_links(text):
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if not file.exists():
            broken.append(f"{source.name}: {target} (no such file)")
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", markdown_prose(file.read_text()), flags=re.M)
            if anchor not in {heading_anchor(h) for h in headings}:
                broken.append(f"{source.name}: {target} (no such heading)")
    return broken


def test_documentation_links_resolve() -> None:
    broken = [b for doc in DOCS for b in broken_links(doc, doc.read_text())]
    for nb in NOTEBOOKS:
        cells = json.loads(nb.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        broken += broken_links(nb, text)
    assert not broken, "\n".join(broken)
    assert len(relative_links(README.read_text())) > 10  # the README does link its pages


def tables_without_header(text: str) -> list[str]:
    """The first row of each table in ``text`` not followed by a delimiter row
    (GitHub then shows the table as plain text).

    >>> tables_without_header("| a | b |\\n|---|:--:|\\n| 1 | 2 |\\n\\n| c |\\n| 3 |\\n")
    ['| c |']
    """
    lines = markdown_prose(text).splitlines()
    return [line for i, line in enumerate(lines)
            if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
            and not (i + 1 < len(lines) and re.fullmatch(r"\|( *:?-+:? *\|)+", lines[i + 1]))]


def test_documentation_tables_have_headers() -> None:
    missing = {doc.name: rows for doc in DOCS if (rows := tables_without_header(doc.read_text()))}
    assert not missing, missing
