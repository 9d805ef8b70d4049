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
back the saved outputs, find widgets, take screenshots; and check how a view
reads: switch JupyterLab's theme, size the window for a given notebook column,
and measure every text's contrast and any overflow in the page
(``READABILITY_JS``).

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
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from conftest import free_ports, poll_or_fail

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


def wait_until(pred: Callable[[], Any], timeout: float, what: Any,
               interval: float = 0.25) -> Any:
    """conftest's ``poll_or_fail``, polling a page at a gentler pace."""
    return poll_or_fail(pred, timeout, what, interval)


class Lab:
    """JupyterLab serving ``root`` on 127.0.0.1, with state kept under ``home``."""

    def __init__(self, root: Path, home: Path) -> None:
        self.root, self.home = Path(root), Path(home)
        self.port, self.token = free_ports(1)[0], secrets.token_hex(16)
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

    def set_theme(self, theme: str, timeout: float = 30.0) -> None:
        """Switch the page's theme (``LIGHT``, ``DARK``) as the Settings menu does."""
        if self.app == "lab":
            self.page.evaluate("t => window.jupyterapp.commands.execute("
                               "'apputils:change-theme', {theme: t})", theme)
        else:  # Notebook 7 exposes no app object: its settings menu then
            self.page.click(".lm-MenuBar-itemLabel:text-is('Settings')")
            self.page.click(".lm-Menu-itemLabel:text-is('Theme')")
            self.page.click(f".lm-Menu-itemLabel:text-is('{theme}')")
        light = "true" if theme == LIGHT else "false"
        wait_until(lambda: self.page.evaluate(
            f"document.body.dataset.jpThemeLight === '{light}' && "
            f"document.body.dataset.jpThemeName === '{theme}'"), timeout, f"the {theme} theme")
        self.page.wait_for_timeout(300)  # (its stylesheet applied and laid out)

    def fit_column(self, view: Any, width: int) -> int:
        """Resize the window so that ``view``'s output area is ``width`` px wide
        (the notebook's column, less its prompt); the window's width."""
        area = view.locator("xpath=ancestor::*[contains(@class, 'jp-OutputArea-output')][1]")
        viewport = self.page.viewport_size
        for _ in range(3):  # the column follows the window less a fixed margin
            got = area.evaluate("e => e.getBoundingClientRect().width")
            if abs(got - width) <= 1:
                break
            viewport = {"width": int(viewport["width"] + width - got),
                        "height": viewport["height"]}
            self.page.set_viewport_size(viewport)
            self.page.wait_for_timeout(300)
        return viewport["width"]

    def readability(self, view: Any) -> dict[str, Any]:
        """``view``'s contrast and overflow problems (see ``READABILITY_JS``), its
        least contrast and how many SVG texts it has."""
        view.scroll_into_view_if_needed()
        return view.evaluate(READABILITY_JS)

    def palette(self, view: Any) -> dict[str, Any]:
        """The text classes of view.css (``.nbrpc-state-*``, ``.nbrpc-kind-*``,
        ``.nbrpc-muted``) drawn in ``view``, on its background and on a panel's,
        checked as ``READABILITY_JS`` checks a view (then taken away)."""
        classes = sorted(set(re.findall(r"\.(nbrpc-(?:state|kind)-[\w-]+|nbrpc-muted)\b",
                                        VIEW_CSS.read_text())))
        return view.evaluate(f"""(root, classes) => {{
            const check = {READABILITY_JS};
            const box = document.createElement("div");
            for (const where of ["nbrpc-swatches", "nbrpc-panel"]) {{
                const row = document.createElement("div");
                row.className = where;
                for (const c of classes) {{
                    const span = document.createElement("span");
                    span.className = c;
                    span.textContent = c + " ";
                    row.append(span);
                }}
                box.append(row);
            }}
            root.append(box);
            try {{ return Object.assign(check(box), {{classes: classes.length}}); }}
            finally {{ box.remove(); }}
        }}""", classes)

    def screenshot(self, locator: Any, path: Path) -> Path:
        """A PNG of ``locator``, its drawing scrolled back to the top left."""
        locator.scroll_into_view_if_needed()
        locator.locator(".nbrpc-main").evaluate("m => { m.scrollTop = 0; m.scrollLeft = 0; }")
        path.parent.mkdir(parents=True, exist_ok=True)
        locator.screenshot(path=str(path))
        return path


# -- readability: themes, a narrow column, contrast and overflow -----------------------
LIGHT, DARK = "JupyterLab Light", "JupyterLab Dark"
VIEW_CSS = Path(__file__).resolve().parent.parent / "nbrpc" / "jupyter" / "static" / "view.css"
AA = 4.5  # WCAG AA's least contrast for normal text (3:1 for large text)

# In the page: every problem of one view root (`root`) that a reader would meet.
#  contrast: each visible text (an HTML element's own text, an SVG <text>) against
#    what is painted behind it: the HTML backgrounds under it composited from the
#    first opaque one, then, for SVG text, the filled shapes drawn before it that
#    cover its centre; the text's colour counts its fill-opacity and opacities.
#  overflow: the view wider than its output area; any element past the view's
#    right edge that is not inside a scrolling box; a box that cuts its text off
#    (overflow hidden, no ellipsis); SVG text outside its drawing, or running out
#    of the shape it is written in; two SVG texts on top of each other.
READABILITY_JS = r"""
(root) => {
  const parse = (c) => {
    let m = /^rgba?\(([\d.]+),\s*([\d.]+),\s*([\d.]+)(?:,\s*([\d.]+))?\)$/.exec(c);
    if (m) return [+m[1], +m[2], +m[3], m[4] === undefined ? 1 : +m[4]];
    m = /^color\(srgb ([\d.e-]+) ([\d.e-]+) ([\d.e-]+)(?: \/ ([\d.]+))?\)$/.exec(c);
    if (m) return [m[1] * 255, m[2] * 255, m[3] * 255, m[4] === undefined ? 1 : +m[4]];
    return null;  // none, url(...), transparent keywords already come back as rgba
  };
  const over = (top, under) => {  // top (with alpha) painted over an opaque colour
    const a = top[3];
    return [0, 1, 2].map(i => top[i] * a + under[i] * (1 - a)).concat([1]);
  };
  const lum = (c) => {
    const [r, g, b] = c.slice(0, 3).map(v => {
      v /= 255; return v <= 0.04045 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const ratio = (a, b) => {
    const [hi, lo] = [lum(a), lum(b)].sort((x, y) => y - x);
    return (hi + 0.05) / (lo + 0.05);
  };
  const opacity = (el) => {  // the product of the opacities from el up to the page
    let o = 1;
    for (let e = el; e && e.nodeType === 1; e = e.parentElement)
      o *= +getComputedStyle(e).opacity;
    return o;
  };
  const htmlBackground = (el) => {
    const layers = [];
    for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
      if (e instanceof SVGElement && !(e instanceof SVGSVGElement)) continue;
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    let bg = [255, 255, 255, 1];
    for (const c of layers.reverse()) bg = over(c, bg);
    return bg;
  };
  const shown = (el) => el.getClientRects().length > 0
    && getComputedStyle(el).visibility !== "hidden";
  const name = (el) => {
    const txt = (el.textContent || "").trim().slice(0, 40);
    const cls = el.getAttribute("class") ? "." + el.getAttribute("class").split(" ")[0] : "";
    return `<${el.tagName.toLowerCase()}${cls}> "${txt}"`;
  };
  const problems = [];
  let least = Infinity;
  const check = (el, fg, bg) => {
    const st = getComputedStyle(el);
    const size = parseFloat(st.fontSize), bold = parseInt(st.fontWeight) >= 700;
    const need = size >= 24 || (size >= 18.66 && bold) ? 3 : %(AA)s;
    const r = ratio(over(fg, bg), bg);
    least = Math.min(least, r);
    if (r < need)
      problems.push(`contrast ${r.toFixed(2)}:1 < ${need}:1: ${name(el)} (text ` +
        `${fg.map(v => +v.toFixed(2))} on ${bg.map(v => Math.round(v))})`);
  };
  // HTML text: each element with text of its own, outside the SVG drawings
  for (const el of [root, ...root.querySelectorAll("*")]) {
    if (el.closest("svg") || el.matches("script, style, title") || !shown(el)) continue;
    if (el.matches(":disabled, :disabled *")) continue;  // WCAG: inactive controls exempt
    const own = Array.from(el.childNodes).some(n => n.nodeType === 3 && n.nodeValue.trim());
    if (!own) continue;
    const fg = parse(getComputedStyle(el).color);
    fg[3] *= opacity(el);
    check(el, fg, htmlBackground(el));
  }
  // SVG text, over what its drawing paints before it
  const texts = Array.from(root.querySelectorAll("svg text")).filter(shown);
  for (const t of texts) {
    const svg = t.ownerSVGElement, box = t.getBoundingClientRect();
    const cx = (box.left + box.right) / 2, cy = (box.top + box.bottom) / 2;
    let bg = htmlBackground(svg);
    for (const shape of svg.querySelectorAll("rect, circle, ellipse, polygon, path")) {
      if (!(shape.compareDocumentPosition(t) & Node.DOCUMENT_POSITION_FOLLOWING)) break;
      if (shape.closest("defs, marker") || !shown(shape)) continue;
      const r = shape.getBoundingClientRect();
      if (cx < r.left || cx > r.right || cy < r.top || cy > r.bottom) continue;
      const st = getComputedStyle(shape), fill = parse(st.fill);
      if (!fill) continue;
      fill[3] *= +st.fillOpacity * opacity(shape);
      if (fill[3] > 0) bg = over(fill, bg);
    }
    const st = getComputedStyle(t), fg = parse(st.fill);
    if (!fg) { problems.push(`unpainted text ${name(t)}`); continue; }
    fg[3] *= +st.fillOpacity * opacity(t);
    check(t, fg, bg);
    // inside its drawing, and inside the box it is written in (a shape drawn
    // just before it in its group that holds its start)
    const sr = svg.getBoundingClientRect();
    if (box.left < sr.left - 1 || box.right > sr.right + 1)
      problems.push(`text cut by the drawing's edge: ${name(t)}`);
    let prev = t.previousElementSibling;
    while (prev && prev.tagName === "text") prev = prev.previousElementSibling;
    if (prev && prev.tagName === "rect") {
      const r = prev.getBoundingClientRect();
      if (box.left >= r.left - 1 && box.left <= r.right && cy >= r.top && cy <= r.bottom
          && box.right > r.right + 1)
        problems.push(`text runs out of its box by ${(box.right - r.right).toFixed(0)} px: ` +
                      name(t));
    }
  }
  // SVG texts on top of each other
  const boxes = texts.map(t => [t, t.getBoundingClientRect()]);
  for (let i = 0; i < boxes.length; i++)
    for (let j = i + 1; j < boxes.length; j++) {
      const [a, ra] = boxes[i], [b, rb] = boxes[j];
      const w = Math.min(ra.right, rb.right) - Math.max(ra.left, rb.left);
      const h = Math.min(ra.bottom, rb.bottom) - Math.max(ra.top, rb.top);
      if (w > 1 && h > 2 && a.ownerSVGElement === b.ownerSVGElement)
        problems.push(`texts overlap: ${name(a)} and ${name(b)}`);
    }
  // overflow
  const out = root.closest(".jp-OutputArea-output") || root.parentElement;
  const rr = root.getBoundingClientRect(), or = out.getBoundingClientRect();
  if (rr.right > or.right + 1 || root.scrollWidth > root.clientWidth + 1)
    problems.push(`the view (${rr.width.toFixed(0)} px, content ${root.scrollWidth} px) is ` +
                  `wider than its output area (${or.width.toFixed(0)} px)`);
  const scrolls = (e) => ["auto", "scroll"].includes(getComputedStyle(e).overflowX);
  for (const el of root.querySelectorAll("*")) {
    if (el.closest("svg") && !(el instanceof SVGSVGElement)) continue;
    if (!shown(el)) continue;
    let inScroller = false;
    for (let e = el.parentElement; e && e !== root; e = e.parentElement)
      if (scrolls(e)) { inScroller = true; break; }
    const r = el.getBoundingClientRect();
    if (!inScroller && r.width > 0 && r.right > rr.right + 1)
      problems.push(`past the view's right edge by ${(r.right - rr.right).toFixed(0)} px: ` +
                    name(el));
    const st = getComputedStyle(el);
    if (["hidden", "clip"].includes(st.overflowX) && st.textOverflow !== "ellipsis"
        && el.scrollWidth > el.clientWidth + 1)
      problems.push(`box cuts its content off (${el.scrollWidth} > ${el.clientWidth} px): ` +
                    name(el));
  }
  return {problems, least: least === Infinity ? null : least, texts: texts.length};
}
""".replace("%(AA)s", str(AA))


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
