"""The real-browser tier's machinery: JupyterLab on loopback, Debian's Chromium
driven by Playwright, and the few page actions a person would take.

:class:`Lab` runs ``jupyter lab`` in a directory of its own (a temporary copy
of the notebooks, with its own Jupyter config, data, runtime, settings and
IPython dirs, so the repository's saved outputs and the user's set-up are
never touched), on 127.0.0.1, a free port and a fresh token; it is stopped by
its pid: its kernels first (through the REST API), then its process group,
then whatever it had started that is still alive (each by pid).

:class:`Notebook` is one open notebook page: wait for its kernel, Run All
through the Run menu, wait (bounded) until every cell has run, save, read
back the saved outputs, find widgets, take screenshots.

Nothing here downloads a browser: :func:`chromium_path` finds Debian's
``chromium`` (or ``$NBRPC_CHROMIUM``) and the tier skips, saying why, when
there is none.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from conftest import poll_or_fail

# Debian's package puts its launcher here; the binary itself is /usr/lib/chromium/chromium.
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/lib/chromium/chromium",
                       "/usr/bin/chromium-browser")
# What a widget that failed to render says in JupyterLab (ipywidgets' manager).
WIDGET_ERROR = "Error displaying widget"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# User settings of the Lab under test: no news or update checks (no network, no
# toasts over the notebook), no autosave racing with ours.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


def chromium_path() -> str | None:
    """Debian's Chromium (``$NBRPC_CHROMIUM`` first), or None."""
    env = os.environ.get("NBRPC_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for cand in (*CHROMIUM_CANDIDATES, shutil.which("chromium")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def why_no_browser() -> str | None:
    """Why the browser tier cannot run here (None when it can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as e:
        return (f"playwright is not installed ({e}); `make test` installs it from the "
                "test extras: pip install -e '.[test]'")
    try:
        import jupyterlab  # noqa: F401
    except ImportError as e:
        return f"jupyterlab is not installed ({e}); pip install -e '.[test]'"
    if chromium_path() is None:
        return ("no Chromium: install Debian's package (`apt-get install -y chromium`, which "
                "`make test` does when it runs as root) or point $NBRPC_CHROMIUM at one; "
                "this tier never downloads browser builds")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred: Callable[[], Any], timeout: float, what: Any,
               interval: float = 0.25) -> Any:
    """conftest's ``poll_or_fail``, polling a page at a gentler pace."""
    return poll_or_fail(pred, timeout, what, interval)


class Lab:
    """JupyterLab serving ``root`` on 127.0.0.1, with state kept under ``home``."""

    def __init__(self, root: Path, home: Path) -> None:
        self.root, self.home = Path(root), Path(home)
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.home / "lab.log"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str, query: str = "") -> str:
        return f"{self.base}/{path.lstrip('/')}?{query}{'&' if query else ''}token={self.token}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data",
                "JUPYTER_RUNTIME_DIR": "runtime", "JUPYTERLAB_SETTINGS_DIR": "settings",
                "JUPYTERLAB_WORKSPACES_DIR": "workspaces", "IPYTHONDIR": "ipython"}
        for var, sub in dirs.items():
            (self.home / sub).mkdir(parents=True, exist_ok=True)
            env[var] = str(self.home / sub)
        for name, settings in LAB_SETTINGS.items():
            path = self.home / "settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(settings))
        env["JUPYTER_PLATFORM_DIRS"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("JUPYTER_TOKEN", None)
        return env

    def start(self, timeout: float = 120.0) -> None:
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--ServerApp.terminals_enabled=False", "--LabApp.expose_app_in_browser=True",
               "--LabApp.news_url=None", "--LabApp.extension_manager=readonly",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:  # containers and CI runners
            cmd.append("--allow-root")
        env = self._env()  # makes self.home and its dirs
        log = open(self.log_path, "wb")  # noqa: SIM115 - the server writes it until stop()
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            wait_until(self._ready, timeout, lambda: f"JupyterLab to answer:\n{self.log_tail()}",
                       interval=0.5)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited ({self.proc.returncode}):\n{self.log_tail()}")
        try:
            return self.api("api/status") is not None
        except (OSError, urllib.error.URLError):
            return False

    def api(self, path: str, method: str = "GET", timeout: float = 10.0) -> Any:
        req = urllib.request.Request(self.url(path), method=method)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def kernels(self) -> list[dict[str, Any]]:
        return self.api("api/kernels")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """Shut its kernels down, then the server (its process group), then any
        process it had started that outlived it (each by pid)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            started = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            started = []
        if proc.poll() is None:
            try:
                for k in self.api("api/kernels"):
                    self.api(f"api/kernels/{k['id']}", method="DELETE", timeout=30)
            except (OSError, urllib.error.URLError, ValueError):
                pass  # the server is going anyway; its children are reaped below
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for p in started:  # kernels and engines live in process groups of their own
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(started, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass


# The notebook on show (others may be open in hidden tabs).
SHOWN = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"


class Notebook:
    """One notebook open in JupyterLab (or Notebook 7, ``app="notebook"``, served by
    the same server) in a Playwright page."""

    def __init__(self, lab: Lab, page: Any, name: str, app: str = "lab") -> None:
        self.lab, self.page, self.name, self.app = lab, page, name, app
        self.path = lab.root / name

    def open(self, timeout: float = 120.0) -> Notebook:
        """Open it alone (``?reset``: no tabs restored from earlier pages) and wait
        for its kernel."""
        where = f"lab/tree/{self.name}" if self.app == "lab" else f"notebooks/{self.name}"
        self.page.goto(self.lab.url(where, "reset" if self.app == "lab" else ""),
                       timeout=timeout * 1000)
        self.page.wait_for_selector(f"{SHOWN} .jp-Cell", timeout=timeout * 1000)
        if self.app == "lab" and self.page.locator("#jp-left-stack").is_visible():
            self.page.keyboard.press("Control+b")  # hide the file browser: room for the views
        wait_until(lambda: self.kernel_state() == "idle", timeout,
                   lambda: f"the kernel of {self.name} to be idle (now "
                           f"{self.kernel_state()!r})\n{self.lab.log_tail()}")
        return self

    def session(self) -> dict[str, Any] | None:
        for s in self.lab.api("api/sessions"):
            if s.get("path", "").endswith(self.name) and s.get("kernel"):
                return s
        return None

    def kernel_state(self) -> str | None:
        s = self.session()
        return None if s is None else s["kernel"].get("execution_state")

    def shutdown(self) -> None:
        """Stop its kernel (and what the kernel started: clusters stop with it)."""
        s = self.session()
        if s is not None:
            self.lab.api(f"api/sessions/{s['id']}", method="DELETE", timeout=60)

    def prompts(self) -> list[str]:
        """The input prompts of the code cells, as shown: ``[3]:``, ``[*]:``, ``[ ]:``."""
        return self.page.eval_on_selector_all(
            f"{SHOWN} .jp-CodeCell .jp-InputPrompt", "els => els.map(e => e.textContent)")

    def cells(self) -> Any:
        return self.page.locator(f"{SHOWN} .jp-Cell")

    def select(self, index: int) -> None:
        """Select cell ``index`` (markdown cells count), in command mode."""
        cell = self.cells().nth(index)
        cell.scroll_into_view_if_needed()
        cell.locator(".jp-InputPrompt").click()
        self.page.keyboard.press("Escape")
        wait_until(lambda: "jp-mod-selected" in (cell.get_attribute("class") or ""), 10,
                   f"cell {index} to be selected")

    def run_menu(self, item: str, timeout: float = 180.0) -> float:
        """Run > ``item`` ("Run All Cells", "Run All Above Selected Cell", ...), as a
        person would, then wait until no cell is queued or running and the kernel is
        idle. The seconds it took."""
        t0 = time.monotonic()
        before = self.prompts()
        self.page.click(".lm-MenuBar-itemLabel:text-is('Run')")
        self.page.click(f".lm-Menu-itemLabel:text-is('{item}')")
        wait_until(lambda: self.prompts() != before, 30, f"{item!r} to start a cell")

        def done() -> bool:
            return not any("*" in p for p in self.prompts()) and self.kernel_state() == "idle"

        wait_until(lambda: done() and (time.sleep(0.5) or done()), timeout,
                   lambda: f"{self.name} to finish running; prompts {self.prompts()}")
        return time.monotonic() - t0

    def run_all(self, timeout: float = 180.0) -> float:
        return self.run_menu("Run All Cells", timeout)

    def save(self, timeout: float = 30.0) -> dict[str, Any]:
        """Save through the File menu's shortcut and return the saved notebook's JSON."""
        before = self.path.stat().st_mtime_ns
        self.page.click(f"{SHOWN} .jp-Cell >> nth=0", position={"x": 4, "y": 4})
        self.page.keyboard.press("Escape")  # command mode: Ctrl+S saves the notebook
        self.page.keyboard.press("Control+s")
        wait_until(lambda: self.path.stat().st_mtime_ns != before, timeout,
                   f"{self.name} to be saved")
        return wait_until(self._read, 10, f"{self.name} to be readable")

    def _read(self) -> dict[str, Any] | None:
        import nbformat  # joins multi-line strings, which the .ipynb keeps as lists

        try:
            return nbformat.reads(self.path.read_text(), as_version=4)
        except (OSError, ValueError):
            return None

    def views(self) -> Any:
        """The rendered nbrpc widgets (their anywidget roots), in page order."""
        return self.page.locator(f"{SHOWN} .nbrpc-view")

    def assert_views_rendered(self, saved: dict[str, Any], timeout: float = 30.0) -> None:
        """One rendered view on the page per nbrpc widget output of the saved notebook
        (a view closed in a later cell leaves its outputs empty), and no widget errors."""
        want = len(view_outputs(saved))
        wait_until(lambda: self.views().count() == want, timeout,
                   lambda: f"{want} rendered nbrpc views (one per widget output, in cells "
                           f"{view_outputs(saved)}), found {self.views().count()}; a view "
                           "closed by a later cell shows nothing where it was displayed")
        self.assert_no_widget_errors()

    def assert_no_widget_errors(self) -> None:
        text = self.page.locator(SHOWN).text_content() or ""  # off-screen cells too
        assert WIDGET_ERROR not in text, _around(text, WIDGET_ERROR)

    def screenshot(self, locator: Any, path: Path) -> Path:
        """A PNG of ``locator``, its drawing scrolled back to the top left."""
        locator.scroll_into_view_if_needed()
        locator.locator(".nbrpc-main").evaluate("m => { m.scrollTop = 0; m.scrollLeft = 0; }")
        path.parent.mkdir(parents=True, exist_ok=True)
        locator.screenshot(path=str(path))
        return path


def view_outputs(nb: dict[str, Any]) -> list[int]:
    """The cells (by index) of each nbrpc widget output: a widget view with nbrpc's
    static HTML beside it."""
    return [i for i, cell in enumerate(nb.get("cells", [])) for out in cell.get("outputs", [])
            if "application/vnd.jupyter.widget-view+json" in out.get("data", {})
            and "nbrpc-static" in out.get("data", {}).get("text/html", "")]


def errors_in(nb: dict[str, Any]) -> list[str]:
    """The error outputs of a saved notebook: ``cell i: EName: value``."""
    found = []
    for i, cell in enumerate(nb.get("cells", [])):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                tb = ANSI.sub("", "\n".join(out.get("traceback", [])))[-1500:]
                found.append(f"cell {i}: {out.get('ename')}: {out.get('evalue')}\n{tb}")
    return found


def _around(text: str, needle: str, chars: int = 400) -> str:
    i = text.find(needle)
    return text[max(0, i - chars):i + chars]
