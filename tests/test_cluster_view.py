"""The cluster view without engines: its table from hand-made statuses, and the
view's live refresh, rates and buttons driven by a scripted cluster.

The same view on a real cluster (a killed worker shown dead, Restart and Stop
for real) is tested in test_cluster.py, marked ``cluster``.
"""

from __future__ import annotations

import configparser
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import poll_for

from nbrpc.cluster import ClusterStatus, WorkerStatus
from nbrpc.jupyter import cluster_view
from nbrpc.jupyter.cluster_view import DEAD_BACKGROUND, MAX_ROWS, ClusterView, cluster_html
from nbrpc.jupyter.view import GONE

SANITIZE = Path(__file__).resolve().parents[1] / "notebooks" / "nbval_sanitize.cfg"


def sanitized(markup: str) -> str:
    """``markup`` as nbval compares it (the notebooks' sanitize patterns applied)."""
    cfg = configparser.ConfigParser()
    cfg.read(SANITIZE)
    for section in cfg.sections():
        markup = re.sub(cfg[section]["regex"], cfg[section]["replace"], markup)
    return markup


def status(pids: tuple[int, int, int] = (10, 11, 12), messages: int = 0,
           dead: str = "", state: str = "running") -> ClusterStatus:
    rows = [WorkerStatus("driver", 0, "kernel-host", pids[0], "ready", 16, 0, 0, 1, 4096,
                         messages, 10 * messages)]
    for rank in (1, 2):
        name = f"worker{rank}"
        if name == dead:
            rows.append(WorkerStatus(name, rank, "host-b", pids[rank], "dead", 16,
                                     detail="died (its engine process exited)"))
        else:
            rows.append(WorkerStatus(name, rank, "host-b", pids[rank], "ready", 16, 1, 2,
                                     3 * rank, 1024 * rank, messages * rank))
    return ClusterStatus("fork", state, rows if state == "running" else [])


class Scripted:
    """A cluster whose status the test sets; restart and stop are recorded, and
    can be held (``gate``) or made to fail."""

    launcher_name, timeout = "fork", 5.0

    def __init__(self) -> None:
        self.state = "running"
        self.next = status()
        self.calls: list[tuple] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Exception | None = None

    def status(self, probe_timeout: float = 1.0) -> ClusterStatus:
        return self.next if self.state == "running" else ClusterStatus("fork", self.state, [])

    def restart(self, name: str | None = None, *, progress: bool | None = None) -> None:
        self.calls.append(("restart", name, progress))
        self._act()
        self.next = status(pids=(10, 11, 99) if name == "worker2" else (10, 98, 12))

    def stop(self, timeout: float = 10.0) -> None:
        self.calls.append(("stop",))
        self._act()
        self.state = "stopped"

    def _act(self) -> None:
        assert self.gate.wait(10), "the test never opened the gate"
        if self.fail is not None:
            raise self.fail


def live_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nbrpc-live-view"]


@pytest.fixture
def scripted() -> Scripted:
    return Scripted()


# -- the table ---------------------------------------------------------------------
def test_the_table_has_every_column_and_marks_what_varies() -> None:
    page = cluster_html(status(), {"driver": 2.0, "worker1": 5.5})
    assert headers(page) == ["name", "rank", "host", "pid", "state", "threads busy",
                             "calls in flight", "owned RRefs", "bytes owned", "messages/s",
                             "note"]
    assert "<b>nbrpc cluster (fork launcher): 2 workers ready</b>" in page
    assert "<td>host-b</td><td>11</td>" in page
    assert "2.0 KiB" in page and "5.5" in page
    # another run: other hosts, pids, counters and rates; the same page for nbval
    other = cluster_html(status(pids=(20, 21, 22), messages=7), {"worker2": 1.0})
    assert other != page and sanitized(other) == sanitized(page)
    kept = sanitized(page)  # names, ranks and states are compared
    assert '<tr data-key="worker:worker2"><td><b>worker2</b></td><td>2</td>' in kept
    # a state in view.css's theme shade, else its hue mixed with the text colour
    assert ('<b style="color:var(--nbrpc-state-ready, color-mix(in srgb, #2e7d32 60%, '
            'currentColor))">ready</b>') in kept
    assert "11" not in kept.replace("worker1", "")


def test_a_dead_worker_is_highlighted_with_why() -> None:
    page = cluster_html(status(dead="worker2"))
    row = re.search(r'<tr data-key="worker:worker2"[^>]*>.*?</tr>', page).group(0)
    assert f'style="background:{DEAD_BACKGROUND}"' in row
    assert re.search(r'<b style="color:var\(--nbrpc-state-dead, [^"]*#c62828[^"]*\)">dead</b>',
                     row)
    assert "died (its engine process exited)" in row
    assert "1 ready, 1 dead" in page


def test_a_batch_job_is_shown_in_the_note_and_the_details() -> None:
    s = status()
    s["worker1"].job = "Slurm job 17 RUNNING on n1"
    s["worker2"].state, s["worker2"].job = "dead", "Slurm job 18 CANCELLED"
    s["worker2"].detail = "died (its connection closed)"
    page = cluster_html(s)
    row = lambda n: re.search(rf'<tr data-key="worker:{n}"[^>]*>.*?</tr>', page).group(0)  # noqa: E731
    assert cells(row("worker1"))[-1] == "Slurm job 17 RUNNING on n1"
    assert cells(row("worker2"))[-1] == "died (its connection closed)"  # why it died first
    panel = cluster_view._details(s["worker2"], None)
    assert "<td>batch job</td><td>Slurm job 18 CANCELLED</td>" in panel
    assert "<td>note</td><td>died (its connection closed)</td>" in panel


def test_a_workers_details_give_its_torch_threads_where_known() -> None:
    s = status()
    s["worker1"].torch_threads = 3
    assert "<td>torch.get_num_threads()</td><td>3</td>" in cluster_view._details(s["worker1"], None)
    assert "get_num_threads" not in cluster_view._details(s["worker2"], None)  # (0: not known)
    assert "torch.get_num_threads()" not in headers(cluster_html(s))  # the details only: no column


def test_a_workers_details_give_its_blas_threads_where_known() -> None:
    s = status()
    s["worker1"].blas_threads = "openblas 1"
    assert ("<td>BLAS threads (threadpoolctl)</td><td>openblas 1</td>"
            in cluster_view._details(s["worker1"], None))
    assert "BLAS threads" not in cluster_view._details(s["worker2"], None)  # ("": not known)


def headers(page: str) -> list[str]:
    return re.findall(r"<th(?=[ >])[^>]*>([^<]*)</th>", page)


def cells(row: str) -> list[str]:
    """The cells of one table row, comments (the varies marks) left out."""
    return re.findall(r"<td[^>]*>(.*?)</td>", re.sub(r"<!--.*?-->", "", row))


def test_buttons_only_in_the_live_table_and_none_for_the_driver() -> None:
    assert "<button" not in cluster_html(status())
    page = cluster_html(status(), buttons=True)
    assert page.count("<button") == 2 and 'data-key="restart:driver"' not in page
    assert 'data-key="restart:worker1"' in page and " disabled>" not in page
    assert page.count(" disabled>") == 0
    assert cluster_html(status(), buttons=True, busy=True).count(" disabled>") == 2


def test_every_cell_is_padded_and_restart_has_a_column_of_its_own() -> None:
    page = cluster_html(status(dead="worker2"), {"worker1": 1.0}, buttons=True)
    assert headers(page)[-2:] == ["note", "action"]
    assert "less this view&#x27;s own status probes" in page  # messages/s says what it counts
    for row in re.findall(r'<tr data-key="worker:[^"]+".*?</tr>', page):
        row_cells = cells(row)
        assert len(row_cells) == len(headers(page)), row_cells
        note, action = row_cells[-2:]
        assert "<button" not in note  # the note column holds only the note
        assert ("<button" in action) == ('data-key="worker:driver"' not in row)
    dead = re.search(r'<tr data-key="worker:worker2".*?</tr>', page).group(0)
    assert cells(dead)[-2] == "died (its engine process exited)"
    total = re.search(r"<tr style=[^>]*><td[^>]*><i>all</i>.*?</tr>", page).group(0)
    assert len(cells(total)) == len(headers(page))
    # the padding: a rule of the views' stylesheet for the table's class
    css = re.sub(r"/\*.*?\*/", "", (Path(cluster_view.__file__).parent / "static" / "view.css")
                 .read_text(), flags=re.S)
    rule = re.search(r"\.nbrpc-cluster th, \.nbrpc-cluster td \{([^}]*)\}", css)
    assert 'class="nbrpc-cluster"' in page and rule and "padding: 2px 6px" in rule.group(1)


def test_each_workers_gpu_has_a_column_where_the_cluster_gave_them_one() -> None:
    """gpus=True: a device column after the pid, every row (and the totals)
    still as wide as the header; without GPUs the table is unchanged."""
    s = status()
    for w, device in zip(s.workers, ("cpu", "cuda:0", "cuda:1")):
        w.device = device
    page = cluster_html(s, {"worker1": 1.0}, buttons=True)
    assert headers(page)[:6] == ["name", "rank", "host", "pid", "device", "state"]
    for row in re.findall(r'<tr data-key="worker:[^"]+".*?</tr>', page):
        assert len(cells(row)) == len(headers(page)), cells(row)
    row = re.search(r'<tr data-key="worker:worker2".*?</tr>', page).group(0)
    assert cells(row)[4] == "cuda:1"
    total = re.search(r"<tr style=[^>]*><td[^>]*><i>all</i>.*?</tr>", page).group(0)
    assert len(cells(total)) == len(headers(page))
    assert "<td>device</td><td>cuda:1</td>" in cluster_view._details(s["worker2"], None)
    assert "device" not in headers(cluster_html(status()))


def test_the_device_column_adds_the_bytes_each_worker_owns_on_gpus() -> None:
    """What a worker's values hold on GPUs reads in its device cell, the totals
    row and its panel; values on GPUs bring the column even where the cluster
    gave no worker a GPU of its own."""
    s = status()
    s["worker1"].device_bytes = 3 << 20
    page = cluster_html(s, {"worker1": 1.0}, buttons=True)
    assert headers(page)[4] == "device"
    assert 'title="the worker&#x27;s own device' in page
    row = re.search(r'<tr data-key="worker:worker1".*?</tr>', page).group(0)
    assert cells(row)[4] == "3.0\xa0MiB"  # (a size keeps its unit on its line)
    total = re.search(r"<tr style=[^>]*><td[^>]*><i>all</i>.*?</tr>", page).group(0)
    assert cells(total)[4] == "3.0\xa0MiB" and len(cells(total)) == len(headers(page))
    s["worker1"].device, s["worker2"].device = "cuda:0", "cuda:1"
    row = re.search(r'<tr data-key="worker:worker2".*?</tr>', cluster_html(s)).group(0)
    assert cells(row)[4] == "cuda:1"  # nothing held there: the device alone
    assert "<td>bytes owned on GPUs</td><td>3.0 MiB</td>" in cluster_view._details(
        s["worker1"], None)
    assert "on GPUs" not in cluster_view._details(s["worker2"], None)


def test_the_static_table_keeps_the_markup_the_tutorials_saved() -> None:
    """Saved notebooks compare the static table's HTML (nbval): no live-only parts."""
    page = cluster_html(status(), {"worker1": 1.0})
    assert headers(page)[-1] == "note" and "title=" not in page and "action" not in page
    assert page.startswith('<div><b>nbrpc cluster (fork launcher): 2 workers ready</b>'
                           '<table class="nbrpc-cluster"><thead><tr><th>name</th><th>rank</th>')


def test_a_stopped_cluster_is_one_line() -> None:
    assert cluster_html(ClusterStatus("-", "stopped", [])) == \
        "<div><b>nbrpc cluster (no workers): stopped</b></div>"


def test_big_clusters_are_bounded_and_the_dead_are_drawn_first(monkeypatch) -> None:
    workers = [WorkerStatus("driver", 0, "h", 1, "ready", 16)]
    workers += [WorkerStatus(f"worker{r}", r, "h", 100 + r,
                             "dead" if r in (1500, 1999) else "ready", 16, owned_rrefs=1)
                for r in range(1, 2000)]
    drawn: list[str] = []  # the rows formatted: only those shown, whatever the group's size
    row = cluster_view._row
    monkeypatch.setattr(cluster_view, "_row", lambda w, *a: drawn.append(w.name) or row(w, *a))
    t0 = time.perf_counter()
    page = cluster_html(ClusterStatus("fork", "running", workers), buttons=True)
    print(f"\ncluster view, 2,000 workers: {len(page):,} chars, Python render "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms")
    assert len(drawn) == page.count('<tr data-key="worker:') == MAX_ROWS
    assert 'data-key="worker:worker1500"' in page and 'data-key="worker:worker1999"' in page
    assert f"… and {2000 - MAX_ROWS:,} more ({2000 - MAX_ROWS} ready)" in page
    assert len(page) < 60_000, len(page)


# -- the view ----------------------------------------------------------------------------
def test_text_is_the_status_text_and_static_html_the_table(scripted: Scripted) -> None:
    view = ClusterView(scripted, live=False)
    assert view.text() == str(scripted.next) == repr(view)
    data, _ = view._repr_mimebundle_()
    assert data["text/plain"] == str(scripted.next)
    assert "application/vnd.jupyter.widget-view+json" in data
    assert "<button" not in data["text/html"] and "<table" in data["text/html"]
    assert "<button" in view.html  # the live table has them
    assert view["worker1"].pid == 11 and view.count("ready") == 2
    assert view.title == "nbrpc cluster (fork launcher): 2 workers ready"
    assert [c["id"] for c in view.controls] == ["refresh", "live", "stop"]
    view.close()


def test_a_snapshot_keeps_the_table_of_its_moment(scripted: Scripted) -> None:
    view = ClusterView(scripted, live=False)
    snap = view.snapshot()
    scripted.next = status(dead="worker2")
    view.refresh()
    assert repr(snap) == str(status()) and view.text() == str(scripted.next)
    assert "died (its engine process exited)" not in snap._repr_html_()
    assert "died (its engine process exited)" in view.static_html()
    assert view.last_status is scripted.next
    view.close()


def test_messages_per_second_are_the_difference_between_refreshes(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(cluster_view.time, "monotonic", lambda: clock[0])
    scripted.next = status(messages=100)
    view = ClusterView(scripted, live=False)
    assert view.rates == {}  # one refresh: no rate yet
    scripted.next, clock[0] = status(messages=300), 102.0
    view.refresh()
    # the counters grew by 200, 200 and 400 in 2 s; of that, this view's probes are
    # the request and reply on each worker, and both of them for each on the driver
    assert view.rates == {"driver": 98.0, "worker1": 99.0, "worker2": 199.0}
    assert "<td>99.0</td>" in view.html and "<td>396.0</td>" in view.html  # the total
    # worker2 restarted (another pid, its counters from zero): no rate for it
    scripted.next, clock[0] = status(pids=(10, 11, 99), messages=10), 103.0
    view.refresh()
    assert view.rates["worker2"] is None
    view.close()


def test_an_idle_cluster_shows_no_messages_of_the_views_own_polling(
        scripted: Scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counters that grow by exactly the view's probes read as 0 messages/s;
    a worker that was not probed (dead) costs the driver nothing."""
    clock = [0.0]
    monkeypatch.setattr(cluster_view.time, "monotonic", lambda: clock[0])
    view = ClusterView(scripted, live=False)
    for tick in range(1, 4):
        base = status(messages=0)
        for w in base.workers:
            w.messages = (4 if w.rank == 0 else 2) * tick  # 2 probes; request + reply
        scripted.next, clock[0] = base, 0.5 * tick
        view.refresh()
        assert view.rates == {"driver": 0.0, "worker1": 0.0, "worker2": 0.0}
    dead = status(dead="worker2")
    dead.workers[0].messages, dead.workers[1].messages = 16, 8
    scripted.next, clock[0] = dead, 2.0
    view.refresh()  # the last refresh probed both; this one, worker1 only
    assert view.rates["driver"] == 0.0 and view.rates["worker1"] == 0.0
    dead.workers[0].messages, dead.workers[1].messages = 18 + 5, 10 + 5
    clock[0] = 3.0
    view.refresh()  # 5 messages of someone else's each: 5/s
    assert view.rates["driver"] == 5.0 and view.rates["worker1"] == 5.0
    view.close()

def test_clicking_a_row_shows_its_details(scripted: Scripted) -> None:
    view = ClusterView(scripted, live=False)
    view._on_front_end(view, {"event": "select", "key": "worker:worker2"}, None)
    assert "<b>worker2</b>" in view.panel and "2.0 KiB" in view.panel
    assert 'class="nbrpc-selected"' in view.html  # kept across redraws
    view.refresh()
    assert "<b>worker2</b>" in view.panel and 'class="nbrpc-selected"' in view.html
    view.close()


def test_live_refresh_stops_when_the_cluster_stops_and_shows_it_stopped(
        scripted: Scripted) -> None:
    view = ClusterView(scripted, period=0.5)
    assert view.is_live and live_threads()
    assert view.controls[1]["value"] is True and view.status.startswith("live")
    scripted.next = status(dead="worker1")
    assert poll_for(lambda: view["worker1"].state == "dead", timeout=5)  # the next refresh
    scripted.state = "stopped"
    assert poll_for(lambda: not live_threads(), timeout=5)
    assert view.text() == "nbrpc cluster (no workers): stopped"
    assert view.status.startswith("not live") and view.status.endswith(GONE)
    assert view.controls[1]["value"] is False
    assert view.controls[2]["disabled"] is True  # nothing left to stop
    view.close()


def test_live_refresh_stops_on_close_and_a_newer_view_takes_over(scripted: Scripted) -> None:
    first = ClusterView(scripted)
    second = ClusterView(scripted)
    assert second.is_live and not first.is_live
    assert "a newer view of this cluster refreshes live" in first.status
    assert len(live_threads()) == 1
    second.close()
    assert not live_threads()
    first.on_control("live", True)  # the toggle turns it back on
    assert first.is_live
    first.on_control("live", False)
    assert not first.is_live and not live_threads()
    first.close()


def test_restart_and_stop_run_in_the_background_one_at_a_time(scripted: Scripted) -> None:
    view = ClusterView(scripted, live=False)
    scripted.gate.clear()
    view._on_front_end(view, {"event": "select", "key": "restart:worker2"}, None)  # returns
    assert view.action_running and "restarting worker2…" in view.status
    assert view.html.count(" disabled>") == 2 and view.controls[2]["disabled"]
    view.on_control("stop")  # refused while the restart runs
    assert "wait: restarting worker2 is still running" in view.status
    scripted.gate.set()
    assert view.wait_action(10)
    assert scripted.calls == [("restart", "worker2", False)]  # no progress bar in a cell
    assert "done: restarting worker2" in view.status and view["worker2"].pid == 99
    view.on_control("stop")
    assert view.wait_action(10) and scripted.calls[-1] == ("stop",)
    assert view.text() == "nbrpc cluster (no workers): stopped"
    view.close()


def test_a_failed_action_is_shown_not_raised(scripted: Scripted) -> None:
    view = ClusterView(scripted, live=False)
    scripted.fail = RuntimeError("the engine did not start")
    view._on_front_end(view, {"event": "select", "key": "restart:worker1"}, None)
    assert view.wait_action(10)
    assert "failed: restarting worker1: RuntimeError: the engine did not start" in view.status
    view.close()


def test_a_failing_status_is_said_in_the_status_line(scripted: Scripted) -> None:
    def broken(probe_timeout: float = 1.0) -> Any:
        raise ConnectionError("agent gone")

    view = ClusterView(scripted, live=False)
    scripted.status = broken  # type: ignore[method-assign]
    view.refresh()
    assert "status failed: ConnectionError: agent gone" in view.status
    view.close()


def test_a_stop_makes_every_older_view_of_the_cluster_say_so(scripted: Scripted) -> None:
    older = ClusterView(scripted, live=False)
    newer = ClusterView(scripted, live=False)
    assert older.title == "nbrpc cluster (fork launcher): 2 workers ready"
    newer.on_control("stop")
    assert newer.wait_action(10)
    for view in (older, newer):
        assert view.title == "nbrpc cluster (no workers): stopped"
        assert view.status.endswith(GONE) and view.gone
        assert view.controls[2]["disabled"]  # Stop
        assert not view.controls[0].get("disabled")  # Refresh still reads the cluster
    scripted.state = "running"  # started again: the view comes back with Refresh
    older.on_control("refresh")
    assert not older.gone and not older.status.endswith(GONE)
    assert older.title == "nbrpc cluster (fork launcher): 2 workers ready"
    older.close()
    newer.close()


# -- the start's progress bar ----------------------------------------------------------
def test_the_start_progress_bar_moves_with_every_step() -> None:
    from nbrpc.jupyter.progress import WidgetProgress

    bar = WidgetProgress(3, title="starting nbrpc workers")
    # shown as a bar of 3 workers: the text a saved tutorial keeps of it
    assert repr(bar.bar) == "IntProgress(value=0, max=3)"
    seen = [bar.bar.value]
    for step, message in [(0, "controller started"), (0, "engine zygote warm (torch imported)"),
                          (1, "worker1 ready"), (1, "worker2 ready"), (1, "worker3 ready")]:
        bar.update(step, message)
        seen.append(bar.bar.value)
        assert bar.label.value.endswith(message)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)  # every step moves it
    assert seen[0] == 0 and 0 < seen[2] < bar.bar.max / 4 and seen[-1] == bar.bar.max
    assert bar.label.value == "starting nbrpc workers: 3/3 worker3 ready"
    bar.close()


def test_a_start_in_a_batch_queue_shows_the_live_view_under_the_bar(scripted: Scripted) -> None:
    from nbrpc.jupyter.progress import WidgetProgress

    scripted.state = "starting"
    scripted.next = ClusterStatus("slurm", "starting", [
        WorkerStatus("driver", 0, state="ready"),
        WorkerStatus("worker1", 1, state="starting", job="Slurm job 17 PENDING (Resources)")])
    scripted.status = lambda probe_timeout=1.0: scripted.next  # rows while starting
    bar = WidgetProgress(1, title="starting nbrpc workers", cluster=scripted)
    try:
        assert bar.view is not None and bar.view.live_now
        assert "Slurm job 17 PENDING (Resources)" in bar.view.html
        assert bar.view.title == "nbrpc cluster (slurm launcher): starting, 0 of 1 workers ready"
    finally:
        bar.close()
    assert not bar.view.live_now  # closed with the bar: the cell's result is the cluster's view
