"""The real-engine tier: ``nbrpc.Cluster`` with ipyparallel engines forked from
the warm zygote, each hosting an agent, and this process as ``driver``.

Where remote code comes from: the remote targets called from this module are
only callables every engine can import by reference (builtins, ``os``,
``time``, ``torch``). Functions defined here would be pickled by reference
(this module is importable here, not on the engines, which lack tests/ on
sys.path), and registering the module with cloudpickle would only imitate a
notebook. Notebook-style code (functions, lambdas, closures and classes
defined in ``__main__``) is exercised for real in a driver script run as a
subprocess, where it does live in ``__main__``.

One two-worker cluster (``_SHARED``) serves the tests that leave it whole
(status, interrupts, a killed and restarted worker, add/remove); it is
checked before each use and started afresh if a test broke it. Tests that
need their own cluster stop it first: one driver agent per process. The file
runs the shared-cluster tests first, so that it starts once (any order works).
"""

from __future__ import annotations

import html
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import pytest
import torch
from conftest import poll_for, poll_or_fail

from nbrpc import rpc
from nbrpc.cluster import Cluster, ClusterStatus, relay, threads
from nbrpc.errors import NbrpcError, RpcTimeoutError, WorkerGoneError

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]


# -- helpers ------------------------------------------------------------------
def _nbrpc_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("nbrpc")]


def _gone(p: psutil.Process) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone).
    psutil.Process checks the creation time, so a recycled pid is not it."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if not _gone(p)]


def _with_children(procs: list[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and their descendants (the controller forks its heart monitor)."""
    out = list(procs)
    for p in procs:
        try:
            out += [c for c in p.children(recursive=True) if c not in out]
        except psutil.NoSuchProcess:
            pass
    return out


def _cluster_procs(cluster: Cluster) -> list[psutil.Process]:
    """Every process the cluster started: zygote, controller (and what it
    forked), one engine per worker."""
    procs = [psutil.Process(cluster._zygote.pid), cluster._controller_proc]
    procs += [p for w in cluster.workers.values() for p in w.procs]
    assert all(isinstance(p, psutil.Process) for p in procs), procs
    return _with_children(procs)


def _kill_leftovers(procs: list[psutil.Process]) -> None:
    """Clean-up after a failed test: SIGCONT and SIGKILL what is left of the
    processes this test's cluster started (only those, by their handles)."""
    for p in _alive(procs):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass


def _refuses(address: str) -> bool:
    """Nothing listens at ``tcp://host:port`` any more."""
    url = urlparse(address)
    try:
        with socket.create_connection((url.hostname, url.port), timeout=1.0):
            return False
    except OSError:
        return True


def _wait_all_ready(cluster: Cluster, timeout: float = 6.0) -> ClusterStatus:
    """The status once every row is "ready" (a previous test's remote sleep may
    still keep a worker "busy" for a moment); fails after ``timeout``."""
    last: list[ClusterStatus] = []

    def ready() -> bool:
        last[:] = [cluster.status()]
        return all(w.state == "ready" for w in last[0].workers)

    poll_or_fail(ready, timeout, lambda: f"every worker ready; last status:\n{last[0]}")
    return last[0]


class _Shared:
    """The module's two-worker cluster: started on first use, started afresh
    when a test left it in another shape."""

    def __init__(self) -> None:
        self.cluster: Cluster | None = None

    def get(self) -> Cluster:
        c = self.cluster
        if c is not None and not (c.state == "running" and c.names == ["worker1", "worker2"]
                                  and poll_for(lambda: all(w.state == "ready" for w in
                                                           c.status().workers), 6, 0.05)):
            self.stop()
        if self.cluster is None:
            self.cluster = Cluster(progress=False).start(2)
        return self.cluster

    def stop(self) -> None:
        c, self.cluster = self.cluster, None
        if c is not None:
            c.stop()


_SHARED = _Shared()


@pytest.fixture(scope="module", autouse=True)
def _shared_cluster_stops() -> Iterator[None]:
    yield
    _SHARED.stop()
    assert poll_for(lambda: not _nbrpc_threads(), 5), _nbrpc_threads()


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    """conftest's check, except while the shared cluster runs (its agent's
    threads are checked when it stops, at the end of the module)."""
    yield
    if _SHARED.cluster is None:
        assert poll_for(lambda: not _nbrpc_threads(), 5), _nbrpc_threads()


@pytest.fixture
def cluster() -> Cluster:
    """The shared two-worker cluster, every worker ready."""
    c = _SHARED.get()
    _wait_all_ready(c)
    return c


@pytest.fixture
def own_cluster() -> None:
    """For a test that starts its own clusters: the shared one is stopped first."""
    _SHARED.stop()


# -- shared cluster: status ---------------------------------------------------
def test_status_text_is_deterministic_and_html_has_pids(cluster: Cluster) -> None:
    from nbrpc.jupyter.cluster_view import cluster_html

    status = _wait_all_ready(cluster)
    text = str(status)
    assert text == textwrap.dedent("""\
        nbrpc cluster (fork launcher): 2 workers ready
          rank  name     state
          0     driver   ready
          1     worker1  ready
          2     worker2  ready""")
    assert repr(status) == text == str(_wait_all_ready(cluster))
    page = cluster_html(status)
    rows = {w.name: w for w in status.workers}
    assert rows["driver"].pid == os.getpid()
    for name in ("worker1", "worker2"):
        assert rows[name].pid == cluster.workers[name].pid
    for w in status.workers:
        assert w.pid and w.host
        assert f"<td>{html.escape(w.host)}</td><td>{w.pid}</td>" in page


def test_status_counts_owned_bytes_and_messages(cluster: Cluster) -> None:
    before = _wait_all_ready(cluster)
    kept = rpc.remote("worker1", torch.zeros, args=(1000,))  # 4,000 bytes on worker1
    assert kept.to_here(timeout=10).shape == (1000,)
    after = cluster.status()
    w1, w1_before = after["worker1"], before["worker1"]
    assert w1.owned_rrefs == w1_before.owned_rrefs + 1
    assert w1.owned_bytes >= w1_before.owned_bytes + 4000
    assert w1.messages > w1_before.messages and w1.bytes_moved > w1_before.bytes_moved
    assert after["driver"].messages > before["driver"].messages
    del kept
    assert poll_for(lambda: cluster.status()["worker1"].owned_rrefs == w1_before.owned_rrefs, 5)


# -- shared cluster: torch's and BLAS's threads ------------------------------------
def _cpus_each(workers: int) -> int:
    """What ``torch_threads="auto"`` gives each of ``workers`` engines on this host."""
    return max(1, len(os.sched_getaffinity(0)) // workers)


def _blas_at(expected: int, blas: str) -> bool:
    """Whether every BLAS library in ``blas`` (``threads.blas_threads()``) has ``expected`` threads."""
    return bool(blas) and all(part.endswith(f" {expected}") for part in blas.split(", "))


def test_workers_divide_the_hosts_cpus_among_their_torch_and_blas_threads(
        cluster: Cluster) -> None:
    """Two workers on this host: each gets half its CPUs (at least one), on the
    threads that serve calls (a channel's, the pool's) and on the engine's own,
    and in numpy's BLAS library (one pool for the process)."""
    if os.environ.get("OMP_NUM_THREADS"):
        pytest.skip("OMP_NUM_THREADS is set here: the engines keep it")
    each = _cpus_each(2)
    for name in ("worker1", "worker2"):
        assert rpc.rpc_sync(name, torch.get_num_threads) == each, name
        assert rpc.rpc_async(name, torch.get_num_threads).wait() == each, name
        assert cluster.view(name).apply_sync(torch.get_num_threads) == each, name
        # (a lambda travels by value: this module is not importable on the engines)
        omp_env = rpc.rpc_sync(name, lambda: os.environ.get("OMP_NUM_THREADS"))
        assert omp_env == str(each)  # for the processes it starts
        assert cluster.status()[name].torch_threads == each
        blas = rpc.rpc_sync(name, threads.blas_threads)
        assert _blas_at(each, blas), blas
        assert cluster.status()[name].blas_threads == blas
    assert cluster.status()["driver"].torch_threads == torch.get_num_threads()  # untouched


# -- shared cluster: the live view ---------------------------------------------
def _live_views() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nbrpc-live-view"]


def test_the_live_view_marks_a_killed_worker_dead_and_its_button_restarts_it(
        cluster: Cluster) -> None:
    view = cluster.widget()
    try:
        assert view.is_live and len(_live_views()) == 1
        assert view.text() == str(_wait_all_ready(cluster))
        assert poll_for(lambda: view.rates.get("worker1") is not None, 5)  # two refreshes
        pid = view["worker2"].pid
        assert pid == cluster.workers["worker2"].pid
        psutil.Process(pid).send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        poll_or_fail(lambda: view["worker2"].state == "dead", 8,
                     lambda: f"worker2 shown dead; the view shows:\n{view.text()}")
        assert time.monotonic() - t0 < 6
        from nbrpc.jupyter.cluster_view import DEAD_BACKGROUND

        assert f"background:{DEAD_BACKGROUND}" in view.html and "1 ready, 1 dead" in view.title

        view.on_select("restart:worker2")  # the row's button: returns at once
        assert view.action_running or "done: restarting worker2" in view.status
        assert view.wait_action(60), "the restart did not finish"
        assert "done: restarting worker2" in view.status, view.status
        assert view["worker2"].state == "ready" and view["worker2"].pid not in (None, pid)
        assert rpc.rpc_sync("worker2", os.getpid) == view["worker2"].pid
    finally:
        view.close()
    assert not _live_views()


def test_engines_inherit_the_zygotes_frozen_imports(cluster: Cluster) -> None:
    """The zygote freezes its imports before forking: engines' full collections
    skip them (and leave their pages shared); the engine's agent adds no freeze."""

    def freeze_state() -> tuple[int, bool]:  # (nested: sent by value)
        import gc

        from nbrpc.agent import gcfreeze

        return gc.get_freeze_count(), gcfreeze.is_frozen()

    for name in ("worker1", "worker2"):
        frozen, ours = rpc.rpc_sync(name, freeze_state)
        assert frozen > 10_000 and not ours, (name, frozen, ours)


# -- shared cluster: a killed engine ------------------------------------------
def test_killed_engine_is_reported_and_restarted(cluster: Cluster) -> None:
    rref = rpc.remote("worker2", torch.ones, args=(3,))
    assert rref.to_here(timeout=10).tolist() == [1.0, 1.0, 1.0]  # created before the kill
    pid = cluster.status()["worker2"].pid
    assert pid == rpc.rpc_sync("worker2", os.getpid) == cluster.workers["worker2"].pid
    victim = psutil.Process(pid)

    victim.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    error: Exception | None = None
    for _ in range(20):  # bounded: 20 tries of at most 1 s
        try:
            rpc.rpc_sync("worker2", os.getpid, timeout=1)
        except WorkerGoneError as e:
            error = e
            break
        except RpcTimeoutError:  # not noticed yet: the call went to the dead process
            pass
        if time.monotonic() - t0 > 10:
            break
        time.sleep(0.05)
    noticed = time.monotonic() - t0
    assert error is not None, "calls to the killed worker never raised WorkerGoneError"
    assert noticed < 6, f"the killed engine was noticed only after {noticed:.1f} s"
    assert "worker2" in str(error)
    with pytest.raises(NbrpcError, match="worker2"):  # its owner is gone: the value is lost
        rref.to_here(timeout=5)
    assert rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
    status = cluster.status()
    assert {w.name: w.state for w in status.workers} == \
        {"driver": "ready", "worker1": "ready", "worker2": "dead"}, str(status)

    cluster.restart("worker2")
    assert rpc.get_worker_info("worker2").id == 2
    assert cluster.workers["worker2"].rank == 2
    new_pid = rpc.rpc_sync("worker2", os.getpid)
    assert new_pid == cluster.workers["worker2"].pid and new_pid != pid
    assert rpc.rpc_sync("worker2", torch.mul, args=(torch.ones(2), 3)).tolist() == [3.0, 3.0]
    assert str(_wait_all_ready(cluster)).endswith("2     worker2  ready")
    if not os.environ.get("OMP_NUM_THREADS"):  # the new engine gets its share too
        assert rpc.rpc_sync("worker2", torch.get_num_threads) == _cpus_each(2)
        assert _blas_at(_cpus_each(2), rpc.rpc_sync("worker2", threads.blas_threads))


# -- shared cluster: add and remove -------------------------------------------
def test_add_then_remove_a_worker(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    assert cluster.add(1) == ["worker3"]
    assert rpc.get_worker_info("worker3").id == 3  # usable at once
    pid = rpc.rpc_sync("worker3", os.getpid)
    assert pid == cluster.workers["worker3"].pid
    assert rpc.rpc_sync("worker3", torch.add, args=(torch.ones(2), 2)).tolist() == [3.0, 3.0]
    if not os.environ.get("OMP_NUM_THREADS"):  # a third of the CPUs (the others keep theirs)
        assert rpc.rpc_sync("worker3", torch.get_num_threads) == _cpus_each(3)
        assert _blas_at(_cpus_each(3), rpc.rpc_sync("worker3", threads.blas_threads))
        assert rpc.rpc_sync("worker1", torch.get_num_threads) == _cpus_each(2)
    procs = list(cluster.workers["worker3"].procs)
    assert [p.pid for p in procs] == [pid]

    caplog.clear()
    cluster.remove("worker3")
    with pytest.raises(NbrpcError, match="worker3") as info:
        rpc.rpc_sync("worker3", os.getpid, timeout=5)
    assert not isinstance(info.value, RpcTimeoutError), info.value  # told, not timed out
    poll_or_fail(lambda: not _alive(procs), 6, "the removed worker's engine to exit")
    assert cluster.names == ["worker1", "worker2"]
    assert [w.name for w in cluster.status().workers] == ["driver", "worker1", "worker2"]
    assert rpc.rpc_sync("worker2", os.getpid) == cluster.workers["worker2"].pid
    # a removal is no failure: no "the engine of 'worker3' exited" warning in the notebook
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- shared cluster: interrupts -----------------------------------------------
def test_sigint_interrupts_a_waiting_rpc_sync(cluster: Cluster) -> None:
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    main = threading.main_thread().ident
    assert threading.get_ident() == main
    t0 = time.monotonic()
    sent = threading.Event()

    def interrupt() -> None:
        # as Jupyter's interrupt button does: SIGINT to the main thread. Only
        # while the call surely still waits (a late one would hit pytest itself).
        if time.monotonic() - t0 < 2.0:
            sent.set()
            signal.pthread_kill(main, signal.SIGINT)

    timer = threading.Timer(0.3, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            timer.start()
            rpc.rpc_sync("worker1", time.sleep, args=(3,))
        took = time.monotonic() - t0
    finally:
        timer.cancel()
        timer.join(5)
    assert sent.is_set()
    assert took < 2.5, f"KeyboardInterrupt came {took:.1f} s after the call began"
    # the cluster is still usable, the interrupted call's worker too
    assert rpc.rpc_sync("worker1", os.getpid, timeout=5) == cluster.workers["worker1"].pid
    assert rpc.rpc_sync("worker2", torch.add, args=(torch.ones(1), 1), timeout=5).tolist() == [2.0]


def test_a_worker_holding_its_gil_is_busy_not_dead_and_says_how_long(cluster: Cluster) -> None:
    def hold_gil(seconds: int) -> int:  # (by value: a local function)
        import ctypes
        import os

        ctypes.PyDLL(None).sleep(seconds)  # in C, the GIL held: no thread of it runs
        return os.getpid()

    held = rpc.rpc_async("worker2", hold_gil, args=(4,), timeout=30)
    quiet: list = []

    def says_silent() -> bool:
        quiet[:] = [w for w in cluster.status(probe_timeout=0.5).workers if w.name == "worker2"]
        return quiet[0].state == "busy" and "no heartbeat for" in quiet[0].detail

    poll_or_fail(says_silent, 8, lambda: f"worker2 shown busy and silent: {quiet}")
    assert held.wait() == cluster.workers["worker2"].pid
    assert cluster.agent.gone_why(2) is None and cluster.agent.control.readmitted == 0
    _wait_all_ready(cluster)


# -- own clusters (the shared one is stopped): start/stop cycles --------------
# A leak of a thread, a file descriptor, a process or a port shows in one cycle;
# one of 2 MiB a cycle (a cluster's worth of objects) in the RSS bound. Measured
# growth: 0.2-3.8 MiB over 12 cycles, 6.2-6.9 over 20 (allocator noise).
CYCLES = 6
RSS_GROWTH_MIB = 10  # the driver over those cycles


@pytest.mark.timeout(300)
def test_start_stop_cycles_leak_nothing(own_cluster: None,
                                        capsys: pytest.CaptureFixture) -> None:
    me = psutil.Process()
    # children from before (multiprocessing's resource tracker, started by earlier
    # tests that spawn processes, lives as long as this process) are not ours
    earlier = set(me.children(recursive=True))

    def cycle(i: int) -> tuple[list[psutil.Process], str, list[str], str]:
        cluster = Cluster(progress=False).start(1)
        try:
            assert rpc.rpc_sync("worker1", os.getpid) == cluster.workers["worker1"].pid
            procs = _cluster_procs(cluster)
            profile = cluster._profile_dir
            addresses = [m["address"] for m in cluster.agent.snapshot(events=0)["members"]]
            assert len(addresses) == 2 and os.path.isdir(profile), (addresses, profile)
            # the worker's private socket directory (its process is killed at stop)
            socket_dir = os.path.dirname(cluster.agent.members.get(1).local.partition("://")[2])
            assert os.path.isdir(socket_dir), socket_dir
            assert not [a for a in addresses if _refuses(a)], addresses  # the probe sees them
        except BaseException:
            cluster.stop()
            raise
        cluster.stop()
        return procs, profile, addresses, socket_dir

    # The first cluster of a process creates pyzmq's process-wide
    # Context.instance() (ipyparallel's client; 5 fds, kept for the life of the
    # process): the baseline is taken after it.
    procs, profile, addresses, socket_dir = cycle(0)
    base_threads, base_fds = threading.active_count(), me.num_fds()
    base_rss = me.memory_info().rss
    for i in range(CYCLES):
        if i:
            procs, profile, addresses, socket_dir = cycle(i)
        assert not _alive(procs), f"cycle {i}: still running after stop(): {_alive(procs)}"
        assert not os.path.exists(profile), f"cycle {i}: profile dir {profile} left behind"
        assert not os.path.exists(socket_dir), f"cycle {i}: {socket_dir} left behind"
        listening = [a for a in addresses if not _refuses(a)]
        assert not listening, f"cycle {i}: agent ports still open after stop(): {listening}"

    assert poll_for(lambda: threading.active_count() <= base_threads, 5), \
        [t.name for t in threading.enumerate()]
    assert poll_for(lambda: me.num_fds() <= base_fds + 2, 5), (me.num_fds(), base_fds)
    assert set(me.children(recursive=True)) - earlier == set()
    grown = (me.memory_info().rss - base_rss) / 2**20
    with capsys.disabled():  # the figure, in make test's output too
        print(f"\ndriver RSS over {CYCLES} start/stop cycles: {base_rss / 2**20:.0f} MiB, "
              f"then {grown:+.1f} MiB")
    assert grown < RSS_GROWTH_MIB, f"the driver grew {grown:.1f} MiB over {CYCLES} cycles"


# -- own clusters: the view's Stop button, and live refresh ending with the cluster --
def test_the_live_view_stops_with_its_cluster_and_its_stop_button_stops_it(
        own_cluster: None) -> None:
    cluster = Cluster(progress=False).start(1)
    try:
        view = cluster.widget()
        cluster.stop()  # from the notebook: the live refresh ends, the view says so
        poll_or_fail(lambda: not _live_views(), 5, "the live refresh to end")
        assert view.text() == "nbrpc cluster (no workers): stopped"
        assert view.status.startswith("not live")
        view.close()

        cluster.start(1)
        view = cluster.widget()
        assert view.is_live and view.count("ready") == 1
        view.on_control("stop")  # the Stop button
        assert view.wait_action(30) and cluster.state == "stopped"
        assert "done: stopping the cluster" in view.status
        poll_or_fail(lambda: not _live_views(), 5, "the live refresh to end")
        assert view.text() == "nbrpc cluster (no workers): stopped"
        view.close()
    finally:
        cluster.stop()


# -- own clusters: stop() never hangs -----------------------------------------
def test_stop_is_bounded_with_controller_killed_and_engine_frozen(own_cluster: None) -> None:
    earlier = set(psutil.Process().children(recursive=True))  # e.g. a resource tracker
    cluster = Cluster(progress=False).start(2)
    procs = _cluster_procs(cluster)
    try:
        assert rpc.rpc_sync("worker2", os.getpid) == cluster.workers["worker2"].pid
        frozen = cluster.workers["worker2"].procs[0]
        cluster._controller_proc.send_signal(signal.SIGKILL)
        frozen.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        cluster.stop(timeout=4)
        took = time.monotonic() - t0
        assert took < 4 + 5, f"stop(timeout=4) took {took:.1f} s"
        assert cluster.state == "stopped"
        poll_or_fail(lambda: not _alive(procs), 5,
                     lambda: f"the cluster's processes to be gone: {_alive(procs)}")
        assert set(psutil.Process().children(recursive=True)) - earlier == set()
    finally:
        _kill_leftovers(procs)
        cluster.stop()


# -- a driver script in its own process (a real __main__) ---------------------
class _Script:
    """A driver script run as ``python script.py`` (so that its code lives in
    ``__main__``), printing JSON lines; stderr goes to a file, shown on failure."""

    def __init__(self, tmp_path: Path, source: str) -> None:
        path = tmp_path / "driver.py"
        path.write_text(textwrap.dedent(source))
        self.err_path = tmp_path / "driver.stderr"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE,
                                         stderr=err, cwd=tmp_path, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")[-4000:]

    def read_until(self, key: str, timeout: float) -> dict[str, Any]:
        """Every JSON line up to and including the one that has ``key``."""
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while key not in got:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {key!r} from the driver script within {timeout} s; so far "
                            f"{got}; its stderr:\n{self.stderr()}", pytrace=False)
            if line is None:
                pytest.fail(f"the driver script ended (code {self.proc.wait(5)}) before "
                            f"{key!r}; so far {got}; its stderr:\n{self.stderr()}",
                            pytrace=False)
            got.update(json.loads(line))
        return got

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.reader.join(5)
        if self.proc.stdout:
            self.proc.stdout.close()


DRIVER_THEN_SLEEP = """
    import json, os, time
    from nbrpc.cluster import Cluster

    cluster = Cluster(progress=False).start(2)
    print(json.dumps({"pids": {
        "zygote": cluster._zygote.pid,
        "controller": cluster._controller_proc.pid,
        "engines": [w.pid for w in cluster.workers.values()],
        "launched": [p.pid for w in cluster.workers.values() for p in w.procs],
    }}), flush=True)
    time.sleep(120)
"""


def test_a_controller_whose_socket_paths_would_not_fit_listens_on_loopback(
        own_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local cluster's controller listens on Unix sockets in its profile
    (test_security_handshake); where ``<profile>/c:<port>`` is too long for
    a socket's path, on loopback TCP instead, and the cluster works."""
    import tempfile

    deep = tmp_path / ("d" * max(1, 100 - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))  # where the profile is made
    with Cluster(progress=False).start(1) as cluster:
        assert cluster._profile_dir.startswith(str(deep))
        with open(next(Path(cluster._profile_dir, "security").glob("*engine.json"))) as f:
            assert json.load(f)["interface"] == "tcp://127.0.0.1"
        assert rpc.rpc_sync("worker1", max, args=(1, 2)) == 2


def test_device_maps_reach_each_worker_and_a_misfit_is_refused(own_cluster: None) -> None:
    """``Cluster(device_maps=...)``: each engine publishes its own maps (on this
    machine, with no GPU, maps between CPUs), the group is checked as
    ``init_rpc`` checks it, and a map to a device a worker lacks stops the
    start with PyTorch's words. ``gpus=True`` needs a GPU on a local cluster's
    host and says so at once."""
    from nbrpc.cluster.ipp import ClusterError

    maps = {"driver": {"worker1": {"cpu": "cpu"}}, "worker1": {"driver": {"cpu": "cpu"}}}
    with Cluster(progress=False, device_maps=maps).start(2) as cluster:
        driver = cluster.agent
        assert driver.members.get(1).devices.map_to("driver") == {"cpu": "cpu"}
        assert driver.members.get(2).devices.maps == ()  # no maps of its own
        assert driver.device_map_to(1, reply=False) == {"cpu": "cpu"}
        assert driver.device_map_to(1, reply=True) == {"cpu": "cpu"}  # worker1's, inverted
        assert driver.device_map_to(2, reply=False) is None
        assert rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
        assert [w.device for w in cluster.status().workers] == ["", "", ""]
    with pytest.raises(ClusterError, match="Node worker1 has target devices with invalid"):
        Cluster(progress=False, device_maps={"worker1": {"driver": {"cpu": "cuda:0"}}}).start(1)
    if not torch.cuda.device_count():
        with pytest.raises(ClusterError, match="this host has none"):
            Cluster(progress=False, gpus=True).start(1)


def test_a_relayed_engine_holding_its_gil_stays_registered(own_cluster: None) -> None:
    """Engines elsewhere reach the controller through their relay (here
    ``launcher="local"`` with ``controller_ip``, which relays as remote
    engines do). The relay runs in a process of its own, so an engine busy in
    C with its GIL held for longer than the controller's heartbeat allowance
    (4 periods of 0.5 s) still answers its heartbeats, and stays registered."""
    def hold_gil(seconds: int) -> int:  # (by value: a local function)
        import ctypes
        import os

        ctypes.PyDLL(None).sleep(seconds)
        return os.getpid()

    with Cluster(progress=False, launcher="local", controller_ip="127.0.0.1").start(1) as c:
        assert c._relay is not None
        pid = c.workers["worker1"].pid
        assert rpc.rpc_sync("worker1", hold_gil, args=(5,), timeout=30) == pid
        assert c.view("worker1").apply_sync(os.getpid) == pid  # still registered
        assert c.status().workers[1].state == "ready"
        # a connection without the key: the relay refuses it, and the status says so
        assert c.relay_refusals() is None and c.status().workers[0].detail == ""
        host, port = relay.parse_address(c._relay)
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(relay.hello(relay.relay_token(b"not this cluster's"), 1))
            s.settimeout(5)
            assert s.recv(1) == b""  # closed by the relay
        assert poll_for(lambda: c.status().workers[0].detail.startswith(
            "the controller's relay refused 1 connection (the last from 127.0.0.1:"), 5)
        assert c.relay_refusals().endswith("not the cluster's key)")


def test_ipyparallels_curve_passes_through_the_relay(own_cluster: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With ipyparallel's CurveZMQ on (``IPP_ENABLE_CURVE=1``, which turns its
    message signing off), relayed engines prove the controller's CURVE key to
    the relay instead of the session key, and CURVE runs end to end."""
    monkeypatch.setenv("IPP_ENABLE_CURVE", "1")
    with Cluster(progress=False, launcher="local", controller_ip="127.0.0.1").start(1) as c:
        sec = Path(c._profile_dir, "security")
        info = json.loads(next(sec.glob("*engine.json")).read_text())
        assert info["key"] == "" and info["curve_serverkey"], info.keys()
        assert c._relay is not None
        assert c.view("worker1").apply_sync(os.getpid) == c.workers["worker1"].pid
        assert rpc.rpc_sync("worker1", max, args=(1, 2)) == 2


def test_hard_killed_driver_leaves_no_orphans(tmp_path: Path) -> None:
    script = _Script(tmp_path, DRIVER_THEN_SLEEP)
    procs: list[psutil.Process] = []
    try:
        pids = script.read_until("pids", 60)["pids"]
        assert len(pids["engines"]) == 2 and sorted(pids["engines"]) == sorted(pids["launched"])
        procs = _with_children([psutil.Process(pid) for pid in  # alive now: a handle
                                {pids["zygote"], pids["controller"], *pids["engines"]}])
        assert not [p for p in procs if _gone(p)]  # pins its identity (create time)

        script.proc.send_signal(signal.SIGKILL)
        script.proc.wait(10)
        poll_or_fail(lambda: not _alive(procs), 10,
                     lambda: f"the dead driver's processes to exit: {_alive(procs)}")
    finally:
        script.kill()
        _kill_leftovers(procs)


NOTEBOOK_CODE = """
    import json, os, sys
    import torch
    from nbrpc import rpc
    from nbrpc.cluster import Cluster

    def emit(**kw):
        print(json.dumps(kw), flush=True)

    def square(x):
        return x * x

    cube = lambda x: x ** 3  # noqa: E731
    scale = 2
    scaled = lambda x: x * scale  # noqa: E731

    def make_adder(k):
        def add(x):
            return x + k
        return add

    class Counter:
        def __init__(self, start):
            self.n = start

        def incr(self, by=1):
            self.n += by
            return self.n

        def where(self):
            return os.environ["NBRPC_WORKER"]

    class Point:
        def __init__(self, x):
            self.x = x

        def describe(self):
            return f"v1:{self.x}"

    def describe(p):
        return p.describe()

    def remember_type(obj):
        # on a worker: keep type(obj) in a module-level set of the engine's __main__
        seen = sys.modules["__main__"].__dict__.setdefault("_seen_types", set())
        seen.add(type(obj))
        return len(seen)

    def relay(dest, fn, *args):
        # on a worker: fn and args came here as arguments; pass them on
        return rpc.rpc_sync(dest, fn, args=args)

    def bump(counter, by):
        return counter.rpc_sync().incr(by)

    with Cluster(progress=False).start(2) as cluster:
        emit(function=rpc.rpc_sync("worker1", square, args=(7,)))
        emit(torch_result=rpc.rpc_sync("worker2", square, args=(torch.full((2,), 3.0),)).tolist())
        emit(lam=rpc.rpc_sync("worker2", cube, args=(3,)))
        emit(closure=rpc.rpc_sync("worker1", make_adder(10), args=(5,)))
        emit(global_before=rpc.rpc_sync("worker1", scaled, args=(5,)))
        scale = 3
        emit(global_after=rpc.rpc_sync("worker1", scaled, args=(5,)))
        p = rpc.rpc_sync("worker1", Point, args=(4,))  # a class as the target
        emit(class_target=[type(p) is Point, p.x])
        counter = rpc.remote("worker2", Counter, args=(5,))
        emit(remote_incr=counter.rpc_sync().incr(2), remote_where=counter.rpc_sync().where(),
             remote_owner=counter.owner_name())
        emit(rref_arg=rpc.rpc_sync("worker1", bump, args=(counter, 10)))
        emit(fn_arg=rpc.rpc_sync("worker1", relay, args=("worker2", cube, 4)))
        emit(one_class=[rpc.rpc_sync("worker2", remember_type, args=(Point(i),))
                        for i in range(5)]
             + [rpc.rpc_sync("worker1", relay, args=("worker2", remember_type, Point(9)))])
        emit(method_v1=rpc.rpc_sync("worker2", describe, args=(Point(1),)))

        def square(x):  # a cell run again with a new body
            return x + 1000

        class Point:
            def __init__(self, x):
                self.x = x

            def describe(self):
                return f"v2:{self.x}"

        emit(redefined=rpc.rpc_sync("worker1", square, args=(7,)),
             method_v2=rpc.rpc_sync("worker2", describe, args=(Point(1),)))

        class Affine(torch.nn.Module):  # a module class defined in a cell
            def __init__(self, n):
                super().__init__()
                self.w = torch.nn.Parameter(torch.full((n,), 2.0))

            def forward(self, x):
                return x * self.w + 1

        from nbrpc.nn import RemoteModule

        module = RemoteModule("worker2/cpu", Affine, args=(3,))
        emit(remote_module=module(torch.ones(3)).tolist(),
             remote_module_owner=module.module_rref.owner_name())
        emit(done=True)
"""


def test_notebook_defined_code_runs_remotely(tmp_path: Path) -> None:
    script = _Script(tmp_path, NOTEBOOK_CODE)
    try:
        got = script.read_until("done", 90)
        assert script.proc.wait(30) == 0, script.stderr()
    finally:
        script.kill()
    assert got == {
        "function": 49,
        "torch_result": [9.0, 9.0],
        "lam": 27,
        "closure": 15,
        "global_before": 10,
        "global_after": 15,  # globals travel with the function, as they are at the call
        "class_target": [True, 4],  # the instance comes back as the driver's own class
        "remote_incr": 7, "remote_where": "worker2", "remote_owner": "worker2",
        "rref_arg": 17,
        "fn_arg": 64,
        "one_class": [1, 1, 1, 1, 1, 1],  # sent six times, from two senders: one class
        "method_v1": "v1:1",
        "redefined": 1007,
        "method_v2": "v2:1",
        "remote_module": [3.0, 3.0, 3.0], "remote_module_owner": "worker2",
        "done": True,
    }, script.stderr()


def test_an_engine_agent_exits_once_its_driver_is_gone() -> None:
    """engine.start_agent's member-gone hook, alone (no zygote leash, no pdeathsig):
    a process hosting a worker agent ends once the driver stops answering."""
    from nbrpc.agent import Agent, AgentOptions
    from nbrpc.transport import new_key

    key = new_key()
    driver = Agent("driver", 0, key, world_size=None, options=AgentOptions(num_worker_threads=2))
    driver.start(None, 10)
    code = ("import sys, time\nfrom nbrpc.cluster import engine\n"
            f"engine.start_agent({{'worker1': 1}}, 'worker1', {driver.address!r}, {key!r}, {{}})\n"
            "time.sleep(60)\nsys.exit(5)  # only if the driver's absence went unnoticed\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        poll_or_fail(lambda: driver.is_member(1), 30, "worker1 to join the driver")
        driver.shutdown(graceful=False)  # silent from now on: no Leave is sent
        assert proc.wait(15) == 0
        assert "the driver died" in proc.stderr.read()
    finally:
        driver.shutdown(graceful=False)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stderr.close()


# An engine that registers, but whose heart never beats: ipyparallel's hub
# accepts the registration and waits for a heartbeat that never comes.
HEARTLESS_ENGINE = ("from ipyparallel.engine import app; app.Heart.start = lambda self: None; "
                    "app.IPEngine.launch_instance()")


def test_an_engine_the_controller_never_hears_beat_fails_the_start_with_its_log(
        own_cluster: None) -> None:
    """The start waits ``timeout`` for the engine, then fails naming it, with
    the engine's output and what the controller logged about its registration
    (accepted; purged after 30 s if it never beats)."""
    from nbrpc.cluster.ipp import ClusterError

    cluster = Cluster(progress=False, launcher="local", timeout=8,
                      launcher_options={"engine_cmd": [sys.executable, "-c", HEARTLESS_ENGINE]})
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as info:
        cluster.start(1)
    took = time.monotonic() - t0
    try:
        text = str(info.value)
        assert "['worker1'] not ready within 8 s" in text, text
        assert "Completed registration with id 1" in text, text  # the engine's side
        assert "--- the controller, on registrations ---" in text, text
        assert "registration::accepting registration 1:" in text, text  # the hub's side
        assert "finished registering" not in text, text
        assert took < 30, took
    finally:
        cluster.stop()
