"""The live cluster view (``%rpc_cluster status``, ``cluster.widget()``) and its static table.

One row per member: name, rank, host, pid, state, threads busy, calls in
flight, owned RRefs and their bytes, messages per second. That rate is the
difference of the agents' message counters between two refreshes, less the
view's own status probes (each refresh sends every worker a probe and gets a
reply: two messages on the worker, two per worker on the driver), so an idle
cluster shows its heartbeats alone (4/s a worker at the default 0.5 s).

The view refreshes itself at most twice a second while the cluster runs
(:meth:`View.live`), marks a dead worker on the next refresh (the driver's
agent knows at once), and stops refreshing when the cluster stops or the
widget is closed. Each row has a Restart button (in a column of its own), the
head a Stop button; they run in a background thread, so the kernel stays
responsive, and their outcome lands in the status line. A stop, from here or
from a cell, makes every older view of the cluster draw it stopped and say so.

:func:`cluster_html` is the static table (no buttons): the view's static
repr, and the HTML display of a :class:`~nbrpc.cluster.ClusterStatus` once
the extension is loaded. What varies between runs (hosts, pids, counters,
why a worker died) is wrapped with :func:`~nbrpc.jupyter.view.varies`.

>>> from nbrpc.cluster import ClusterStatus, WorkerStatus
>>> s = ClusterStatus("fork", "running", [
...     WorkerStatus("driver", 0, "h", 10, "ready", 16, 0, 0, 2, 2048, 50),
...     WorkerStatus("worker1", 1, "h", 11, "dead", 16, detail="died (its engine exited)")])
>>> page = cluster_html(s)
>>> page.count("<tr"), 'data-key="worker:worker1"' in page, "2.0 KiB" in page
(4, True, True)
>>> 'data-key="restart:worker1"' in page, 'data-key="restart:worker1"' in cluster_html(
...     s, buttons=True)
(False, True)
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..cluster import Cluster, ClusterStatus, WorkerStatus
from .svg import STATE_COLOURS, esc, fmt_bytes
from .view import STATUS_STYLE, View, button, check_open_views, toggle, varies

log = logging.getLogger(__name__)

MAX_ROWS = 64  # members drawn; the rest are summarised (the dead ones are drawn first)
PERIOD = 0.5  # seconds between live refreshes: at most 2 Hz
# rows marked by a translucent tint: the theme's text reads over it, light or dark
DEAD_BACKGROUND = "rgba(198, 40, 40, 0.1)"
SELECTED_BACKGROUND = "rgba(255, 152, 0, 0.16)"
COLUMNS = ("name", "rank", "host", "pid", "state", "threads busy", "calls in flight",
           "owned RRefs", "bytes owned", "messages/s", "note")
ACTION = "action"  # the live table's last column: a worker's Restart button
HINTS = {"messages/s": "messages sent and received per second, less this view's own "
                       "status probes (heartbeats count)",
         "device": "the worker's own device (a cluster started with GPUs), and the bytes "
                   "of the values it owns on GPUs"}
OWN_PER_PROBE = 2  # messages one status probe costs a worker: the request and its reply

# The one view per cluster that refreshes live: a newer view of the same cluster
# takes over, so a notebook that shows the status often still probes at 2 Hz.
_LIVE: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()


def _rate(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:.1f}"


def _shown(workers: list[WorkerStatus], limit: int) -> list[WorkerStatus]:
    """At most ``limit`` rows, by rank; rows that are not ``ready`` are kept first."""
    if len(workers) <= limit:
        return workers
    keep = sorted(workers, key=lambda w: (w.state == "ready", w.rank))[:limit]
    return sorted(keep, key=lambda w: w.rank)


def _state_style(state: str) -> str:
    """A state's colour: view.css's shade for the theme where view.css is loaded (the
    widget, JupyterLab light or dark), else svg.py's hue mixed with the text colour,
    which reads on a light and a dark page (a saved notebook elsewhere)."""
    hue = STATE_COLOURS.get(state)
    if hue is None:
        return ""
    return (f' style="color:var(--nbrpc-state-{state}, '
            f'color-mix(in srgb, {hue} 60%, currentColor))"')


def _row(w: WorkerStatus, rate: float | None, buttons: bool, selected: bool,
         busy: bool, devices: bool = False) -> str:
    state = f"<b{_state_style(w.state)}>{esc(w.state)}</b>"
    device = f"<td>{esc(device_words(w))}</td>" if devices else ""
    where = varies(f"<td>{esc(w.host or '')}</td><td>{esc(w.pid or '')}</td>{device}")
    counters = varies(
        f"<td>{w.busy_threads}/{w.threads}</td><td>{w.in_flight}</td>"
        f"<td>{w.owned_rrefs}</td><td>{fmt_bytes(w.owned_bytes)}</td>"
        f"<td>{_rate(rate)}</td><td>{esc(w.detail or w.job)}</td>")
    action = ""
    if buttons:  # a column of its own, after the note
        if w.rank == 0:
            action = "<td></td>"
        else:
            off = " disabled" if busy else ""
            action = (f'<td><button class="nbrpc-button" data-key="restart:{esc(w.name)}"'
                      f' title="restart {esc(w.name)} under the same name and rank (its RRefs '
                      f'are lost)"{off}>Restart</button></td>')
    style = ""
    if w.state == "dead":
        style = f' style="background:{DEAD_BACKGROUND}"'
    elif selected:
        style = f' style="background:{SELECTED_BACKGROUND}"'
    mark = ' class="nbrpc-selected"' if selected else ""
    return (f'<tr data-key="worker:{esc(w.name)}"{mark}{style}><td><b>{esc(w.name)}</b>'
            f"</td><td>{w.rank}</td>{where}<td>{state}</td>{counters}{action}</tr>")


def size(n: int) -> str:
    """A size in a device cell: its number and unit kept on one line (the
    column is narrow; the table still fits 900 pixels).

    >>> size(3 << 20)
    '3.0\xa0MiB'
    """
    return fmt_bytes(n).replace(" ", "\xa0")


def device_words(w: WorkerStatus) -> str:
    """A row's device cell: the worker's own device and what its values hold on
    GPUs (the column's heading says so on hover).

    >>> device_words(WorkerStatus("worker1", 1, device="cuda:1", device_bytes=3 << 20))
    'cuda:1 · 3.0\xa0MiB'
    >>> device_words(WorkerStatus("worker2", 2, device_bytes=512)), device_words(WorkerStatus("d", 0))
    ('512\xa0B', '')
    """
    if not w.device_bytes:
        return w.device
    held = size(w.device_bytes)
    return f"{w.device} · {held}" if w.device else held


def cluster_html(status: ClusterStatus, rates: dict[str, float | None] | None = None,
                 buttons: bool = False, selected: str | None = None,
                 busy: bool = False, limit: int = MAX_ROWS, heading: bool = True) -> str:
    """The status as an HTML table: the static repr (``buttons=False``) or the
    live view's body (a Restart button per worker, disabled while ``busy``;
    no ``heading``: the widget's title says it)."""
    rates = rates or {}
    # (a cluster with gpus=True, or values on GPUs)
    devices = any(w.device or w.device_bytes for w in status.workers)
    columns = COLUMNS[:4] + ("device",) + COLUMNS[4:] if devices else COLUMNS
    head = "".join(_th(c, hint=buttons) for c in columns + ((ACTION,) if buttons else ()))
    shown = _shown(status.workers, limit)
    rows = [_row(w, rates.get(w.name), buttons, w.name == selected, busy, devices)
            for w in shown]
    if len(shown) < len(status.workers):
        hidden = [w for w in status.workers if w not in shown]
        states = ", ".join(f"{sum(w.state == s for w in hidden)} {s}"
                           for s in sorted({w.state for w in hidden}))
        rows.append(f'<tr><td colspan="{len(columns) + buttons}">… and '
                    f"{len(hidden):,} more ({esc(states)})</td></tr>")
    if len(status.workers) > 1:
        known = [r for r in (rates.get(w.name) for w in status.workers) if r is not None]
        total = sum(known) if known else None
        rows.append(
            '<tr style="border-top:1px solid #999"><td><i>all</i></td>'
            + "<td></td>" * 3 + (_device_total(status.workers) if devices else "")
            + "<td></td>" + varies(
                f"<td>{sum(w.busy_threads for w in status.workers)}/"
                f"{sum(w.threads for w in status.workers)}</td>"
                f"<td>{sum(w.in_flight for w in status.workers)}</td>"
                f"<td>{sum(w.owned_rrefs for w in status.workers)}</td>"
                f"<td>{fmt_bytes(sum(w.owned_bytes for w in status.workers))}</td>"
                f"<td>{_rate(total)}</td><td></td>") + ("<td></td>" if buttons else "")
            + "</tr>")
    body = "".join(rows)
    table = (f'<table class="nbrpc-cluster"><thead><tr>{head}</tr></thead>'
             f"<tbody>{body}</tbody></table>") if status.workers else ""
    head_line = f"<b>{esc(status.summary())}</b>" if heading else ""
    return f"<div>{head_line}{table}</div>"


def _device_total(workers: list[WorkerStatus]) -> str:
    held = sum(w.device_bytes for w in workers)
    return varies(f"<td>{size(held)}</td>") if held else "<td></td>"


def _th(column: str, hint: bool) -> str:
    """A header cell; the live table's say what they count on hover. (The static
    table's markup is what the tutorials' saved outputs compare: kept plain.)"""
    title = f' title="{esc(HINTS[column])}"' if hint and column in HINTS else ""
    return f"<th{title}>{esc(column)}</th>"


def _details(w: WorkerStatus, rate: float | None) -> str:
    """The panel for a clicked row: every field of the member's status."""
    fields = [("name", w.name), ("rank", w.rank), ("state", w.state), ("host", w.host or "?"),
              ("pid", w.pid or "?"), ("threads busy", f"{w.busy_threads} of {w.threads}"),
              ("calls in flight", w.in_flight), ("owned RRefs", w.owned_rrefs),
              ("bytes owned", fmt_bytes(w.owned_bytes)), ("messages", f"{w.messages:,}"),
              ("messages/s", _rate(rate)), ("bytes moved", fmt_bytes(w.bytes_moved))]
    if w.torch_threads:
        fields.append(("torch.get_num_threads()", w.torch_threads))
    if w.blas_threads:
        fields.append(("BLAS threads (threadpoolctl)", w.blas_threads))
    if w.device:
        fields.append(("device", w.device))
    if w.device_bytes:
        fields.append(("bytes owned on GPUs", fmt_bytes(w.device_bytes)))
    if w.job:
        fields.append(("batch job", w.job))
    if w.detail:
        fields.append(("note", w.detail))
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in fields)
    hint = ("<p>Restart it with its row's button (same name and rank; the values it "
            "owned are lost).</p>" if w.rank else "<p>The driver: this kernel.</p>")
    return f"<b>{esc(w.name)}</b><table>{rows}</table>{hint}"


class ClusterView(View):
    """A :class:`~nbrpc.cluster.Cluster`'s members, live (``cluster.widget()``).

    ``live``: refresh every ``period`` seconds (at least 0.5) while the cluster
    runs; a newer live view of the same cluster takes over from this one.
    ``text/plain`` is the status's text (names, ranks, states): deterministic.
    ``last_status`` is the last refresh's :class:`~nbrpc.cluster.ClusterStatus`;
    :meth:`snapshot` freezes the view, as every view's.

    Its group is the cluster: once the cluster has stopped, the view draws it
    stopped and says so; Refresh and the rows still answer (they read the
    cluster object), and a cluster started again brings the view back.
    """

    group_controls = frozenset({"stop"})

    def __init__(self, cluster: Cluster, live: bool = True, period: float = PERIOD,
                 probe_timeout: float = 1.0, action_timeout: float | None = None) -> None:
        super().__init__()
        self.cluster, self.period, self.probe_timeout = cluster, max(PERIOD, period), probe_timeout
        self.action_timeout = action_timeout or (getattr(cluster, "timeout", 60.0) + 15.0)
        self.last_status = ClusterStatus(cluster.launcher_name, cluster.state, [])
        self.rates: dict[str, float | None] = {}
        self.selected: str | None = None
        self.note = ""  # the outcome of the last action, kept in the status line
        self._counts: tuple[float, dict[str, tuple[Any, int]]] | None = None
        self._probed = 0  # workers the last refresh probed
        self._lock = threading.RLock()
        self._action: threading.Thread | None = None
        self._action_what = ""
        self._ended = False  # the live thread saw the cluster stop and is ending
        self.refresh()
        if live and cluster.state != "stopped":
            self.live(self.period)

    # -- data ------------------------------------------------------------------------
    def refresh(self) -> None:
        """Probe every member (bounded by ``probe_timeout``) and redraw."""
        with self._lock:
            if self.gone and self.cluster.state == "running":  # started again
                self.gone = False
            try:
                status = self.cluster.status(self.probe_timeout)
            except Exception as e:  # noqa: BLE001 - a stopping cluster: said, not raised
                log.debug("cluster status failed", exc_info=True)
                self.note = f"status failed: {type(e).__name__}: {e}"
                status = ClusterStatus(self.cluster.launcher_name, self.cluster.state, [])
            self._measure(status)
            self.last_status = status
            self._draw()

    def _measure(self, status: ClusterStatus) -> None:
        """messages/s per member: the counters' difference since the last refresh
        (none for a member that is new or restarted since), less this view's own
        probes. Each worker reads its counters inside a probe, so between two reads
        it has seen one probe's reply and the next probe's request; the driver reads
        its own before probing, so between two reads it has sent the last refresh's
        probes and had their replies."""
        now = time.monotonic()
        counts = {w.name: (w.pid, w.messages) for w in status.workers if w.pid is not None}
        probed = sum(w.rank != 0 and w.state in ("ready", "busy") for w in status.workers)
        if self._counts is not None:
            then, before = self._counts
            dt = max(now - then, 1e-6)
            self.rates = {}
            for w in status.workers:
                if w.name not in counts:
                    continue
                pid, n = counts[w.name]
                old = before.get(w.name)
                if old is None or old[0] != pid or n < old[1]:
                    self.rates[w.name] = None
                    continue
                own = OWN_PER_PROBE * (self._probed if w.rank == 0 else 1)
                self.rates[w.name] = max(0, n - old[1] - own) / dt
        self._counts = (now, counts)
        self._probed = probed

    def _draw(self) -> None:
        with self._lock:
            self._draw_locked()

    @property
    def live_now(self) -> bool:
        """Whether a live refresh runs (and has not seen the cluster stop)."""
        return self.is_live and not self._ended

    def _draw_locked(self) -> None:
        s, busy = self.last_status, self.action_running
        running = s.state == "running"
        self.title = s.summary()
        self.html = cluster_html(s, self.rates, buttons=running, selected=self.selected,
                                 busy=busy, heading=False)
        self.controls = [
            button("refresh", "Refresh", title="probe every member now"),
            toggle("live", "live", self.live_now,
                   f"refresh every {self.period:g} s while the cluster runs"),
            button("stop", "Stop cluster", disabled=busy or not running,
                   title="stop every worker and this kernel's agent"),
        ]
        if self.selected is not None:
            try:
                self.panel = _details(s[self.selected], self.rates.get(self.selected))
            except KeyError:  # removed since
                self.selected, self.panel = None, ""
        live = "live" if self.live_now else "not live"
        parts = [f"{live}; refreshed {time.strftime('%H:%M:%S')}"]
        if busy:
            parts.append(f"{self._action_what}…")
        if self.note:
            parts.append(self.note)
        self.status = " · ".join(parts)

    def text(self) -> str:
        return str(self.last_status)

    def static_html(self) -> str:
        """The table as it stands (no buttons); hosts, pids and counters marked as varying."""
        panel = (f'<div class="nbrpc-panel">{varies(self.panel)}</div>' if self.panel else "")
        status = (f'<div style="{STATUS_STYLE}">{varies(esc(self.status))}</div>'
                  if self.status else "")
        return (f'<div class="nbrpc-static">{cluster_html(self.last_status, self.rates)}'
                f"{panel}{status}</div>")

    @property
    def group_gone(self) -> bool:
        return self.cluster.state == "stopped"

    def on_group_gone(self) -> None:
        self.refresh()  # the cluster as it is: stopped

    def __getitem__(self, name: str) -> WorkerStatus:
        """The last refresh's row of member ``name`` (as ``ClusterStatus[name]``)."""
        return self.last_status[name]

    def count(self, state: str) -> int:
        """How many workers (the driver aside) were in ``state`` at the last refresh."""
        return self.last_status.count(state)

    # -- live --------------------------------------------------------------------------
    def live(self, period: float = PERIOD, alive: Callable[[], bool] | None = None,
             max_seconds: float = 3600.0) -> None:
        """Refresh every ``period`` s (>= 0.5) until the cluster stops or the view
        closes; the previous live view of this cluster stops refreshing."""
        previous = _LIVE.get(self.cluster)
        other = previous() if previous is not None else None
        if other is not None and other is not self:
            other.stop_live()
            other.note = "a newer view of this cluster refreshes live"
            other._draw()
        _LIVE[self.cluster] = weakref.ref(self)
        self._ended = False
        super().live(period, alive or self._cluster_runs, max_seconds)
        self._draw()

    def _cluster_runs(self) -> bool:
        """The live thread's test: once the cluster has stopped, draw it so, and end."""
        if self.cluster.state == "stopped":
            self._ended = True  # this thread ends now: say "not live"
            self.refresh()
            return False
        return True

    # -- the buttons ---------------------------------------------------------------------
    def on_control(self, id: str, value: Any = None) -> None:
        if id == "refresh":
            self.refresh()
        elif id == "live":
            if value:
                self.live(self.period)
            else:
                self.stop_live()
            self._draw()
        elif id == "stop":
            self.run_action("stopping the cluster", self.cluster.stop)
        else:
            super().on_control(id, value)

    def on_select(self, key: str) -> None:
        what, _, name = key.partition(":")
        if what == "restart":
            self.run_action(f"restarting {name}",
                            lambda: self.cluster.restart(name, progress=False))
        elif what == "worker":
            self.selected = name
            self._draw()

    @property
    def action_running(self) -> bool:
        return self._action is not None and self._action.is_alive()

    def run_action(self, what: str, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` (a restart, the stop) in a background thread, one at a time,
        so the kernel's message handler returns at once; its outcome (and time)
        lands in the status line. Returns False if another action still runs."""
        with self._lock:
            if self.action_running:
                self.note = f"wait: {self._action_what} is still running"
                self._draw()
                return False
            self._action_what, self.note = what, ""
            self._action = threading.Thread(target=self._act, args=(what, fn),
                                            name="nbrpc-cluster-action", daemon=True)
            self._action.start()
            self._draw()
            return True

    def _act(self, what: str, fn: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        try:
            fn()
            note = f"done: {what} ({time.monotonic() - t0:.1f} s)"
        except Exception as e:  # noqa: BLE001 - shown where the button was pressed
            log.warning("nbrpc cluster view: %s failed", what, exc_info=True)
            note = f"failed: {what}: {type(e).__name__}: {e}"
        # the thread is still alive while it draws: mark it done first
        with self._lock:
            self._action = None
            self.note = note
            self.refresh()
        check_open_views()  # a stop: every view of the cluster's group says so

    def wait_action(self, timeout: float | None = None) -> bool:
        """Wait for the running action (bounded: ``action_timeout`` by default);
        True if none is left running."""
        t = self._action
        if t is not None:
            t.join(self.action_timeout if timeout is None else timeout)
        return not self.action_running
