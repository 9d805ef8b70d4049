"""The widgets in a real browser: JupyterLab on loopback, Debian's Chromium
driven by Playwright, notebooks run from JupyterLab's Run menu as a person would.

What is checked in the page (not in Python): the anywidget roots appear and no
"Error displaying widget"; a button press reaches Python and changes the
drawing; a click on a mark fills the side panel; the tutorials 07 and 08 run
without errors, clicking an RRef shows why it is alive and Step moves the
highlighted stage; a 32-worker, 10,000-RRef graph renders (its time, read from
the ``data-render-ms`` attribute the front end sets, is printed, not asserted);
the five views of the README (cluster, RRef graph and owner map from tutorial
07, the stepper from 08, the trace fixture's trace) read well in a 900 px
notebook column in JupyterLab's light and dark themes (and the trace in
Notebook 7's): every text at WCAG AA contrast (4.5:1) against what is behind
it, nothing overflowing its box; so do the static reprs that a saved notebook
shows, in a dark page and in one without JupyterLab's variables (GitHub).

The fixture notebooks are in tests/browser/ (open them in JupyterLab to see what
the tests see); the tutorials are the ones in notebooks/. Both are run from
copies in a temporary directory. Screenshots go to the test's tmp dir; the
README's five, light and dark (``*_dark.png``), in the 900 px column, also to
``$NBRPC_SCREENSHOTS`` (``make screenshots``: docs/img).
Skips, saying why, without Chromium or Playwright; never downloads a browser.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser_util import DARK, LIGHT, Lab, Notebook, errors_in, wait_until, why_no_browser
from conftest import small_rref_graph

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
TUTORIALS = {"rref": "07_debugging_rref_lifetimes.ipynb",
             "backward": "08_stepping_distributed_backward.ipynb"}
# The fixture notebooks (the view base, real data from one agent, a real trace,
# 33 members x 10,000 RRefs), opened besides the tutorials; each says what it holds.
FIXTURES = Path(__file__).resolve().parent / "browser"
NOTEBOOK_TIMEOUT = 300  # s for Run All of one notebook on a busy 2-core machine
COLUMN = 900  # px: the notebook column the views must read in (its output area)


# -- fixtures -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = why_no_browser()
    if reason:
        pytest.skip(f"browser tier skipped: {reason}")
    root = tmp_path_factory.mktemp("browser")
    nbs = root / "notebooks"  # copies: the repo's saved outputs stay as they are
    shutil.copytree(REPO / "notebooks", nbs)
    for fixture in FIXTURES.glob("*.ipynb"):
        shutil.copyfile(fixture, nbs / fixture.name)
    return root


@pytest.fixture(scope="module")
def lab(workdir: Path) -> Iterator[Lab]:
    server = Lab(workdir / "notebooks", workdir / "home")
    t0 = time.monotonic()
    server.start(timeout=180)
    print(f"\nJupyterLab up in {time.monotonic() - t0:.1f} s at {server.base}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(workdir: Path) -> Iterator[Any]:
    from browser_util import chromium_path
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), timeout=120_000,
                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


class Shots:
    """Screenshots: all in the test's tmp dir; the README's (``readme=True``) also
    in ``$NBRPC_SCREENSHOTS`` when it is set (``make screenshots``: docs/img)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        env = os.environ.get("NBRPC_SCREENSHOTS")
        self.readme = Path(env) if env else None

    def __call__(self, nb: Notebook, view: Any, name: str, readme: bool = False) -> None:
        path = nb.screenshot(view, self.tmp / f"{name}.png")
        if readme and self.readme is not None:
            self.readme.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, self.readme / f"{name}.png")
        print(f"screenshot {path}")


@pytest.fixture
def shots(tmp_path: Path) -> Shots:
    return Shots(tmp_path / "screenshots")


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(60_000)
    pg = context.new_page()
    pg.console_errors = []
    pg.on("console", lambda m: m.type == "error" and pg.console_errors.append(m.text))
    try:
        yield pg
    finally:
        context.close()


@pytest.fixture
def opened(lab: Lab) -> Iterator[list[Notebook]]:
    """The notebooks a test opened: their kernels are shut down after it."""
    nbs: list[Notebook] = []
    yield nbs
    for nb in nbs:
        nb.shutdown()


def run(lab: Lab, page: Any, name: str, opened: list[Notebook], app: str = "lab"
        ) -> tuple[Notebook, dict[str, Any]]:
    """Open ``name`` (in JupyterLab, or ``app="notebook"``: Notebook 7), Run All,
    save; fail with the errors if a cell raised."""
    nb = Notebook(lab, page, name, app)
    opened.append(nb)
    nb.open(timeout=180)
    secs = nb.run_all(timeout=NOTEBOOK_TIMEOUT)
    print(f"\n{name}: Run All took {secs:.1f} s")
    saved = nb.save()
    errors = errors_in(saved)
    assert not errors, "\n\n".join(errors)
    nb.assert_views_rendered(saved)
    return nb, saved


def readable(nb: Notebook, shots: Shots, views: dict[str, Any], readme: bool = True
             ) -> dict[str, list[str]]:
    """Check ``views`` ({name: view}) in a ``COLUMN`` px column, in the light then the
    dark theme (see ``browser_util.READABILITY_JS``), taking screenshots of each
    (``name.png``, ``name_dark.png``; the README's if ``readme``); the problems found
    in each view (and in view.css's colours), for the test to assert once it has
    checked the rest (a view that reads badly does not hide what else its test
    finds). The page is put back as it was."""
    before = nb.page.viewport_size
    problems: dict[str, list[str]] = {name: [] for name in [*views, "view.css"]}
    try:
        first = next(iter(views.values()))
        window = nb.fit_column(first, COLUMN)
        for theme in (LIGHT, DARK):
            nb.set_theme(theme)
            for name, view in views.items():
                found = nb.readability(view)
                least = "no text" if found["least"] is None else f"{found['least']:.2f}:1"
                print(f"\n{name}, {theme}, {COLUMN} px column (window {window} px): least "
                      f"contrast {least}, {found['texts']} SVG texts, "
                      f"{len(found['problems'])} problems")
                problems[name] += [f"{name} ({theme}): {p}" for p in found["problems"]]
                shots(nb, view, name if theme == LIGHT else f"{name}_dark", readme=readme)
            found = nb.palette(first)  # the colours view.css offers any view, as text
            print(f"view.css's {found['classes']} text colours, {theme}: least contrast "
                  f"{found['least']:.2f}:1")
            problems["view.css"] += [f"view.css ({theme}): {p}" for p in found["problems"]]
    finally:
        nb.set_theme(LIGHT)
        nb.page.set_viewport_size(before)
    return problems


def assert_readable(problems: dict[str, list[str]]) -> None:
    """No view has a readability problem (each is listed, up to 40)."""
    found = [p for ps in problems.values() for p in ps]
    assert not found, f"{len(found)} readability problems:\n" + "\n".join(found[:40])


def code_cells(nb: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def wait_text(locator: Any, text: str, timeout: float = 30) -> None:
    wait_until(lambda: text in (locator.text_content() or ""), timeout,
               lambda: f"{text!r} in {locator.text_content()!r}")


def view_titled(nb: Notebook, title: str) -> Any:
    """The first rendered view whose title contains ``title``."""
    return nb.views().filter(has=nb.page.locator(".nbrpc-title", has_text=title)).first


def need_view(module: str) -> None:
    if importlib.util.find_spec(f"nbrpc.jupyter.{module}") is None:
        pytest.skip(f"nbrpc/jupyter/{module}.py is not written yet")


# -- (a) the base view and a real one, in the page -----------------------------------
def test_a_view_renders_and_its_buttons_and_marks_reach_python(lab, page, shots, opened) -> None:
    nb, saved = run(lab, page, "widget_basics.ipynb", opened)
    wait_until(lambda: nb.views().count() == 2, 60, lambda: f"2 views, {nb.views().count()}")
    clicks, trace = nb.views().nth(0), nb.views().nth(1)
    # the static repr went into the saved notebook alongside the widget
    data = code_cells(saved)[0]["outputs"][0]["data"]
    assert data["text/plain"] == "clicks: 0" and "nbrpc-static" in data["text/html"]
    assert "application/vnd.jupyter.widget-view+json" in data

    assert clicks.locator(".nbrpc-title").text_content() == "clicks"
    assert clicks.locator(".count").text_content() == "pressed 0"
    assert clicks.locator(".nbrpc-panel").is_hidden()  # empty until something is clicked
    clicks.locator("button[data-id=bump]").click()
    wait_text(clicks.locator(".count"), "pressed 1")  # Python redrew it
    wait_text(clicks.locator(".nbrpc-status"), "1 presses")
    clicks.locator("[data-key=box]").click()
    wait_text(clicks.locator(".nbrpc-panel"), "selected box")
    assert clicks.locator(".nbrpc-panel").is_visible()
    assert clicks.get_attribute("data-render-ms") is not None
    shots(nb, clicks, "basics_clicks")

    # a real view: the trace's sequence diagram, its filters and a click on an arrow
    arrows = trace.locator(".nbrpc-msg")
    assert arrows.count() == 2
    arrows.first.click()
    wait_text(trace.locator(".nbrpc-panel"), "message 0")
    # the clicked arrow is outlined, its label's backing is not
    stroke = "e => getComputedStyle(e).stroke"
    assert arrows.first.locator("line").first.evaluate(stroke) == "rgb(255, 111, 0)"
    assert arrows.first.locator("rect.nbrpc-label").evaluate(stroke) == "none"
    reply_box = trace.locator(".nbrpc-filter[data-group=kind] input[data-value=reply]")
    reply_box.uncheck()
    assert arrows.nth(1).is_hidden() and arrows.nth(0).is_visible()
    reply_box.check()
    assert arrows.nth(1).is_visible()
    shots(nb, trace, "basics_trace")
    assert not [e for e in page.console_errors if "nbrpc" in e or "anywidget" in e], \
        page.console_errors


def test_a_view_works_in_notebook_7_too(lab, page, shots, opened) -> None:
    if importlib.util.find_spec("notebook") is None:
        pytest.skip("the notebook package (Notebook 7) is not installed")
    nb, _ = run(lab, page, "widget_basics.ipynb", opened, app="notebook")
    wait_until(lambda: nb.views().count() == 2, 60, lambda: f"2 views, {nb.views().count()}")
    clicks, trace = nb.views().nth(0), nb.views().nth(1)
    clicks.locator("button[data-id=bump]").click()
    wait_text(clicks.locator(".count"), "pressed 1")  # Python redrew it
    trace.locator(".nbrpc-msg").first.click()
    wait_text(trace.locator(".nbrpc-panel"), "message 0")
    shots(nb, trace, "notebook7_trace_wide")
    assert_readable(readable(nb, shots, {"notebook7_trace": trace}, readme=False))


def test_a_real_rref_graph_and_stepper_answer_clicks(lab, page, shots, opened) -> None:
    need_view("rref_graph_view")
    need_view("stepper_view")
    last = last_stage_colour()

    nb, _ = run(lab, page, "live_views.ipynb", opened)
    wait_until(lambda: nb.views().count() == 2, 60, lambda: f"2 views, {nb.views().count()}")
    graph, stepper = nb.views().nth(0), nb.views().nth(1)
    assert "1 value on 1 owner" in graph.locator(".nbrpc-title").text_content()
    graph.locator(".nbrpc-rref[data-key]").first.click()
    panel = graph.locator(".nbrpc-panel")
    wait_text(panel, "alive?")
    assert "owner-side RRef" in panel.text_content() and "'kept'" in panel.text_content()
    shots(nb, graph, "live_rref_graph")

    title = stepper.locator(".nbrpc-title")
    assert "0 stages run" in title.text_content() and lit_keys(stepper, last) == []
    seen = []
    for k in (1, 2, 3):
        stepper.locator("button[data-id=step]").click()
        wait_text(title, f"{k} stage{'s' if k > 1 else ''} run")
        keys = lit_keys(stepper, last)
        assert keys and keys not in seen, f"stage {k} lit {keys}; before: {seen}"
        seen.append(keys)
        if k == 2:
            shots(nb, stepper, "live_stepper")
    assert "done" in title.text_content()
    assert stepper.locator("button[data-id=step]").is_disabled()


def last_stage_colour() -> str:
    """The fill of the boxes of the stage that just ran (the stepper's module constant)."""
    for module in ("stepper_graph", "stepper_view"):
        if importlib.util.find_spec(f"nbrpc.jupyter.{module}") is not None:
            mod = importlib.import_module(f"nbrpc.jupyter.{module}")
            if hasattr(mod, "LAST"):
                return mod.LAST
    pytest.fail("no LAST colour in nbrpc.jupyter.stepper_graph or stepper_view")


def lit_keys(view: Any, colour: str) -> list[str]:
    """The data-keys of the marks whose box has the fill ``colour``, sorted."""
    return sorted(view.locator(f'.nbrpc-main [data-key] > rect[fill="{colour}"]').evaluate_all(
        "els => els.map(e => e.parentElement.getAttribute('data-key'))"))


def test_a_real_trace_filters_and_answers_clicks(lab, page, shots, opened) -> None:
    need_view("cluster_view")
    nb, _ = run(lab, page, "trace.ipynb", opened)
    trace = view_titled(nb, "Message trace")
    arrows = trace.locator(".nbrpc-msg")
    kinds = trace.locator(".nbrpc-filter[data-group=kind] input").evaluate_all(
        "els => els.map(e => e.getAttribute('data-value'))")
    assert {"call", "reply", "autograd"} <= set(kinds), kinds
    n = arrows.count()
    shown = lambda: sum(arrows.nth(i).is_visible() for i in range(n))  # noqa: E731
    assert n >= 8
    # (the last arrows may still be drawing in: poll, rather than look once)
    wait_until(lambda: shown() == n, 10, lambda: f"{shown()} of {n} arrows visible")
    trace.locator(".nbrpc-filter[data-group=kind] input[data-value=reply]").uncheck()
    replies = trace.locator('.nbrpc-msg[data-f-kind="reply"]').count()
    assert 0 < replies < n
    wait_until(lambda: shown() == n - replies, 10,
               lambda: f"{shown()} arrows visible with {replies} replies of {n} hidden")
    trace.locator(".nbrpc-filter[data-group=kind] input[data-value=reply]").check()
    trace.locator('.nbrpc-msg[data-f-kind="autograd"]').first.click()
    wait_text(trace.locator(".nbrpc-panel"), "msg_id")
    assert "autograd" in trace.locator(".nbrpc-panel").text_content()
    shots(nb, trace, "trace_wide")
    assert_readable(readable(nb, shots, {"trace": trace}))


# -- (b) the tutorials, as a person reads them --------------------------------------
def tutorial(name: str) -> str:
    if not (REPO / "notebooks" / name).exists():
        pytest.skip(f"notebooks/{name} is not written yet")
    return name


def cell_index(nb: Notebook, saved_or_source: str) -> int:
    """The index of the first cell whose source starts with ``saved_or_source``."""
    import nbformat

    cells = nbformat.read(nb.path, as_version=4).cells
    for i, c in enumerate(cells):
        if c.source.lstrip().startswith(saved_or_source):
            return i
    pytest.fail(f"{nb.name} has no cell starting with {saved_or_source!r}: the test follows "
                "the tutorial's sections; update it with the tutorial")


def test_b_tutorial_07_find_the_leaks_in_the_graph(lab, page, shots, opened) -> None:
    nb = Notebook(lab, page, tutorial(TUTORIALS["rref"]))
    opened.append(nb)
    nb.open(timeout=180)
    # Sections 1-2 (cluster, the leaky program, the graph and owner map), then look
    leak_one = cell_index(nb, "## 3. Leak one")
    nb.select(leak_one)
    print(f"\n07 up to the graph: {nb.run_menu('Run All Above Selected Cell', 300):.1f} s")
    nb.assert_no_widget_errors()
    cluster = view_titled(nb, "nbrpc cluster")
    wait_text(cluster.locator(".nbrpc-main"), "worker2")
    status = cluster.locator(".nbrpc-status")
    first = status.text_content()  # "live; refreshed 13:44:02": redrawn while it runs
    assert first.startswith("live"), first
    wait_until(lambda: status.text_content() != first, 15, "the live cluster view to refresh")
    graph, owners = view_titled(nb, "RRef graph"), view_titled(nb, "Owner map")
    assert "5 values" in graph.locator(".nbrpc-title").text_content()
    # the value kept by Out[n] is amber; a click asks why_alive on every worker
    kept = graph.locator('.nbrpc-rref[data-f-state~="output"]')
    assert kept.count() == 1, graph.locator(".nbrpc-main").inner_html()[:2000]
    kept.click()
    panel = graph.locator(".nbrpc-panel")
    wait_text(panel, "alive?", timeout=60)
    assert "Out[" in panel.text_content(), panel.text_content()
    shots(nb, cluster, "cluster_wide")
    problems = readable(nb, shots, {"cluster": cluster, "rref_graph": graph,
                                    "owner_map": owners})
    # a worker's row opens its details, torch's and BLAS's threads among them (none of
    # the README's)
    cluster.locator('tr[data-key="worker:worker1"]').click()
    wait_text(cluster.locator(".nbrpc-panel"), "torch.get_num_threads()", timeout=30)
    wait_text(cluster.locator(".nbrpc-panel"), "BLAS threads (threadpoolctl)", timeout=5)
    for name, found in readable(nb, shots, {"cluster_details": cluster}, readme=False).items():
        problems.setdefault(name, []).extend(found)

    # Sections 3-5: fix both leaks and watch the graph empty
    nb.select(leak_one)
    print(f"07 the rest: {nb.run_menu('Run Selected Cell and All Below', 300):.1f} s")
    saved = nb.save()
    errors = errors_in(saved)
    assert not errors, "\n\n".join(errors)
    nb.assert_views_rendered(saved)
    last = nb.views().filter(has=page.locator(".nbrpc-title", has_text="RRef graph")).last
    wait_text(last.locator(".nbrpc-title"), "0 values")
    assert_readable(problems)


def test_b_tutorial_08_step_the_backward_pass(lab, page, shots, opened) -> None:
    nb = Notebook(lab, page, tutorial(TUTORIALS["backward"]))
    opened.append(nb)
    nb.open(timeout=180)
    widget_cell = cell_index(nb, "stack = contextlib.ExitStack()")
    nb.select(widget_cell + 1)
    print(f"\n08 up to the stepper: {nb.run_menu('Run All Above Selected Cell', 300):.1f} s")
    nb.assert_no_widget_errors()
    stepper = view_titled(nb, "Backward stepper")
    title = stepper.locator(".nbrpc-title")
    last = last_stage_colour()
    assert "0 stages run" in title.text_content() and lit_keys(stepper, last) == []
    # Step: the stage that just ran is highlighted, on the worker that ran it
    seen: list[list[str]] = []
    for k in (1, 2):
        stepper.locator("button[data-id=step]").click()
        wait_text(title, f"{k} stage{'s' if k > 1 else ''} run", timeout=60)
        keys = lit_keys(stepper, last)
        assert keys and keys not in seen, f"stage {k} lit {keys}; before: {seen}"
        assert len({key.split(":")[1] for key in keys if key.startswith("n:")}) == 1, keys
        seen.append(keys)
    assert seen[0][0].split(":")[1] != seen[1][0].split(":")[1]  # another worker's stage
    wait_text(stepper.locator(".nbrpc-panel"), "Stage 2")
    shots(nb, stepper, "stepper_wide")
    problems = readable(nb, shots, {"stepper": stepper})
    # Reset (the pass retains its graph) puts it back where the tutorial expects it
    stepper.locator("button[data-id=reset]").click()
    wait_text(title, "0 stages run", timeout=60)
    assert lit_keys(stepper, last) == []

    nb.select(widget_cell + 1)
    print(f"08 the rest: {nb.run_menu('Run Selected Cell and All Below', 300):.1f} s")
    saved = nb.save()
    errors = errors_in(saved)
    assert not errors, "\n\n".join(errors)
    nb.assert_views_rendered(saved)
    outputs = [o for c in saved.cells for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the gradient norms plot
    assert any("gradients equal to backward()'s" in o.get("text", "") for o in outputs)
    assert_readable(problems)


# -- (c) big inputs: 32 workers (and the driver) x 10,000 RRefs ------------------------
def test_c_big_graph_owner_map_and_cluster_render_every_lane(lab, page, shots, opened) -> None:
    need_view("rref_graph_view")
    need_view("owner_map_view")
    need_view("cluster_view")
    nb, saved = run(lab, page, "big_graph.ipynb", opened)
    assert code_cells(saved)[0]["outputs"][0]["data"]["text/plain"] == "(10000, 11000)"
    wait_until(lambda: nb.views().count() == 3, 60, lambda: f"3 views, {nb.views().count()}")
    for i, name in enumerate(("big_rref_graph", "big_owner_map", "big_cluster")):
        view = nb.views().nth(i)
        ms = wait_until(lambda v=view: v.get_attribute("data-render-ms"), 30, "a render time")
        layout_ms = rerender_ms(view)
        labels = set(view.locator(".nbrpc-main").locator("text, td, th, b").evaluate_all(
            "els => els.map(e => Array.from(e.childNodes).filter(n => n.nodeType === 3)"
            "          .map(n => n.nodeValue).join('').trim())"))  # own text, not <title>'s
        missing = [w for w in ["driver"] + [f"worker{k}" for k in range(1, 33)]
                   if w not in labels]
        assert not missing, f"{name}: lanes missing for {missing}"
        print(f"\n{name}: data-render-ms={ms} (set innerHTML), {layout_ms:.1f} ms with "
              f"style, layout and paint; {len(view.inner_html()) / 1e6:.2f} MB of markup")
        shots(nb, view, name)


def rerender_ms(view: Any) -> float:
    """Draw the view's markup again, with style, layout and one paint, in ms."""
    return view.evaluate("""root => new Promise(done => {
        const main = root.querySelector('.nbrpc-main');
        const html = main.innerHTML;
        const t0 = performance.now();
        main.innerHTML = html;
        void main.getBoundingClientRect();
        requestAnimationFrame(() => setTimeout(() => done(performance.now() - t0), 0));
    })""")


# -- (d) the static reprs (a saved notebook, GitHub) ---------------------------------
# The page around an output: JupyterLab's dark theme sets its variables and text
# colour; GitHub draws black on white without them; other dark front ends have
# light text and none of JupyterLab's variables.
PAGES = {"dark": ":root { --jp-layout-color0: #111111; --jp-ui-font-color1: rgba(255,255,255,.87);"
                 " --jp-error-color1: #f44336; } body { background: #111111; color: #ffffff; }",
         "no theme": "body { background: #ffffff; color: #000000; }",
         "dark, no variables": "body { background: #1e1e1e; color: #d4d4d4; }"}


def test_d_static_reprs_read_in_a_dark_page_and_without_jupyterlab(page) -> None:
    from browser_util import READABILITY_JS

    from nbrpc.debug.trace import Trace
    from nbrpc.jupyter.owner_map_view import owner_map_html
    from nbrpc.jupyter.rref_graph_view import rref_graph_html
    from nbrpc.jupyter.trace_view import trace_html

    trace = Trace(workers=["driver", "worker1", "worker2"], duration=0.001, messages=[
        {"kind": k, "op": op, "what": "step on RRef 0:1", "src": s, "dst": d, "msg_id": i,
         "nbytes": 300, "t0": i * 1e-4, "t1": i * 1e-4 + 5e-5, "latency": 1e-4, "error": None}
        for i, (k, op, s, d) in enumerate([("call", "call", "driver", "worker2"),
                                            ("reply", "call", "worker2", "driver"),
                                            ("rref-protocol", "rref_fork", "worker1", "worker2")])])
    omap = {"driver": [], "worker1": [{"rref_id": "1:1", "type": "torch.Tensor", "nbytes": 4096,
                                       "state": "ready", "held_by": ["driver"],
                                       "owner_refs": 0, "site": "x.py:3"}]}
    graph = small_rref_graph("torch.Tensor", 4096)
    reprs = {"trace": trace_html(trace), "owner_map": owner_map_html(omap),
             "rref_graph": rref_graph_html(graph)}
    problems = []
    for where, css in PAGES.items():
        page.set_content(f"<html><head><style>{css}</style></head><body>"
                         + "".join(f'<div class="jp-OutputArea-output" id="{name}" '
                                   f'style="width: {COLUMN}px">{html}</div>'
                                   for name, html in reprs.items()) + "</body></html>")
        for name in reprs:
            found = page.locator(f"#{name} > .nbrpc-static").evaluate(READABILITY_JS)
            print(f"\nstatic {name}, {where}: least contrast {found['least']:.2f}:1")
            problems += [f"{name} ({where}): {p}" for p in found["problems"]
                         if not p.startswith("the view (")]  # (a static repr may scroll)
    assert not problems, "\n".join(problems)
