"""``nbrpc.Cluster``: ipyparallel engines that each host an nbrpc agent, with the
calling process (a notebook kernel, a script) joined as ``driver`` (rank 0).

Start-up, in order (each wait bounded and interruptible)::

    driver agent (rank 0, dynamic group) ─┐
    ipyparallel controller (guarded) ─────┼─ concurrently
    warm zygote: imports torch once ──────┘
    one engine set per rank: worker1..workerN (--IPEngine.id=rank, $NBRPC_WORKER)
    as each engine registers: client[id].apply(start_agent, key, driver address)
    ready when every worker is a member of the driver's group

One engine set per rank lets :meth:`Cluster.restart` replace one worker under
the same name and rank. Engines that die are noticed twice: by their launcher
(process exit) and by the agents' heartbeats; calls to them fail with
:class:`~nbrpc.errors.WorkerGoneError` naming the worker.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import views
from ..agent import Agent, AgentOptions, set_default_agent
from ..agent.agent import _Default
from ..errors import AlreadyInitializedError, NbrpcError
from ..transport import local, new_key
from . import engine as engine_side
from . import gpus as gpus_
from . import guard, jobs, relay
from . import threads as threads_
from .ipp import ClusterError, LoopThread, host_for_rank, kill_family, routable_ip
from .progress import Progress, make_progress
from .status import ClusterStatus, WorkerStatus, fill_row

log = logging.getLogger(__name__)

_LOCAL_LAUNCHERS = ("fork", "local")
STOP_AGENT_TIMEOUT = 5.0  # seconds for an engine to stop its agent (mpi: see _take_down)
STATUS_QUEUE_PERIOD = 2.0  # seconds between squeue runs for status() (a live view: 2 Hz)
UNIX_PATH_MAX = 108  # bytes in a Unix socket's path, with its terminating NUL (Linux)
# the largest frame the ipyparallel controller accepts (see guard.cap_zmq_messages)
CONTROLLER_MAX_MESSAGE = 64 << 20


@dataclass
class _Worker:
    name: str
    rank: int
    engine_set: str = ""
    engine_id: int | None = None
    engine_ident: Any = None  # the engine's registration identity (ids can be reused)
    pid: int | None = None
    host: str | None = None
    procs: list[Any] = field(default_factory=list)  # psutil.Process of each engine launched
    agent_call: Any = None  # ipyparallel AsyncResult of start_agent
    exited: bool = False
    job: jobs.Job | None = None  # its batch job (slurm, pbs, ... launchers)
    place: str | None = None  # the host a restart puts it back on (mpi launcher)
    cpu_share: threads_.CpuShare | None = None  # what its engine may run on (start_agent)


class Cluster:
    """A driver (this process, rank 0) and ipyparallel engines ``worker1``.. each
    hosting an nbrpc agent; the RPC API works from the next line.

    ``launcher``: ``"fork"`` (default, on Linux: engines forked from a warm
    process that has imported torch), ``"local"`` (ipyparallel's plain local processes), or
    any ipyparallel engine launcher (``"mpi"``, ``"ssh"``, ``"slurm"``, ``"pbs"``,
    ... or a class), configured with ``launcher_options`` (its traits, e.g.
    ``{"engines": {"host1": 2}}`` for ssh). ``host`` is the interface the
    driver's agent listens on (loopback for local launchers, else the address
    that routes to the engines); ``controller_ip`` the interface of the
    controller's relay, for engines on other hosts (by default ``host``;
    none with local launchers). The controller itself listens on Unix
    sockets in the private profile, which other users cannot reach.
    ``failure_timeout``: seconds a worker may stay silent with its connection
    up (busy in C code holding the GIL, stopped) before it is declared dead;
    by default (None) each agent's own: never on Linux, where a worker whose
    process exits is noticed within about a second and one whose host
    vanishes within about three, regardless. ``encrypt``: CURVE-encrypt the workers'
    connections (for engines on networks you do not trust).
    ``device_maps``: each worker's device maps to the others (``{"driver":
    {"worker1": {"cuda:0": "cuda:0"}}, ...}``, as ``TensorPipeRpcBackendOptions``
    takes them); ``gpus=True`` gives each worker one of its host's GPUs, round
    robin, and maps every pair of members device to device (the driver on
    cuda:0, or the CPU): see :mod:`nbrpc.cluster.gpus`.
    ``torch_threads``: torch's intra-op threads in each worker, and its BLAS
    libraries' (numpy's) (``"auto"``: the CPUs a worker may run on, divided
    among the workers that share them, as ``torchrun`` keeps several processes
    on a host from each using every CPU; an int: that many; None: the
    libraries' default, one per CPU): see :mod:`nbrpc.cluster.threads`.
    ``controller_max_message``: the largest ZeroMQ frame (bytes) ipyparallel's
    controller accepts (64 MiB): a peer that reaches its ports makes it hold
    no more than that per connection (ipyparallel has no handshake of its
    own). nbrpc's traffic through it is small; raise it only to send larger
    values through ipyparallel itself (``cluster.view(name).push``).

    >>> import torch
    >>> from nbrpc import rpc
    >>> with Cluster(progress=False).start(2) as cluster:
    ...     print(rpc.rpc_sync("worker2", torch.add, args=(torch.ones(2), 1)))
    ...     print(cluster.status())
    tensor([2., 2.])
    nbrpc cluster (fork launcher): 2 workers ready
      rank  name     state
      0     driver   ready
      1     worker1  ready
      2     worker2  ready
    """

    def __init__(
        self,
        *,
        launcher: str | type = "fork",
        launcher_options: dict[str, Any] | None = None,
        threads: int = 16,
        timeout: float = 60.0,
        rpc_timeout: float = 60.0,
        host: str | None = None,
        controller_ip: str | None = None,
        heartbeat: float = 0.5,
        failure_timeout: float | None = None,
        encrypt: bool = False,
        profile_dir: str | None = None,
        progress: bool | None = None,
        controller_max_message: int = CONTROLLER_MAX_MESSAGE,
        device_maps: Mapping[str, Mapping[str, Mapping]] | None = None,
        gpus: bool = False,
        torch_threads: int | str | None = "auto",
    ) -> None:
        if int(threads) < 1:
            raise ValueError(f"threads must be >= 1 (worker threads per agent), got {threads}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if launcher == "fork" and not sys.platform.startswith("linux"):
            # forking a process that has imported torch is safe on Linux only
            log.info("nbrpc cluster: no fork launcher on %s; using 'local'", sys.platform)
            launcher = "local"
        self.launcher = launcher
        self.launcher_options = dict(launcher_options or {})
        self.threads = int(threads)
        self.timeout = float(timeout)
        self.rpc_timeout = float(rpc_timeout)
        self.heartbeat = float(heartbeat)
        self.failure_timeout = None if failure_timeout is None else float(failure_timeout)
        self.encrypt = bool(encrypt)
        if (not isinstance(controller_max_message, int) or isinstance(controller_max_message, bool)
                or controller_max_message < 1 << 20):
            raise ValueError(f"controller_max_message must be an int of at least 1 MiB (bytes), "
                             f"got {controller_max_message!r}")
        self.controller_max_message = controller_max_message
        if self.failure_timeout is not None and not self.failure_timeout >= 2 * self.heartbeat:
            raise ValueError(f"failure_timeout must be >= twice heartbeat ({2 * self.heartbeat:g}"
                             f" s), got {failure_timeout!r}")
        self.controller_ip = controller_ip
        self.device_maps = gpus_.parse_maps(device_maps)  # {name: its maps, as published}
        self.gpus = bool(gpus)
        self.torch_threads = threads_.check_setting(torch_threads)
        self.host = host or ("127.0.0.1" if self._local else routable_ip())
        self.progress = progress
        self._profile_dir = profile_dir
        self._own_profile = False
        self._relay: str | None = None  # HOST:PORT of the controller's relay, if any
        self._relay_report: str | None = None  # where the relay reports its refusals
        self.workers: dict[str, _Worker] = {}
        self.agent: Agent | None = None
        self.client: Any = None
        self.state = "stopped"
        self._ipp: Any = None
        self._loop: LoopThread | None = None
        self._zygote: Any = None
        self._controller_proc: Any = None
        self._used: set[Any] = set()  # identities of every engine ever given a worker
        self._lock = threading.RLock()
        self._jobs_asked = 0.0  # when squeue was last run (monotonic)
        self.start_seconds: float | None = None

    # -- properties ------------------------------------------------------------
    @property
    def _local(self) -> bool:
        return isinstance(self.launcher, str) and self.launcher in _LOCAL_LAUNCHERS

    @property
    def _mpi(self) -> bool:
        """Workers started together by one ``mpiexec -n N`` (see :meth:`_launch_mpi`)."""
        if isinstance(self.launcher, str):
            return self.launcher.lower() in ("mpi", "mpiexec")
        from ipyparallel.cluster.launcher import MPIEngineSetLauncher

        return isinstance(self.launcher, type) and issubclass(self.launcher, MPIEngineSetLauncher)

    @property
    def _queued(self) -> bool:
        """Workers are batch jobs (slurm, pbs, ...): they may wait in a queue."""
        from ipyparallel.cluster.launcher import BatchSystemLauncher, find_launcher_class

        launcher = self.launcher
        if isinstance(launcher, str):
            if self._local:
                return False
            try:
                launcher = find_launcher_class(launcher, "engine")
            except Exception:  # noqa: BLE001 - an unknown name fails later, saying so
                return False
        return isinstance(launcher, type) and issubclass(launcher, BatchSystemLauncher)

    @property
    def launcher_name(self) -> str:
        return self.launcher if isinstance(self.launcher, str) else self.launcher.__name__

    @property
    def names(self) -> list[str]:
        """Worker names by rank (the driver excluded)."""
        return [w.name for w in sorted(self.workers.values(), key=lambda w: w.rank)]

    # -- lifecycle -------------------------------------------------------------
    def start(self, n: int) -> Cluster:
        """Start ``n`` engines with agents ``worker1..workerN`` and join as ``driver``.

        Returns once every agent is ready (or raises, having stopped what it
        started). Ctrl-C / the notebook's interrupt stops the start cleanly.
        """
        n = _check_count(n, "start")
        with self._lock:
            if self.state != "stopped":
                raise ClusterError(f"the cluster is already {self.state}; use add({n}) to grow "
                                   "it, or stop() it first")
            if _Default.agent is not None:
                raise AlreadyInitializedError(_Default.agent.name)
            if self.gpus and self._local and not gpus_.count_here():  # (before anything starts)
                raise ClusterError("gpus=True (--gpus) gives each worker a GPU, but this host "
                                   "has none (torch.cuda.device_count() is 0): start without "
                                   "it; tensors then stay on the CPU")
            t0 = time.perf_counter()
            self.state = "starting"
            progress = make_progress(n, self.progress, "starting nbrpc workers",
                                     cluster=self if self._queued else None)
            try:
                self._start_infrastructure(progress)
                self._launch([(f"worker{r}", r) for r in range(1, n + 1)])
                self._wait_ready(self.names, progress)
            except BaseException:
                progress.close("start failed")
                self.stop()  # tears down what exists
                raise
            self.state = "running"
            _stop_at_exit(self)
            self.start_seconds = time.perf_counter() - t0
            progress.close(f"{n} workers ready in {self.start_seconds:.1f} s")
            return self

    def _failure_option(self) -> dict[str, float]:
        """The agents' ``failure_timeout``, where the user set one (else each
        agent keeps its own platform's default)."""
        return {} if self.failure_timeout is None else {"failure_timeout": self.failure_timeout}

    def _start_infrastructure(self, progress: Progress) -> None:
        import ipyparallel as ipp

        from .launcher import ZYGOTES, GuardedControllerLauncher

        key = new_key()
        devices = self._device_options("driver")
        opts = AgentOptions(num_worker_threads=self.threads, rpc_timeout=self.rpc_timeout,
                            host=self.host, port=0, heartbeat_interval=self.heartbeat,
                            encrypt=self.encrypt, **self._failure_option(),
                            devices=gpus_.config(0, devices["device_maps"], self.gpus,
                                                 gpus_.count_here()) if devices else None)
        self.agent = Agent("driver", 0, key, world_size=None, options=opts)
        self.agent.start(None, self.timeout)
        set_default_agent(self.agent)
        self._key = key
        if self._profile_dir is None:
            self._profile_dir = tempfile.mkdtemp(prefix="nbrpc-cluster-")
            self._own_profile = True
        self._loop = LoopThread()
        engines: Any = self.launcher
        if self.launcher == "fork":
            from .launcher import ForkEngineSetLauncher
            from .zygote import Zygote

            self._zygote = Zygote()
            self._zygote.start()
            engines = ForkEngineSetLauncher
        elif self.launcher == "local":
            engines = "local"
        period_ms = max(100, int(self.heartbeat * 1000))
        controller_args = [f"--HeartMonitor.period={period_ms}",
                           "--HeartMonitor.max_heartmonitor_misses=4",
                           "--IPController.use_threads=True"]
        # The controller listens on Unix sockets in the private (0700)
        # profile, which no other user can reach; engines on other hosts
        # reach them through the relay (relay.py), whose one TCP port lets
        # only key holders through. (Where the sockets' paths,
        # ``<profile>/c:<port>``, do not fit a socket address, or the profile
        # is the user's own, it listens on TCP, with its frames capped.)
        sockets = os.path.join(self._profile_dir, "c")
        ipc = (self._own_profile
               and len(os.fsencode(sockets)) + len(":65535") < UNIX_PATH_MAX)
        same_host = self.launcher == "fork" or (self._local and not self.controller_ip)
        if ipc:
            controller_args += ["--IPController.transport=ipc", f"--IPController.ip={sockets}"]
        kwargs: dict[str, Any] = dict(
            engines=engines, profile_dir=self._profile_dir, delay=0, log=log,
            controller_args=controller_args, engine_timeout=int(self.timeout))
        kwargs["controller"] = GuardedControllerLauncher  # the controller always runs here
        controller_ip = self.controller_ip or (None if self._local else self.host)
        if controller_ip and not ipc:  # remote engines must reach it: not loopback
            kwargs["controller_ip"] = controller_ip
        self._ipp = ipp.Cluster(**kwargs)
        if self._zygote is not None:
            ZYGOTES[self._ipp.cluster_id] = self._zygote
        # a killed driver cannot remove its private profile: the guarded controller does
        env = {guard.MAX_MESSAGE_ENV: str(self.controller_max_message)}
        if self._own_profile:
            env[guard.CLEANUP_ENV] = self._profile_dir
        relay_file = None
        if ipc:
            env[guard.IPC_ENV] = "1"
            if not same_host:
                relay_file = os.path.join(self._profile_dir, "security", "nbrpc-relay")
                bind = controller_ip if controller_ip not in (None, "*") else "0.0.0.0"
                env.update({guard.RELAY_ENV: bind, guard.RELAY_SOCKETS_ENV: sockets,
                            guard.RELAY_FILE_ENV: relay_file,
                            guard.RELAY_KEY_ENV: os.path.join(
                                self._profile_dir, "security",
                                f"ipcontroller-{self._ipp.cluster_id}-engine.json")})
        self._loop.run(self._ipp.start_controller, timeout=self.timeout, environment=env)
        self._controller_proc = getattr(self._ipp.controller, "process", None)
        self._relay = None
        self._relay_report = None if relay_file is None else relay_file + relay.REPORT_SUFFIX
        if relay_file is not None:
            _, port = relay.parse_address(_wait_for_file(relay_file, self.timeout))
            where = controller_ip if controller_ip not in (None, "*", "0.0.0.0") else self.host
            self._relay = f"[{where}]:{port}" if ":" in where else f"{where}:{port}"
        progress.update(0, "controller started")
        if self._zygote is not None:
            self._zygote.wait_ready(self.timeout)
            progress.update(0, "engine zygote warm (torch imported)")

    def _engine_kwargs(self, w: _Worker) -> dict[str, Any]:
        kwargs = {k: v for k, v in self.launcher_options.items()}
        env = dict(kwargs.pop("environment", {}))
        env.update({engine_side.WORKER_ENV: w.name, "OMP_WAIT_POLICY": "PASSIVE"})
        if self._relay is not None:  # the engine reaches the controller through it
            env[relay.RELAY_ENV] = self._relay
            if not self._mpi:  # (nbrpc's MPI wrapper starts the relay itself)
                kwargs["engine_cmd"] = relay.relayed_engine_cmd(
                    kwargs.get("engine_cmd") or self._default_engine_cmd())
        args = list(kwargs.pop("engine_args", []))
        args += [f"--IPEngine.id={w.rank}", "--IPEngine.enable_nanny=False",
                 "--IPEngine.max_heartbeat_misses=10"]
        kwargs.update(environment=env, engine_args=args)
        engines = kwargs.get("engines")
        if isinstance(engines, dict) and engines:  # ssh: this worker's host only
            kwargs["engines"] = host_for_rank(engines, w.rank)
        if self._local:
            kwargs.setdefault("stop_seconds_until_kill", 2)
            kwargs.setdefault("stop_timeout", 5)
        return kwargs

    def _default_engine_cmd(self) -> list[str]:
        """The launcher's own ``engine_cmd`` for its options (the SSH
        launcher's runs ``remote_python`` on the remote hosts, for example)."""
        from ipyparallel.cluster.launcher import find_launcher_class

        default = [sys.executable, "-m", "ipyparallel.engine"]
        try:
            cls = (find_launcher_class(self.launcher, "engine")
                   if isinstance(self.launcher, str) else self.launcher)
            traits = cls.class_trait_names()
            launcher = cls(**{k: v for k, v in self.launcher_options.items()
                              if k in traits and k != "engine_cmd"})
            return list(launcher.engine_cmd) or default
        except Exception:  # noqa: BLE001 - any launcher ipyparallel may make
            return default

    def _launch(self, ranks: list[tuple[str, int]]) -> None:
        assert self._loop is not None
        if self._mpi:
            self._launch_mpi(ranks)
            return
        for name, rank in ranks:
            w = self.workers.get(name) or _Worker(name, rank)
            self.workers[name] = w
            w.engine_set, w.engine_id, w.agent_call, w.exited = name, None, None, False
            w.engine_ident = None
            self._loop.run(self._ipp.start_engines, 1, name, timeout=self.timeout,
                           **self._engine_kwargs(w))
            es = self._ipp.engines[name]
            w.job = jobs.job_of(es)
            es.on_stop(lambda data, w=w, es=es: self._engine_set_stopped(w, es, data))
            for launcher in getattr(es, "launchers", {}).values():
                if getattr(launcher, "process", None) is not None:
                    w.procs.append(launcher.process)

    def _launch_mpi(self, ranks: list[tuple[str, int]]) -> None:
        """One ``mpiexec -n N`` for all of ``ranks``, so that MPI spreads them over
        its hosts as it spreads any job's ranks. Every process runs
        :mod:`~nbrpc.cluster.mpi_engine`, which picks its worker by its MPI rank
        and registers under the worker's rank as engine id. A single worker
        restarted goes back on its host (``-host``)."""
        from . import mpi_engine  # (not at import: ``-m nbrpc.cluster.mpi_engine`` runs it)

        assert self._loop is not None
        group = []
        for name, rank in ranks:
            w = self.workers.get(name) or _Worker(name, rank)
            self.workers[name] = w
            w.engine_id, w.agent_call, w.exited, w.engine_ident = None, None, False, None
            group.append(w)
        set_id = f"mpi-{group[0].name}" + (f"-{group[-1].name}" if len(group) > 1 else "")
        while set_id in self._ipp.engines:  # a worker restarted more than once
            set_id += "+"
        kwargs = self._engine_kwargs(group[0])
        kwargs["environment"].pop(engine_side.WORKER_ENV)  # each process finds its own
        kwargs["engine_args"] = [a for a in kwargs["engine_args"]
                                 if not a.startswith("--IPEngine.id=")]
        cmd = list(kwargs.get("engine_cmd") or [sys.executable, "-m", "ipyparallel.engine"])
        if cmd[-2:] != ["-m", "ipyparallel.engine"]:
            raise ClusterError(f"with launcher='mpi', engine_cmd must end in '-m "
                               f"ipyparallel.engine' (nbrpc runs its MPI wrapper in its "
                               f"place), got {cmd}")
        workers = ",".join(f"{w.name}={w.rank}" for w in group)
        kwargs["engine_cmd"] = cmd[:-2] + ["-m", "nbrpc.cluster.mpi_engine",
                                           "--workers", workers]
        mpi_args = list(kwargs.get("mpi_args", []))
        if len(group) == 1 and group[0].place:
            mpi_args += ["-host", group[0].place]
        # ranks on other hosts get the engine's environment only if mpiexec is told
        names = {*kwargs["environment"], *mpi_engine.IPP_VARIABLES}
        mpiexec = (kwargs.get("mpi_cmd") or ["mpiexec"])[0]
        kwargs["mpi_args"] = (mpi_engine.forwarded(names, mpiexec)
                              + mpi_engine.survive_args(mpiexec) + mpi_args)
        self._loop.run(self._ipp.start_engines, len(group), set_id, timeout=self.timeout,
                       **kwargs)
        es = self._ipp.engines[set_id]
        for w in group:
            w.engine_set, w.job = set_id, None
            es.on_stop(lambda data, w=w, es=es: self._engine_set_stopped(w, es, data))
            if getattr(es, "process", None) is not None:
                w.procs.append(es.process)  # mpiexec: shared by the group

    def _engine_set_stopped(self, w: _Worker, es: Any, data: Any) -> None:
        """An engine process exited (on the loop thread): tell the group at once."""
        if self._ipp is None or self._ipp.engines.get(w.engine_set) is not es:
            return  # an older engine set of a restarted worker
        w.exited = True
        # not when the group already knows (removed, restarting, or found dead)
        if (self.agent is not None and self.state in ("running", "starting")
                and self.agent.gone_why(w.rank) is None):
            log.warning("nbrpc cluster: the engine of %r exited (%s)", w.name, data)
            self.agent.expel(w.rank, dead=True, why="died (its engine process exited)")

    def _connect(self) -> Any:
        if self.client is None:
            assert self._loop is not None
            self.client = self._loop.run(self._ipp.connect_client, timeout=self.timeout)
        return self.client

    def _wait_ready(self, names: list[str], progress: Progress) -> None:
        """Start an agent on each engine as it registers; return when all have joined."""
        client = self._connect()
        assert self.agent is not None
        pending = set(names)
        deadline = time.monotonic() + self.timeout
        ranks = {w.name: w.rank for w in self.workers.values()}
        options = {"num_worker_threads": self.threads, "rpc_timeout": self.rpc_timeout,
                   "heartbeat_interval": self.heartbeat, "encrypt": self.encrypt,
                   **self._failure_option()}
        shown, refused, asked = "", None, 0.0
        while pending:
            self._assign_engines(client, pending)
            if self._ask_queue([self.workers[n] for n in pending]):
                note = self._queue_note(pending)
                if note and note != shown:
                    progress.note(note)
                shown = note
            if self._relay_report is not None and time.monotonic() - asked > 1.0:
                asked = time.monotonic()  # what keeps an engine elsewhere out, as it happens
                note = self.relay_refusals()
                if note and note != refused:
                    progress.note(note)
                refused = note
            for name in sorted(pending):
                w = self.workers[name]
                if w.engine_id is not None and w.agent_call is None:
                    w.agent_call = client[w.engine_id].apply_async(
                        engine_side.start_agent, ranks, name, self.agent.address, self._key,
                        {**options, **self._device_options(name)})
                if w.agent_call is not None and w.agent_call.ready():
                    info = w.agent_call.get(0)  # raises the engine's error, if any
                    w.pid, w.host, w.cpu_share = info["pid"], info["host"], info["cpu_share"]
                if w.exited:
                    raise ClusterError(f"the engine of {name!r} exited during start-up:\n"
                                       f"{self._engine_output(name)}")
                if w.pid is not None and self.agent.is_member(w.rank):
                    pending.discard(name)
                    progress.update(1, f"{name} ready")
            if time.monotonic() > deadline:
                self._ask_queue([self.workers[n] for n in pending], every=0)
                queued = self._queue_note(pending, waiting_only=True)
                if queued:  # still in the batch queue: the queue's reason is the answer
                    raise ClusterError(
                        f"{sorted(pending)} not ready within {self.timeout:g} s: their jobs "
                        f"are still waiting in the queue ({queued}). Raise timeout=... to "
                        "wait longer, or change the queue/partition or the resources asked")
                refused = self.relay_refusals()
                raise ClusterError(
                    f"{sorted(pending)} not ready within {self.timeout:g} s (engines registered: "
                    f"{sorted(client.ids)}); " + (
                        f"{refused}: an engine with another cluster's connection file, or "
                        "something else reaching the relay's port. " if refused else "")
                    + "Raise timeout=..., or look at the engines' output:\n"
                    + "\n".join(self._engine_output(n) for n in sorted(pending))
                    + self._controller_notes())
            time.sleep(0.01)
        if self._device_options("driver"):
            gpus_.check_group(self.agent)
        self._set_torch_threads(names, client, deadline)

    def _set_torch_threads(self, names: list[str], client: Any, deadline: float) -> None:
        """Give the workers ``names``, just started, their share of their CPUs
        for torch's and their BLAS libraries' threads (``torch_threads``, see
        :mod:`nbrpc.cluster.threads`), on their engines' main threads, before
        they serve any call."""
        shares = {w.name: w.cpu_share for w in self.workers.values()
                  if w.cpu_share is not None and not w.exited}
        counts = {name: n for name, n in threads_.plan(self.torch_threads, shares).items()
                  if name in names}
        calls = {name: client[self.workers[name].engine_id].apply_async(threads_.apply, n)
                 for name, n in counts.items()}
        for name, call in calls.items():
            try:
                call.get(max(1.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - it runs, with torch's default threads
                log.warning("nbrpc cluster: could not set torch's and BLAS's threads in %r "
                            "(it keeps their default, one per CPU): %s: %s", name,
                            type(e).__name__, e)
        if counts and self.torch_threads == threads_.AUTO:
            given = sorted({(n, shares[name].cpus) for name, n in counts.items()})
            log.info("nbrpc cluster: torch and BLAS threads per worker (CPUs it may run on): %s, so "
                     "that workers on one host do not each use every CPU "
                     "(Cluster(torch_threads=None) keeps torch's default)",
                     ", ".join(f"{n} ({cpus})" for n, cpus in given))

    def _device_options(self, name: str) -> dict[str, Any]:
        """What the member ``name`` builds its devices from (``start_agent`` on
        an engine); {} in a cluster with neither device maps nor GPUs."""
        if not (self.gpus or self.device_maps):
            return {}
        return {"device_maps": self.device_maps.get(name, ()), "gpus": self.gpus}

    def _ask_queue(self, workers: list[_Worker], every: float = 1.0) -> bool:
        """Refresh the Slurm jobs of ``workers`` from ``squeue``, at most once per
        ``every`` seconds; True when it asked."""
        ids = [w.job.job_id for w in workers if w.job is not None and w.job.system == "slurm"]
        now = time.monotonic()
        if not ids or now - self._jobs_asked < every:
            return False
        self._jobs_asked = now
        seen = jobs.slurm_jobs(ids)
        for w in workers:
            if w.job is not None and w.job.job_id in seen:
                w.job = seen[w.job.job_id]
        return True

    def _queue_note(self, names: set[str], waiting_only: bool = False) -> str:
        """'worker1: Slurm job 12 PENDING (Resources); ...' for the workers whose
        job does not run yet (``waiting_only``), or whose job's state is known."""
        notes = []
        for name in sorted(names, key=lambda n: self.workers[n].rank):
            job = self.workers[name].job
            if job is None or not job.state:
                continue
            if not waiting_only or job.state in ("PENDING", "CONFIGURING", "REQUEUED"):
                notes.append(f"{name}: {job}")
        return "; ".join(notes)

    def _assign_engines(self, client: Any, pending: set[str]) -> None:
        """Match newly registered ipyparallel engines to workers (engine id = rank,
        as requested with --IPEngine.id; else the lowest waiting rank). Engines are
        told apart by their registration identity, so the old engine of a restarted
        worker, still listed under the same id while it goes, is never taken."""
        engines = getattr(client, "_engines", {})
        by_rank = {w.rank: w for w in self.workers.values() if w.name in pending}
        waiting = sorted((w for w in by_rank.values() if w.engine_id is None),
                         key=lambda w: w.rank)
        for eid in sorted(client.ids):
            ident = engines.get(eid, eid)
            if ident in self._used:
                continue
            w = by_rank.get(eid)
            if w is None or w.engine_id is not None:
                w = waiting[0] if waiting else None
            if w is None:
                break
            w.engine_id, w.engine_ident = eid, ident
            self._used.add(ident)
            if w in waiting:
                waiting.remove(w)

    def _engine_output(self, name: str) -> str:
        try:
            es = self._ipp.engines.get(name) if self._ipp else None
            text = es.get_output() if es is not None else ""
        except Exception as e:  # noqa: BLE001 - diagnostics only
            text = f"(output unavailable: {e})"
        return f"--- {name} ---\n{text[-3000:] or '(no output)'}"

    def _controller_notes(self) -> str:
        """What the controller logged about registrations and its relay (an
        engine it accepted but never heard beat is purged after 30 s), for an
        error: "" when it logged nothing of the kind."""
        try:
            text = self._ipp.controller.get_output() if self._ipp and self._ipp.controller else ""
        except Exception as e:  # noqa: BLE001 - diagnostics only
            return f"\n--- the controller ---\n(output unavailable: {e})"
        notes = controller_notes(text or "")
        return f"\n--- the controller, on registrations ---\n{notes}" if notes else ""

    def add(self, n: int) -> list[str]:
        """Start ``n`` more workers (ranks after the highest); returns their names."""
        n = _check_count(n, "add")
        with self._lock:
            self._require_running("add")
            top = max((w.rank for w in self.workers.values()), default=0)
            new = [(f"worker{r}", r) for r in range(top + 1, top + n + 1)]
            self._bring_up(new, "adding nbrpc workers")
            return [name for name, _ in new]

    def remove(self, name: str) -> None:
        """Stop worker ``name`` for good; the group is told it left."""
        with self._lock:
            self._require_running("remove")
            self._take_down(self._worker(name), dead=False, why="was removed from the cluster")
            del self.workers[name]

    def restart(self, name: str | None = None, *, progress: bool | None = None) -> None:
        """Restart one worker under the same name and rank (its RRefs are lost;
        calls in flight to it fail), or, with no name, the whole cluster.
        ``progress``: as the cluster's own option (``False`` only logs: the
        cluster widget's Restart button runs it so, off the cell's output)."""
        if name is None:
            n = len(self.workers)
            self.stop()
            self.start(n)
            return
        with self._lock:
            self._require_running("restart")
            w = self._worker(name)
            self._take_down(w, dead=True, why="was restarted")  # its RRefs are released
            w.place, w.pid, w.host = w.host, None, None
            self._bring_up([(name, w.rank)], f"restarting {name}",
                           self.progress if progress is None else progress)

    def _bring_up(self, ranks: list[tuple[str, int]], title: str,
                  enabled: bool | None = None) -> None:
        """Launch engines for ``ranks`` (name, rank) and wait for their agents."""
        progress = make_progress(len(ranks), self.progress if enabled is None else enabled,
                                 title)
        try:
            self._launch(ranks)
            self._wait_ready([name for name, _ in ranks], progress)
        finally:
            progress.close()

    def _take_down(self, w: _Worker, dead: bool, why: str) -> None:
        """Tell the group ``w`` is gone (``dead``: as a failure), then stop its engine."""
        assert self.agent is not None and self._loop is not None
        gone = self.agent.gone_why(w.rank) is not None  # found dead: nothing to stop in it
        self.agent.expel(w.rank, dead=dead, why=why)
        shared = any(o is not w and o.engine_set == w.engine_set and not o.exited
                     for o in self.workers.values())
        if shared and not gone and w.engine_id is not None and self.client is not None:
            # One process of an mpiexec that runs other workers too: it is not
            # killed (an mpiexec other than Open MPI 4's, which survive_args
            # tells to carry on, would abort them all), and after the shutdown below
            # Open MPI holds it in MPI_Finalize until they end. The expel above
            # keeps its agent out of the group (banished); stop that agent too,
            # so the idle process holds no sockets or threads meanwhile.
            try:
                self.client[w.engine_id].apply_async(engine_side.stop_agent).get(
                    STOP_AGENT_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - gone already, or wedged: shut it down
                log.warning("stopping the agent of %r in its engine: %s", w.name, e)
        if w.engine_id is not None and self.client is not None:
            try:  # frees the engine id at the controller at once
                self.client.shutdown(targets=[w.engine_id], block=False)
            except Exception as e:  # noqa: BLE001 - it may be dead already
                log.debug("ipyparallel shutdown of %s: %s", w.name, e)
        if shared:
            w.procs.clear()
            return
        if w.engine_set in self._ipp.engines:
            try:
                self._loop.run(self._ipp.stop_engines, w.engine_set, timeout=10)
            except Exception as e:  # noqa: BLE001 - force below
                log.warning("stopping the engine of %r: %s", w.name, e)
        kill_family(w.procs)
        w.procs.clear()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop everything this cluster started. Bounded: past ``timeout`` what is
        left is killed. Calls in flight fail; stopping twice does nothing."""
        with self._lock:
            if self.state == "stopped":
                return
            self.state = "stopping"
            deadline = time.monotonic() + timeout
            # The driver's agent goes first: stopped after its peers, it would
            # wait out the linger of the heartbeats queued to them (0.5 s).
            steps: list[tuple[str, Callable[[], None]]] = [
                ("driver agent", lambda: self.agent and self.agent.shutdown(graceful=False)),
                ("engines", lambda: self._loop and self._ipp and self._loop.run(
                    self._ipp.stop_engines, timeout=_left(deadline))),
                # an engine that outlived its stop (frozen, wedged) is killed now: until
                # it exits, ipyparallel's launcher blocks the loop thread in a join
                ("engines left", lambda: kill_family([p for w in self.workers.values()
                                                for p in w.procs])),
                ("controller", lambda: self._loop and self._ipp and self._loop.run(
                    self._ipp.stop_controller, timeout=_left(deadline))),
                ("client", lambda: self.client and self.client.close()),
                ("zygote", lambda: self._zygote and self._zygote.close(min(3.0, _left(deadline)))),
            ]
            for what, step in steps:
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - keep going: stop never wedges
                    log.warning("nbrpc cluster stop: %s: %s", what, e)
            procs = [p for w in self.workers.values() for p in w.procs]
            if self._controller_proc is not None:
                procs.append(self._controller_proc)
            kill_family(procs)
            self._forget_ipp()
            if self._loop is not None:
                self._loop.stop()
            if _Default.agent is self.agent:
                set_default_agent(None)
            if self._own_profile and self._profile_dir:
                shutil.rmtree(self._profile_dir, ignore_errors=True)
                self._profile_dir, self._own_profile = None, False
            local.sweep()  # the socket directories of engines that were killed
            self.workers.clear()
            self._used.clear()
            self.agent = self.client = self._ipp = self._loop = self._zygote = None
            self._controller_proc = None
            _RUNNING.discard(self)
            self.state = "stopped"

    def _forget_ipp(self) -> None:
        from ipyparallel.cluster import cluster as ipp_cluster

        from .launcher import ZYGOTES

        if self._ipp is not None:
            ipp_cluster._atexit_clusters.discard(self._ipp)
            ZYGOTES.pop(self._ipp.cluster_id, None)
            try:
                self._ipp.remove_cluster_file()
            except OSError:
                pass

    # -- introspection -----------------------------------------------------------
    def status(self, probe_timeout: float = 1.0) -> ClusterStatus:
        """Each worker's state (starting / ready / busy / dead), pid, host, threads in
        use, in-flight calls, owned RRefs and their bytes, and message counters,
        probed through the agents (in parallel; each probe waits ``probe_timeout``).
        Safe to call from another thread (the cluster widget's live refresh)."""
        rows: list[WorkerStatus] = []
        agent, state = self.agent, self.state
        if agent is not None and state == "starting":  # no probes: who joined, the jobs
            workers = sorted(list(self.workers.values()), key=lambda w: w.rank)
            self._ask_queue(workers, every=STATUS_QUEUE_PERIOD)
            rows.append(_driver_row(agent))
            for w in workers:
                joined = w.pid is not None and agent.is_member(w.rank)
                rows.append(WorkerStatus(w.name, w.rank, host=w.host, pid=w.pid,
                                         state="ready" if joined else "starting",
                                         threads=self.threads, job=str(w.job or "")))
        if agent is not None and state == "running":
            rows.append(_driver_row(agent))
            workers = sorted(list(self.workers.values()), key=lambda w: w.rank)
            # a worker found gone while its job looked alive: ask now what befell the job
            stale = any(w.job is not None and w.job.state in ("PENDING", "RUNNING")
                        and agent.gone_why(w.rank) for w in workers)
            self._ask_queue(workers, every=0 if stale else STATUS_QUEUE_PERIOD)
            futs = {}
            for w in workers:
                if agent.is_member(w.rank):
                    try:
                        futs[w.name] = agent.rpc_async(w.name, engine_side.probe, (), None,
                                                       probe_timeout)
                    except NbrpcError as e:  # it left or died since is_member
                        log.debug("status probe of %s: %s", w.name, e)
            for w in workers:
                rows.append(self._row(w, agent, futs.get(w.name)))
        refused = self.relay_refusals()
        if refused and rows:  # the driver's note: its controller's relay
            rows[0].detail = refused
        return ClusterStatus(self.launcher_name, state, rows)

    def relay_refusals(self) -> str | None:
        """What the controller's relay (engines on other hosts reach the
        controller through it) has refused, in words, or None: the count, and
        the last connection's address and reason ("not the cluster's key", "no
        HELLO within 10 s", ...). The status shows it as the driver's note."""
        report = self._relay_report
        return relay.read_report(report) if report is not None else None

    def widget(self, **options: Any) -> Any:
        """The live cluster view (refreshed at most twice a second while the
        cluster runs; Restart and Stop buttons). Needs the notebook packages."""
        return views.make("cluster", self, **options)

    def _row(self, w: _Worker, agent: Agent, fut: Any) -> WorkerStatus:
        row = WorkerStatus(w.name, w.rank, host=w.host, pid=w.pid, threads=self.threads,
                           job=str(w.job or ""), device=_home(agent, w.rank))
        gone = agent.gone_why(w.rank)
        if fut is None:
            row.state = "dead" if (gone or w.exited) else "starting"
            row.detail = gone or ""
            return row
        try:
            info = fut.wait()
        except Exception as e:  # noqa: BLE001 - shown in the status
            row.state = "dead" if agent.gone_why(w.rank) else "busy"
            row.detail = f"{type(e).__name__}: {e}"
            silent = agent.silent_for(w.rank)
            if row.state == "busy" and silent is not None and silent > 2 * self.heartbeat + 1:
                # what explains the unanswered probe (busy is not dead: still a member)
                row.detail = (f"no heartbeat for {silent:.0f} s: busy in a call that holds "
                              f"its GIL, or stopped (still connected)")
            return row
        row.state = "busy" if info["busy_threads"] or info["in_flight"] else "ready"
        fill_row(row, info)
        return row

    def view(self, name: str) -> Any:
        """ipyparallel's DirectView on worker ``name``'s engine (for ``%px``-style use)."""
        w = self._worker(name)
        if w.engine_id is None or self.client is None:
            raise ClusterError(f"{name!r} has no engine yet (state: {self.state})")
        return self.client[w.engine_id]

    def _worker(self, name: str) -> _Worker:
        if not isinstance(name, str) or name not in self.workers:
            raise ClusterError(f"no worker named {name!r}; the cluster has "
                               f"{self.names or 'no workers'}")
        return self.workers[name]

    def _require_running(self, what: str) -> None:
        if self.state != "running":
            raise ClusterError(f"cannot {what}: the cluster is {self.state}; start(n) it first")

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"<nbrpc Cluster {self.state}, {len(self.workers)} workers, "
                f"launcher={self.launcher_name}>")

    def __del__(self) -> None:
        if getattr(self, "state", "stopped") != "stopped":
            try:
                self.stop(timeout=3)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


_RUNNING: weakref.WeakSet[Cluster] = weakref.WeakSet()
_ATEXIT: list[bool] = []


def _stop_at_exit(cluster: Cluster) -> None:
    """Stop running clusters when the interpreter exits (a kernel shut down or
    restarted). Registered after ipyparallel's own exit hook, so it runs first
    and ipyparallel finds nothing left to stop."""
    _RUNNING.add(cluster)
    if not _ATEXIT:
        atexit.register(_stop_all)
        _ATEXIT.append(True)


def _stop_all() -> None:
    for cluster in list(_RUNNING):
        try:
            cluster.stop(timeout=5)
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.warning("nbrpc cluster stop at exit: %s", e)


def _driver_row(agent: Agent) -> WorkerStatus:
    row = WorkerStatus("driver", 0, state="ready", threads=agent.options.num_worker_threads,
                       device=_home(agent, 0))
    return fill_row(row, engine_side.describe(agent))


def _home(agent: Agent, rank: int) -> str:
    """The member's own device (gpus=True), as its record says; else ""."""
    m = agent.members.get(rank)
    return getattr(getattr(m, "devices", None), "home", None) or ""


def _check_count(n: Any, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} needs a number of workers >= 1, got {n!r}")
    return n


CONTROLLER_NOTES = ("registration::", "heartbeat::", "controller relay")


def controller_notes(text: str, limit: int = 15) -> str:
    r"""The last ``limit`` lines of ipyparallel's controller log that say how
    engines' registrations went (accepted, finished, purged for want of a
    heartbeat) and what the relay refused or could not dial.

    >>> print(controller_notes("[IPController] hub::created hub\n"
    ...                        "[IPController] registration::accepting registration 1:ab\n"
    ...                        "[IPController] WARNING | registration::purging stalled "
    ...                        "registration 1:ab\n"))
    [IPController] registration::accepting registration 1:ab
    [IPController] WARNING | registration::purging stalled registration 1:ab
    """
    lines = [ln for ln in text.splitlines() if any(k in ln for k in CONTROLLER_NOTES)]
    return "\n".join(lines[-limit:])


def _wait_for_file(path: str, timeout: float) -> str:
    """The text of ``path``, once it exists (within ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise ClusterError(f"the controller's relay did not start within {timeout:g} s "
                                   f"(no {path}); see the controller's log in the profile "
                                   "directory") from None
            time.sleep(0.05)  # (a poll's pace)


def _left(deadline: float) -> float:
    return max(0.5, deadline - time.monotonic())
