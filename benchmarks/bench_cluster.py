"""Cluster start-up: 4 workers to all ready, torch imported on each, side by side.

Run it with ``.venv/bin/python benchmarks/bench_cluster.py``; ``--quick`` runs
each case once (a smoke test), ``--markdown`` prints the table as Markdown for
the README, ``--cases fork,ipp`` (any comma list of the keys below) runs only
those cases.

The cases (this process is the driver of each but ``torch``, see there;
torch, nbrpc, ipyparallel and torch.distributed.rpc are imported here before
any clock starts):

``fork``
    ``nbrpc.Cluster(launcher="fork", progress=False).start(4)``, cold: it starts
    the warm zygote (which imports torch once and forks the engines), the
    ipyparallel controller, 4 engines and their agents, and returns when every
    agent has joined this process's group. Timed from the call to its return.
    Then, timed separately, one ``rpc_sync(workerN, os.getpid)`` to each worker
    (proof of readiness: 4 distinct pids, none of them this process's).
``local``
    The same with ``launcher="local"``: ipyparallel's plain local process
    launcher; each engine imports torch itself (when nbrpc's agent starts there).
``ipp``
    ipyparallel's default: ``ipp.Cluster(n=4).start_and_connect_sync()``, then
    ``client[:].apply_sync(lambda: __import__("torch") and 1)`` (as
    ``apply_async(...).get(timeout)``, to bound the wait). Start → all ready
    is the sum of the two; both parts are shown. The profile is a fresh
    temporary directory (so a user's ``ipcluster_config.py`` changes nothing).
``ipp-hb500``
    The same with ``controller_args=["--HeartMonitor.period=500"]`` (the
    controller's default period is 3000 ms; an engine's registration completes
    only when the heart monitor has seen its heart beat).
``torch``
    ``torch.distributed.rpc`` (TensorPipe, default options): 4 processes
    started with ``torch.multiprocessing``'s spawn context, each running
    ``import torch``, ``init_rpc("workerN", rank=N, world_size=5)`` and
    ``rpc.shutdown()``, and the driver as rank 0 (``init_rpc("driver", rank=0,
    world_size=5)``, in a helper thread so that the wait stays bounded),
    ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``. Timed from starting
    the 4 processes to ``init_rpc`` returning in the driver; then the same
    ``rpc_sync`` round; stop = ``rpc.shutdown()`` in the driver plus joining
    the 4 processes. The driver is not this process but a fresh spawned one
    per repetition that has imported torch and torch.distributed.rpc before
    the clock starts: torch.distributed.rpc cannot form a second group with
    fresh workers in one process (per-process counters: the store prefix
    ``rpc_prefix_K`` and TensorPipe's shutdown barrier ``READY_ID_K``), so
    after the first repetition ``init_rpc`` or ``shutdown`` would wait forever.
``fork-hb100`` (not run unless named in ``--cases``)
    ``fork`` with ``Cluster(heartbeat=0.1)``: the controller's heart monitor
    beats every 100 ms instead of 500 ms (and the agents' heartbeat is 0.1 s).

For the nbrpc cases the table is followed by their phases, taken from the
``nbrpc.cluster`` log records (captured at INFO: when the controller was
launched, the zygote was warm, the engines were launched, the workers were
ready; when the engines and the controller had stopped), and for every case
with a controller by how long the engines' registrations took, read from the
controller's log after the clock stopped (a registration completes when
ipyparallel's heart monitor has seen the engine's heart beat).

Stop: ``cluster.stop()`` for nbrpc; ``client.close()`` and
``cluster.stop_cluster_sync()`` for ipyparallel. Every case is repeated
``--repeat`` times (default 3, 1 with ``--quick``), the order of the cases
reversed every other repetition; the table shows the median and the minimum.
Before the first repetition one untimed ``python -c "import torch, ..."``
warms the page cache, so no case pays for reading torch from disk.

Every wait is bounded (``--timeout`` per wait, given to each API that takes one;
ipyparallel's own bounds elsewhere: 60 s for the controller's connection
files, SIGKILL 5 s after SIGTERM when stopping);
every process a case starts is stopped by the API that started it, also when
the case fails (failures are listed under "problems"; the exit status is 1
when there are any). Nothing else is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

# Only the standard library at the top: the spawned torch workers import this
# module (as __mp_main__) before they run, and must import torch themselves.

N = 4  # workers
TARGET_S = 4.0  # the issue's target for nbrpc's start of 4 workers
CASES: dict[str, str] = {
    "fork": 'nbrpc Cluster(launcher="fork")',
    "local": 'nbrpc Cluster(launcher="local")',
    "ipp": "ipyparallel default",
    "ipp-hb500": "ipyparallel, HeartMonitor.period=500",
    "torch": "torch.distributed.rpc (spawn)",
    "fork-hb100": 'nbrpc Cluster(launcher="fork", heartbeat=0.1)',
}
SHORT = {"fork": "nbrpc fork", "local": "nbrpc local", "ipp": "ipyparallel default",
         "ipp-hb500": "ipyparallel hb500", "torch": "torch.distributed.rpc",
         "fork-hb100": "nbrpc fork hb100"}
DEFAULT_CASES = ("fork", "local", "ipp", "ipp-hb500", "torch")
IPP_CONTROLLER_ARGS = {"ipp": None, "ipp-hb500": ["--HeartMonitor.period=500"]}
PRELOAD = "import torch, ipyparallel.engine.app, ipyparallel.controller.app, nbrpc.cluster.zygote"


@dataclasses.dataclass(frozen=True)
class Config:
    timeout: float  # seconds, per wait (start, each engine, rpc, stop, ...)


class CaseFailed(Exception):
    """A case could not be measured (what it started has been stopped)."""


# -- nbrpc.Cluster ------------------------------------------------------------
class _Records(logging.Handler):
    """Every record of the ``nbrpc.cluster`` loggers, with ``time.perf_counter()``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[float, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad record must not break the run
            message = str(record.msg)
        self.records.append((time.perf_counter(), record.levelno, message))


@contextlib.contextmanager
def cluster_log() -> Iterator[_Records]:
    """Capture ``nbrpc.cluster`` at INFO for the phases (not DEBUG: then ipyparallel
    streams the controller's output to stderr from a thread); warnings and
    errors go on to stderr."""
    logger = logging.getLogger("nbrpc.cluster")
    handler = _Records()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        for _, levelno, message in handler.records:
            if levelno >= logging.WARNING:  # the first line: engine output can be long
                lines = message.splitlines() or [""]
                more = f" [{len(lines) - 1} more lines]" if len(lines) > 1 else ""
                print(f"  [nbrpc.cluster {logging.getLevelName(levelno)}] {lines[0][:200]}{more}",
                      file=sys.stderr, flush=True)


PHASES = (  # (key, label, pattern of the log message, first or last match)
    ("controller", "controller launched", r": 0/\d+ controller started$", "first"),
    ("zygote", "zygote warm (torch imported)", r"engine zygote warm", "first"),
    ("engine_first", "first engine launched", r"^Starting 1 engines with", "first"),
    ("engine_last", "last engine launched", r"^Starting 1 engines with", "last"),
    ("ready_first", "first worker ready", r": 1/\d+ worker\d+ ready$", "first"),
    ("ready_last", "last worker ready", r": \d+/\d+ worker\d+ ready$", "last"),
)
STOP_PHASES = (  # the same, after the stop() call
    ("stop_engines", "engines stopped", r"^engine set stopped ", "last"),
    ("stop_controller", "controller stopped", r"^Controller stopped", "last"),
)
_REGISTERED = re.compile(r"finished registering engine \d+:\S+ in (\d+)ms")
_HEARTBEAT = re.compile(r"Heartmonitor beating every (\d+)ms")


def nbrpc_phases(records: list[tuple[float, int, str]], t0: float,
                 phases: tuple = PHASES) -> dict[str, float]:
    """Seconds after ``t0`` at which each of ``phases`` was logged."""
    out: dict[str, float] = {}
    for key, _, pattern, which in phases:
        times = [t for t, _, m in records if re.search(pattern, m) and t >= t0]
        if times:
            out[key] = (times[0] if which == "first" else times[-1]) - t0
    return out


def registrations(controller_output: str) -> dict[str, float]:
    """From a controller's log: the heart monitor's period and how long the
    engines' registrations took (median, max), in seconds."""
    out: dict[str, float] = {}
    took = [int(ms) / 1e3 for ms in _REGISTERED.findall(controller_output)]
    if took:
        out["registration_median"] = statistics.median(took)
        out["registration_max"] = max(took)
    period = _HEARTBEAT.search(controller_output)
    if period:
        out["heartbeat_period"] = int(period.group(1)) / 1e3
    return out


def check_pids(pids: list[Any]) -> None:
    if len(set(pids)) != N or os.getpid() in pids or not all(isinstance(p, int) for p in pids):
        raise CaseFailed(f"the workers answered pids {pids}: not {N} distinct other processes")


def run_nbrpc(launcher: str, cfg: Config, **options: Any) -> dict[str, float]:
    """``Cluster(launcher=...).start(N)``, a round of ``rpc_sync``, ``stop()``."""
    from nbrpc import rpc
    from nbrpc.cluster import Cluster

    rec: dict[str, float] = {}
    with cluster_log() as log:
        cluster = Cluster(launcher=launcher, progress=False, timeout=cfg.timeout, **options)
        started = False
        t0 = time.perf_counter()
        try:
            cluster.start(N)  # on failure it stops what it started, then raises
            rec["ready_s"] = time.perf_counter() - t0
            started = True
            t = time.perf_counter()
            pids = [rpc.rpc_sync(f"worker{r}", os.getpid, timeout=cfg.timeout)
                    for r in range(1, N + 1)]
            rec["round_s"] = time.perf_counter() - t
            check_pids(pids)
            ipp_cluster = getattr(cluster, "_ipp", None)  # read-only peek, after the clock
            if ipp_cluster is not None and ipp_cluster.controller is not None:
                rec.update(registrations(ipp_cluster.controller.get_output(remove=False) or ""))
        finally:
            t_stop = time.perf_counter()
            cluster.stop(timeout=cfg.timeout)  # does nothing if start() stopped it already
            if started:
                rec["stop_s"] = time.perf_counter() - t_stop
        rec.update(nbrpc_phases([r for r in log.records if r[0] < t_stop], t0))
        if started:
            rec.update(nbrpc_phases(log.records, t_stop, STOP_PHASES))
    return rec


# -- ipyparallel ----------------------------------------------------------------
def run_ipp(controller_args: list[str] | None, cfg: Config) -> dict[str, float]:
    """``ipp.Cluster(n=N).start_and_connect_sync()``, ``apply`` of ``import torch``,
    then ``client.close()`` and ``stop_cluster_sync()``."""
    import ipyparallel as ipp

    rec: dict[str, float] = {}
    profile = tempfile.mkdtemp(prefix="bench-cluster-ipp-")
    kwargs: dict[str, Any] = dict(n=N, profile_dir=profile, engine_timeout=int(cfg.timeout))
    if controller_args:
        kwargs["controller_args"] = list(controller_args)
    cluster = ipp.Cluster(**kwargs)  # its wait for the connection files: 60 s at most
    client = None
    try:
        t0 = time.perf_counter()
        client = cluster.start_and_connect_sync()
        t1 = time.perf_counter()
        ones = client[:].apply_async(lambda: __import__("torch") and 1).get(timeout=cfg.timeout)
        t2 = time.perf_counter()
        if ones != [1] * N:
            raise CaseFailed(f"apply(import torch) returned {ones!r}")
        rec.update(ready_s=t2 - t0, connect_s=t1 - t0, import_s=t2 - t1)
        if cluster.controller is not None:  # after the clock
            rec.update(registrations(cluster.controller.get_output(remove=False) or ""))
    finally:
        t = time.perf_counter()
        try:
            if client is not None:
                client.close()
        finally:
            if cluster.controller is not None or cluster.engines:
                cluster.stop_cluster_sync()  # TERM, KILL after 5 s, each wait bounded
                if "ready_s" in rec:
                    rec["stop_s"] = time.perf_counter() - t
            shutil.rmtree(profile, ignore_errors=True)
    return rec


# -- torch.distributed.rpc ------------------------------------------------------
def _torch_worker(rank: int, world_size: int, port: int, timeout: float) -> None:
    """A spawned worker: import torch, join the group, serve until rank 0 shuts down."""
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    import torch  # noqa: F401 - the import is part of what is timed
    import torch.distributed.rpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    rpc.shutdown(graceful=True, timeout=timeout)  # waits for every rank, serving calls


def _torch_driver(conn: Any, port: int, timeout: float) -> None:
    """Rank 0, in a fresh spawned process: import (untimed), say so, wait for the
    go, then :func:`torch_group` and send its record (or the error) back."""
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    import torch  # noqa: F401
    import torch.distributed.rpc  # noqa: F401
    import torch.multiprocessing  # noqa: F401

    conn.send("ready")
    if not conn.poll(timeout):
        return
    conn.recv()
    try:
        conn.send(("ok", torch_group(port, timeout)))
    except Exception as e:  # noqa: BLE001 - reported by the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))


def torch_group(port: int, timeout: float) -> dict[str, float]:
    """4 spawned workers + this process as rank 0: start → ``init_rpc`` returned
    here, an ``rpc_sync`` round, ``rpc.shutdown()`` and joining the workers."""
    import torch.distributed.rpc as rpc
    import torch.multiprocessing as mp

    rec: dict[str, float] = {}
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    joined = False
    box: dict[str, Any] = {}

    def init() -> None:  # the rendezvous waits up to 30 min if a worker never comes
        try:
            rpc.init_rpc("driver", rank=0, world_size=N + 1)
            box["done"] = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            box["error"] = e

    try:
        t0 = time.perf_counter()
        for rank in range(1, N + 1):
            p = ctx.Process(target=_torch_worker, args=(rank, N + 1, port, timeout),
                            name=f"bench-torch-worker{rank}", daemon=True)
            p.start()
            procs.append(p)
        thread = threading.Thread(target=init, name="bench-torch-init", daemon=True)
        thread.start()
        deadline = t0 + timeout
        while thread.is_alive():
            thread.join(0.01)
            dead = [p for p in procs if p.exitcode is not None]
            if thread.is_alive() and (dead or time.perf_counter() > deadline):
                raise CaseFailed("init_rpc: " + (f"{dead[0].name} exited with code "
                                                 f"{dead[0].exitcode}" if dead
                                                 else f"not done within {timeout:g} s"))
        if "error" in box:
            raise CaseFailed(f"init_rpc: {type(box['error']).__name__}: {box['error']}")
        joined = True
        rec["ready_s"] = box["done"] - t0
        try:
            t = time.perf_counter()
            pids = [rpc.rpc_sync(f"worker{r}", os.getpid, timeout=timeout)
                    for r in range(1, N + 1)]
            rec["round_s"] = time.perf_counter() - t
            check_pids(pids)
        finally:
            t = time.perf_counter()
            rpc.shutdown(graceful=True, timeout=timeout)
            joined = False
            for p in procs:
                p.join(max(0.1, t + timeout - time.perf_counter()))
            if any(p.exitcode != 0 for p in procs):
                raise CaseFailed("after rpc.shutdown(): worker exit codes "
                                 f"{[p.exitcode for p in procs]}")
            rec["stop_s"] = time.perf_counter() - t
    finally:
        if joined:  # failed between init_rpc and shutdown: leave the group locally
            with contextlib.suppress(Exception):
                rpc.shutdown(graceful=False)
        for p in procs:  # only what failed to exit: the processes this group started
            if p.is_alive():
                p.kill()
            p.join(5)
    return rec


def run_torch(cfg: Config, port: int) -> dict[str, float]:
    """:func:`torch_group` in a fresh helper process (rank 0 there), which has
    imported torch before the go: torch.distributed.rpc cannot make a second
    group with fresh workers in one process (see the module's doc)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    driver = ctx.Process(target=_torch_driver, args=(child_conn, port, cfg.timeout),
                         name="bench-torch-driver")  # not daemonic: it has children
    driver.start()
    child_conn.close()
    try:
        if not conn.poll(cfg.timeout):
            raise CaseFailed(f"the rank-0 process was not ready within {cfg.timeout:g} s")
        conn.recv()
        conn.send("go")
        # its own waits are bounded (start, round, shutdown, joins); this is a backstop
        if not conn.poll(4 * cfg.timeout + 30):
            raise CaseFailed("the rank-0 process sent no result in time")
        status, payload = conn.recv()
    except EOFError:
        raise CaseFailed(f"the rank-0 process died (exit code {driver.exitcode})") from None
    finally:
        conn.close()
        driver.join(cfg.timeout)
        if driver.is_alive():  # the backstop: it stops its workers itself
            driver.kill()
            driver.join(5)
    if status != "ok":
        raise CaseFailed(payload)
    return payload


# -- the run --------------------------------------------------------------------
def run_case(key: str, cfg: Config, port: Callable[[], int]) -> dict[str, float]:
    if key == "fork":
        return run_nbrpc("fork", cfg)
    if key == "fork-hb100":
        return run_nbrpc("fork", cfg, heartbeat=0.1)
    if key == "local":
        return run_nbrpc("local", cfg)
    if key in IPP_CONTROLLER_ARGS:
        return run_ipp(IPP_CONTROLLER_ARGS[key], cfg)
    if key == "torch":
        return run_torch(cfg, port())
    raise ValueError(key)


def warm_page_cache(timeout: float) -> str | None:
    """Import everything once in a throw-away interpreter (untimed); a problem, or None."""
    try:
        proc = subprocess.run([sys.executable, "-c", PRELOAD], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:  # subprocess.run has killed it
        return f"warm-up import did not finish within {timeout:g} s"
    if proc.returncode:
        return "warm-up import failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return None


def clip(text: str, lines: int = 25) -> str:
    """At most ``lines`` lines (a failed start quotes every engine's output)."""
    parts = text.rstrip().splitlines()
    more = len(parts) - lines
    return "\n".join(parts[:lines] + ([f"  [... {more} more lines]"] if more > 0 else []))


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = "{:.2f}", scale: float = 1.0) -> str:
    return "n/a" if value is None else spec.format(value * scale)


HEADER = ["case", "start → all ready, median (s)", "min (s)", "rpc_sync to each, median (ms)",
          "stop, median (s)", "nbrpc fork / this"]


def table_rows(keys: list[str], runs: dict[str, list[dict[str, float]]]) -> list[list[str]]:
    fork = median([r["ready_s"] for r in runs.get("fork", []) if "ready_s" in r])
    rows = []
    for key in keys:
        ready = [r["ready_s"] for r in runs[key] if "ready_s" in r]
        rounds = [r["round_s"] for r in runs[key] if "round_s" in r]
        stops = [r["stop_s"] for r in runs[key] if "stop_s" in r]
        ratio = (fmt(fork / median(ready), "{:.2f}x")
                 if fork is not None and ready and key != "fork" else "")
        rows.append([CASES[key], fmt(median(ready)), fmt(min(ready) if ready else None),
                     fmt(median(rounds), "{:.1f}", 1e3) if key not in IPP_CONTROLLER_ARGS
                     else "(in start)", fmt(median(stops)), ratio])
    return rows


def render(rows: list[list[str]], markdown: bool, header: list[str] = HEADER) -> str:
    """The table as text (first column left-aligned, the rest right) or Markdown
    (``bench_compute.py`` uses it too, with its own ``header``)."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    table = [header, *rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join([cells[0].ljust(widths[0])]
                         + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths)]
                     + [line(r) for r in rows])


def details(keys: list[str], runs: dict[str, list[dict[str, float]]], cfg: Config) -> list[str]:
    """Lines under the table: the parts of the ipyparallel cases, nbrpc's phases,
    the ratios and the target."""
    def med(key: str, field: str) -> float | None:
        return median([r[field] for r in runs.get(key, []) if field in r])

    out = []
    for key in keys:
        if key in IPP_CONTROLLER_ARGS and med(key, "ready_s") is not None:
            out.append(f"{SHORT[key]}: start_and_connect_sync {fmt(med(key, 'connect_s'))} s "
                       f"+ apply_sync(import torch) {fmt(med(key, 'import_s'))} s (medians)")
        if key in ("fork", "local", "fork-hb100") and med(key, "ready_s") is not None:
            parts = [f"{label} {fmt(med(key, k), '{:.2f}')}"
                     for k, label, _, _ in PHASES if med(key, k) is not None]
            out.append(f"{SHORT[key]}, start phases (s after the call, medians): "
                       + ", ".join(parts) + f"; start() returned {fmt(med(key, 'ready_s'))}")
            parts = [f"{label} {fmt(med(key, k), '{:.2f}')}"
                     for k, label, _, _ in STOP_PHASES if med(key, k) is not None]
            if med(key, "stop_s") is not None:
                out.append(f"{SHORT[key]}, stop phases (s after the call, medians): "
                           + ", ".join(parts) + f"; stop() returned {fmt(med(key, 'stop_s'))} "
                           "(then: client, driver agent, zygote)")
    for key in keys:
        if med(key, "registration_median") is not None:
            out.append(f"{SHORT[key]}: heart monitor period "
                       f"{fmt(med(key, 'heartbeat_period'), '{:.0f}', 1e3)} ms; an engine's "
                       f"registration took {fmt(med(key, 'registration_median'), '{:.0f}', 1e3)}"
                       f" ms (median; max {fmt(med(key, 'registration_max'), '{:.0f}', 1e3)} ms)")
    fork_runs = runs.get("fork", [])
    fork = med("fork", "ready_s")
    for key in keys:
        if key == "fork" or fork is None or med(key, "ready_s") is None:
            continue
        per_rep = [a["ready_s"] / b["ready_s"] for a, b in zip(fork_runs, runs[key])
                   if "ready_s" in a and "ready_s" in b]
        spread = (f" (per repetition {min(per_rep):.2f}–{max(per_rep):.2f}x)"
                  if len(per_rep) > 1 else "")
        out.append(f"{SHORT['fork']} / {SHORT[key]} = {fork / med(key, 'ready_s'):.2f}x{spread}")
    if "fork" in keys:
        verdict = "n/a" if fork is None else ("met" if fork <= TARGET_S else "NOT met")
        out.append(f"target: nbrpc start {N} <= {TARGET_S:.1f} s: {fmt(fork)} s (median of "
                   f"{SHORT['fork']}) — {verdict}")
    return out


def describe(keys: list[str], repeat: int, cfg: Config, quick: bool) -> list[str]:
    import ipyparallel
    import torch

    return [
        f"start {N} workers to all ready, torch imported on each{' [--quick]' if quick else ''}"
        + ("" if keys == list(DEFAULT_CASES) else f" [--cases {','.join(keys)}]"),
        f"torch {torch.__version__}, ipyparallel {ipyparallel.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}; load "
        f"average at the end {os.getloadavg()[0]:.2f} (other work on the machine skews the "
        "numbers)",
        f"values: median and min over {repeat} repetition(s), the order of the cases reversed "
        "every other repetition; the driver (this process; for torch a fresh helper process "
        "per repetition) had imported what it uses (torch, nbrpc, ipyparallel, "
        "torch.distributed.rpc) before any clock started",
        "start → all ready: nbrpc: Cluster.start(4) call to return (zygote, controller, "
        "engines, agents joined); ipyparallel: start_and_connect_sync() + apply_sync(import "
        "torch) on all engines; torch: starting 4 spawned processes (each: import torch, "
        "init_rpc) to init_rpc(world_size=5) returning in the driver",
        "rpc_sync to each: one rpc_sync(workerN, os.getpid) to each of the 4 workers, in turn, "
        "right after the start returned; stop: cluster.stop() / client.close() + "
        "stop_cluster_sync() / rpc.shutdown() + joining the workers",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="each case once (a smoke test)")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--repeat", type=int, default=None,
                    help="repetitions of every case, alternating the order (default 3, "
                         "1 with --quick)")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                    help=f"comma list of {', '.join(CASES)} (default: "
                         f"{','.join(DEFAULT_CASES)}; fork-hb100 only when named)")
    ap.add_argument("--timeout", type=float, default=90.0,
                    help="seconds each wait may take (start, an engine, a call, stop); "
                         "default 90")
    ap.add_argument("--pause", type=float, default=1.0,
                    help="seconds of rest between cases, for the last one's processes to "
                         "be gone (default 1)")
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.cases.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CASES]
    if unknown or not keys:
        ap.error(f"--cases: unknown {', '.join(unknown) or 'empty list'}; "
                 f"choose from {', '.join(CASES)}")
    keys = list(dict.fromkeys(keys))
    repeat = max(1, args.repeat or (1 if args.quick else 3))
    cfg = Config(timeout=args.timeout)

    # The driver's own imports, before any clock (each case would pay for them once).
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    import ipyparallel  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.rpc  # noqa: F401
    from bench_rpc import free_port  # benchmarks/ is on sys.path

    import nbrpc.cluster  # noqa: F401
    import nbrpc.rpc  # noqa: F401

    issues: list[str] = []
    ports: set[int] = set()

    def port() -> int:
        p = free_port(ports)
        ports.add(p)
        return p

    print("warming the page cache (untimed import in a fresh interpreter) ...",
          file=sys.stderr, flush=True)
    problem = warm_page_cache(max(60.0, cfg.timeout))
    if problem:
        issues.append(problem)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in keys}
    for rep in range(repeat):
        order = keys if rep % 2 == 0 else keys[::-1]
        for i, key in enumerate(order):
            if i or rep:
                time.sleep(args.pause)
            print(f"[{rep + 1}/{repeat}] {CASES[key]} ...", file=sys.stderr, flush=True)
            t = time.perf_counter()
            try:
                rec = run_case(key, cfg, port)
            except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
                rec = {}
                tb = traceback.format_exc(limit=-3) if not isinstance(e, CaseFailed) else ""
                issues.append(clip(f"{CASES[key]}, repetition {rep + 1}: {type(e).__name__}: "
                                   f"{e}" + (f"\n{tb}" if tb else "")))
            runs[key].append(rec)
            ready = rec.get("ready_s")
            print(f"  {'failed' if ready is None else f'all ready in {ready:.2f} s'} "
                  f"({time.perf_counter() - t:.1f} s with the check and the stop)",
                  file=sys.stderr, flush=True)
    bullet = "- " if args.markdown else ""
    print("\n".join(bullet + line for line in describe(keys, repeat, cfg, args.quick)))
    print()
    print(render(table_rows(keys, runs), args.markdown))
    print()
    print("\n".join(bullet + line for line in details(keys, runs, cfg)))
    if issues:
        print("\nproblems:")
        print("\n".join(f"- {p}" for p in issues))
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main())
