"""The Binder environment, built from ``binder/`` alone, runs every tutorial.

What mybinder.org does (repo2docker, Python buildpack): it clones the repository,
and since a ``binder/`` folder exists it reads configuration only from there
(the root ``pyproject.toml`` is ignored). ``binder/runtime.txt`` picks Python
3.11 for its base environment, which already holds JupyterLab 4, notebook 7 and
ipywidgets 8 (and so ipykernel, nbconvert and nbclient). In the repository root
it then runs ``pip install --no-cache-dir -r binder/requirements.txt`` into that
same environment, and JupyterLab serves the notebooks with that environment's
``python3`` kernel.

What this test does instead, with no Docker and no network: a fresh virtualenv
(``python -m venv``, no system site packages) of this interpreter's Python, a
copy of the working tree without the ignored paths (``.venv``, ``build``,
``*.egg-info``...: a fresh clone has none, and pip's in-tree build of ``.`` then
writes into the copy, never into the repository), ``binder/requirements.txt``
installed alone with the venv's pip from the copy's root, then ``ipykernel`` and
``nbclient`` only, as stand-ins for repo2docker's base environment, and ``nbval``
(with pytest) to compare. The venv's torch must be the CPU build 2.13.0 with no
``nvidia-*`` package, the kernel must be the venv's interpreter, and every
``notebooks/*.ipynb`` must run top to bottom in it under nbval, each cell bounded,
and match its saved outputs (the cells' ``text/plain``;
``notebooks/nbval_sanitize.cfg`` masks what varies between runs). This is where
``make test`` compares the tutorials: they run once, in the environment Binder
would build (``make test-notebooks`` runs nbval in the development environment).

pip finds torch where this machine's pip configuration says (here a local
``torch-2.13.0+cpu`` wheel; ``download.pytorch.org`` may be unreachable), so this
checks ``binder/`` against what the CPU index serves, not the index itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
import pytest

# Safety net only: every step below has its own, shorter, subprocess timeout.
pytestmark = [pytest.mark.binder, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parent.parent
# Globbed at collection: tutorials still being written join when they land.
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
KERNEL = "nbrpc-binder"  # a name no kernel spec outside the venv can shadow
CELL_TIMEOUT = 120  # s per cell of the probe notebook (nbclient interrupts and fails)
NBVAL_CELL_TIMEOUT = 90  # s per tutorial cell, as the Makefile's NBVAL
NOTEBOOK_TIMEOUT = 600  # s per notebook, kernel start and shutdown included
PIP_TIMEOUT = 600  # s per pip install
# What a fresh clone does not have: ignored paths and build leftovers.
NOT_CLONED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", ".gl")
# The parent's environment that must not reach the venv: an import path, an
# active environment, pip targets, Jupyter/IPython/matplotlib settings, and
# PYTHONDONTWRITEBYTECODE (set on some CI machines, not on Binder: the venv's
# interpreters write the bytecode of what they import, as Binder's do).
LEAKY_PREFIXES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONDONTWRITEBYTECODE",
                  "VIRTUAL_ENV", "PIP_USER", "PIP_TARGET", "PIP_PREFIX",
                  "PIP_REQUIRE_VIRTUALENV", "JUPYTER", "JPY_", "IPYTHONDIR", "MPLBACKEND",
                  "MPLCONFIGDIR", "NBRPC_")

# Run by the venv's python: one notebook top to bottom, as "Run All" would; the
# executed copy is written even when a cell fails. A failing cell raises
# nbclient's CellExecutionError (the cell's source and traceback) on stderr.
RUNNER = """\
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

src, dst, kernel, timeout = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
nb = nbformat.read(src, as_version=4)
client = NotebookClient(nb, kernel_name=kernel, timeout=timeout,
                        resources={"metadata": {"path": str(src.parent)}})
try:
    client.execute()
finally:
    nbformat.write(nb, dst)
"""

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class BinderEnv:
    venv: Path
    python: Path  # the venv's interpreter
    repo: Path  # the copy of the working tree pip ran in
    scratch: Path  # runner script, executed notebooks
    env: dict[str, str]  # environment of every subprocess


def _run(cmd: list[str | Path], *, cwd: Path, env: dict[str, str], timeout: float,
         what: str) -> str:
    """Runs ``cmd``; fails the test with the output's tail if it fails or outlives
    ``timeout`` (then kills it and what it started: kernels run in their own
    session, so a process group would miss them)."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        for p in [*tree, proc]:
            try:
                p.kill()
            except (psutil.Error, ProcessLookupError):
                pass
        out, _ = proc.communicate()
        pytest.fail(f"{what}: still running after {timeout:.0f} s, killed\n"
                    f"{ANSI.sub('', out)[-4000:]}")
    assert proc.returncode == 0, (f"{what}: exit status {proc.returncode}\n"
                                  f"{ANSI.sub('', out)[-6000:]}")
    return out


@pytest.fixture(scope="module")
def binder_env(tmp_path_factory: pytest.TempPathFactory) -> BinderEnv:
    if importlib.util.find_spec("venv") is None or importlib.util.find_spec("ensurepip") is None:
        pytest.skip(f"{sys.executable} cannot make virtualenvs (no venv/ensurepip module; "
                    "on Debian: apt-get install python3-venv)")
    root = tmp_path_factory.mktemp("binder")
    repo, venv, scratch = root / "repo", root / "venv", root / "scratch"
    shutil.copytree(REPO, repo, ignore=NOT_CLONED, symlinks=True)
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(LEAKY_PREFIXES)}
    env.update(
        PYTHONNOUSERSITE="1",
        # An unreachable index (download.pytorch.org here) must not stall pip.
        PIP_DEFAULT_TIMEOUT="5", PIP_RETRIES="1", PIP_NO_INPUT="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        # A fresh home for Jupyter, IPython and matplotlib, as on Binder.
        JUPYTER_CONFIG_DIR=str(scratch / "jupyter-config"),
        JUPYTER_DATA_DIR=str(scratch / "jupyter-data"),
        IPYTHONDIR=str(scratch / "ipython"), MPLCONFIGDIR=str(scratch / "matplotlib"),
    )
    _run([sys.executable, "-m", "venv", venv], cwd=root, env=env, timeout=120,
         what="python -m venv")
    python = venv / "bin" / "python"
    # repo2docker: `${KERNEL_PYTHON_PREFIX}/bin/pip install --no-cache-dir -r
    # "binder/requirements.txt"` with the repository root as working directory.
    # One difference, --no-compile: pip would byte-compile every module of every
    # package (40 s of this fixture's 90 on 2 cores, mostly torch's); here the first
    # interpreter to import a module writes its bytecode, and the rest reuse it.
    _run([venv / "bin" / "pip", "install", "--no-cache-dir", "--no-compile", "-r",
          "binder/requirements.txt"],
         cwd=repo, env=env, timeout=PIP_TIMEOUT, what="pip install -r binder/requirements.txt")
    # Stand-ins for repo2docker's base environment (JupyterLab 4, notebook 7),
    # which brings these: the kernel, and what runs notebooks without a browser.
    _run([python, "-m", "pip", "install", "--no-cache-dir", "ipykernel", "nbclient"],
         cwd=repo, env=env, timeout=PIP_TIMEOUT, what="pip install ipykernel nbclient")
    # What compares the tutorials with their saved outputs (not on Binder: ours).
    _run([python, "-m", "pip", "install", "--no-cache-dir", "nbval", "pytest"],
         cwd=repo, env=env, timeout=PIP_TIMEOUT, what="pip install nbval pytest")
    _run([python, "-m", "ipykernel", "install", "--prefix", venv, "--name", KERNEL,
          "--display-name", "Python 3 (Binder venv)"],
         cwd=root, env=env, timeout=120, what="ipykernel install")
    (scratch / "run_notebook.py").write_text(RUNNER)
    return BinderEnv(venv=venv, python=python, repo=repo, scratch=scratch, env=env)


def _execute(b: BinderEnv, src: Path, dst: Path, what: str) -> nbformat.NotebookNode:
    _run([b.python, b.scratch / "run_notebook.py", src, dst, KERNEL, str(CELL_TIMEOUT)],
         cwd=src.parent, env=b.env, timeout=NOTEBOOK_TIMEOUT, what=what)
    return nbformat.read(dst, as_version=4)


def test_binder_env_has_cpu_torch_2_13_and_no_cuda_packages(binder_env: BinderEnv) -> None:
    b = binder_env
    probe = ("import json, sys, torch, nbrpc; print(json.dumps({'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'nbrpc': nbrpc.__file__, 'prefix': sys.prefix}))")
    # Run outside the copy: from its root, `import nbrpc` would find the source tree.
    info = json.loads(_run([b.python, "-c", probe], cwd=b.scratch, env=b.env, timeout=120,
                           what="import torch, nbrpc").strip().splitlines()[-1])
    assert info["torch"].startswith("2.13.0") and info["cuda"] is None, info
    venv = b.venv.resolve()
    assert Path(info["prefix"]).resolve() == venv, info
    assert Path(info["nbrpc"]).resolve().is_relative_to(venv), f"nbrpc is not the venv's: {info}"

    listed = _run([b.python, "-m", "pip", "list", "--format=json"], cwd=b.scratch, env=b.env,
                  timeout=120, what="pip list")
    names = sorted(p["name"].lower() for p in json.loads(listed))
    cuda = [n for n in names if n.startswith("nvidia") or n == "triton"]
    assert not cuda, f"CUDA packages in the Binder env: {cuda}"
    assert "gymnasium" in names, f"the tutorials extra was not installed: {names}"
    _run([b.python, "-m", "pip", "check"], cwd=b.scratch, env=b.env, timeout=120,
         what="pip check")

    # The widgets' front ends, prebuilt, where JupyterLab (same env on Binder) finds them.
    labext = b.venv / "share" / "jupyter" / "labextensions"
    for ext in ("anywidget", "@jupyter-widgets/jupyterlab-manager"):
        assert (labext / ext / "package.json").is_file(), f"no JupyterLab extension {ext}"


def test_kernel_is_the_venv_interpreter(binder_env: BinderEnv) -> None:
    b = binder_env
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("import sys, nbrpc\nprint(sys.prefix)"))
    src = b.scratch / "probe.ipynb"
    nbformat.write(nb, src)
    done = _execute(b, src, b.scratch / "probe.out.ipynb", what="probe notebook")
    printed = "".join(o.get("text", "") for o in done.cells[0].outputs).strip()
    assert Path(printed).resolve() == b.venv.resolve(), f"the kernel ran in {printed!r}, not in the venv {b.venv}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_matches_its_saved_outputs(binder_env: BinderEnv, notebook: Path) -> None:
    """nbval, run by the venv's pytest in the copy's root: the kernel is the
    venv's interpreter (``--nbval-current-env``), every cell runs and its
    ``text/plain`` is compared, sanitized."""
    b = binder_env
    src = b.repo / "notebooks" / notebook.name
    assert src.is_file(), f"{notebook.name} vanished after collection"
    out = _run([b.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                "--nbval-current-env", "--nbval-sanitize-with", "notebooks/nbval_sanitize.cfg",
                f"--nbval-cell-timeout={NBVAL_CELL_TIMEOUT}", f"notebooks/{notebook.name}"],
               cwd=b.repo, env=b.env, timeout=NOTEBOOK_TIMEOUT,
               what=f"nbval of {notebook.name} in the Binder env")
    summary = ANSI.sub("", out).strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, out[-4000:]
