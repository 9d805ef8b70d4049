"""``make lab`` as a new user runs it: as root (containers, Binder-like images) and
as an ordinary user, with extra JupyterLab arguments, serving the tutorials from
copies so the tracked notebooks stay as committed, and stopped by one Ctrl-C.

Each run works in a copy of the repository's Makefile, pyproject.toml, tools/ and
notebooks/, with ``.venv`` linked to this environment (its stamps are newer than
the copied pyproject.toml, so nothing is installed), on a port the server picks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import local_user, poll_for, poll_or_fail

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv"
LAB_USER = "nbrpc-lab"
URL = re.compile(r"^\s+(http://127\.0\.0\.1:\d+/lab\?token=\w+)\s*$", re.M)
START_TIMEOUT = 150.0  # s: a cold JupyterLab on a busy 2-core machine
EDITED = '{"a reader": "edited this copy"}'


def _tree(root: Path) -> Path:
    """A copy of what `make lab` reads, with the environment linked in."""
    stamp = VENV / ".installed-lab"
    if not stamp.exists():
        pytest.skip(f"no {stamp}: build the environment first (make test does)")
    tree = root / "repo"
    tree.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(REPO / name, tree / name)  # keeps its mtime: older than the stamp
    for name in ("tools", "notebooks"):
        shutil.copytree(REPO / name, tree / name)
    (tree / ".venv").symlink_to(VENV)
    kept = tree / "lab" / sorted((REPO / "notebooks").glob("*.ipynb"))[0].name
    kept.parent.mkdir()
    kept.write_text(EDITED)  # a reader's earlier work, which make lab must keep
    return tree


class LabRun:
    """`make lab LAB_ARGS=...` in ``tree``, its output in a file, in its own session."""

    def __init__(self, tree: Path, env: dict[str, str], prefix: list[str]) -> None:
        self.log = tree.parent / "make-lab.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [*prefix, "make", "lab", "LAB_ARGS=--no-browser --port=0"],
                cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def url(self) -> str:
        found = poll_or_fail(lambda: URL.search(self.output()) or self.proc.poll() is not None,
                             START_TIMEOUT, lambda: f"the URL; output:\n{self.output()[-3000:]}",
                             interval=0.2)
        assert found is not True, f"make lab exited ({self.proc.returncode}):\n{self.output()}"
        return found.group(1)

    def members(self) -> list[psutil.Process]:
        try:
            return [p for p in psutil.process_iter() if os.getpgid(p.pid) == self.proc.pid]
        except (ProcessLookupError, psutil.Error):
            return []

    def ctrl_c(self) -> None:
        """What a terminal's Ctrl-C does: SIGINT to the whole foreground group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def kill(self) -> None:
        for p in self.members():  # only what this run started (its own session)
            try:
                p.kill()
            except psutil.Error:
                pass


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _served(url: str) -> list[str]:
    base, token = url.split("/lab?token=")
    with urllib.request.urlopen(f"{url}", timeout=30) as page:
        assert page.status == 200 and b"JupyterLab" in page.read()
    with urllib.request.urlopen(f"{base}/api/contents?token={token}", timeout=30) as listing:
        return sorted(item["name"] for item in json.load(listing)["content"])


def _lab_serves_the_tutorials(tree: Path, env: dict[str, str], prefix: list[str]) -> None:
    tutorials = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    committed = {p: p.read_bytes() for p in (tree / "notebooks").glob("*.ipynb")}
    run = LabRun(tree, env, prefix)
    try:
        url = run.url()
        out = run.output()
        assert "--allow-root" not in out  # no complaint about root, whoever we are
        assert "Running as root is not recommended" not in out
        assert _served(url) == tutorials
        procs = run.members()
        assert procs, "no process left in make lab's session while it serves"
        run.ctrl_c()
        assert poll_for(lambda: not _alive(procs), timeout=30, interval=0.1), \
            f"still running after Ctrl-C: {[p.cmdline() for p in _alive(procs)]}"
    finally:
        run.kill()
    # the reader's copy is kept, the others are fresh copies, the tracked ones untouched
    assert (tree / "lab" / tutorials[0]).read_text() == EDITED
    assert sorted(p.name for p in (tree / "lab").glob("*.ipynb")) == tutorials
    assert {p: p.read_bytes() for p in (tree / "notebooks").glob("*.ipynb")} == committed


def test_make_lab_as_root(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("runs as root only when the tests do (the ordinary-user case covers the rest)")
    tree = _tree(tmp_path)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "JUPYTER_RUNTIME_DIR":
           str(tmp_path / "runtime")}
    _lab_serves_the_tutorials(tree, env, prefix=[])


@pytest.fixture
def ordinary_user() -> tuple[int, int]:
    """Ourselves unless we are root; else a second local user made for this."""
    return (os.getuid(), os.getgid()) if os.geteuid() != 0 else local_user(LAB_USER)


def _can_run_make_lab(tree: Path, env: dict[str, str], prefix: list[str]) -> None:
    """Skip unless ``prefix`` may run the environment's Python as make would (from the
    tree, through ``.venv``): a venv whose interpreter lies in root's 0700 home (pyenv)
    is closed to every other user."""
    probe = subprocess.run([*prefix, "sh", "-c", ".venv/bin/python -c 'import jupyterlab'"],
                           cwd=tree, env=env, capture_output=True, text=True, timeout=60)
    if probe.returncode:
        pytest.skip(f"{LAB_USER} may not run {VENV}/bin/python (its interpreter is "
                    f"{Path(VENV / 'bin' / 'python').resolve()}; a parent directory closed to "
                    f"others?): {probe.stderr.strip()[-300:]}")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory under /tmp that another user can reach (pytest's tmp_path is in a
    0700 directory of ours)."""
    path = Path(tempfile.mkdtemp(prefix="nbrpc-lab-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_make_lab_as_an_ordinary_user(open_dir: Path, ordinary_user: tuple[int, int]) -> None:
    uid, gid = ordinary_user
    tree = _tree(open_dir)
    home = open_dir / "home"
    home.mkdir()
    prefix: list[str] = []
    if os.geteuid() == 0:
        for path in [open_dir, *open_dir.rglob("*")]:
            os.lchown(path, uid, gid)
        prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "LANG": "C.UTF-8"}
    _can_run_make_lab(tree, env, prefix)
    _lab_serves_the_tutorials(tree, env, prefix)
