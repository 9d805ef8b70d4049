"""ipyparallel launchers for nbrpc clusters.

* :class:`ForkEngineSetLauncher` (``launcher="fork"``, the default): engines
  are forked by the cluster's warm :mod:`~nbrpc.cluster.zygote`, which has
  already imported torch. Everything else (output files, stop with TERM then
  KILL, exit notification) is ipyparallel's ``LocalEngineSetLauncher``.
* :class:`GuardedControllerLauncher`: ipyparallel's local controller, run
  under :mod:`~nbrpc.cluster.guard` so that it exits when the kernel dies.
"""

from __future__ import annotations

import sys

import psutil
from ipyparallel.cluster.launcher import (
    LocalControllerLauncher,
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    ProcessStateError,
)
from traitlets import Dict, List, Unicode

from . import guard
from .engine import WORKER_ENV
from .zygote import Zygote

#: zygotes by ipyparallel cluster id (set by nbrpc.cluster.Cluster)
ZYGOTES: dict[str, Zygote] = {}


class GuardedControllerLauncher(LocalControllerLauncher):
    """ipyparallel's local controller, exiting when the process that started it dies."""

    def find_args(self) -> list[str]:
        cmd = list(self.controller_cmd)
        if cmd[1:] == ["-m", "ipyparallel.controller"]:  # the default: guard it
            cmd = guard.command("ipyparallel.controller")
        return cmd + self.cluster_args + self.controller_args


class ForkEngineLauncher(LocalEngineLauncher):
    """One engine, forked by the cluster's zygote instead of started fresh."""

    zygote_id = Unicode("")

    def start(self) -> None:
        if self.state != "before":
            raise ProcessStateError(f"the engine was already started: {self.state}")
        zygote = ZYGOTES.get(self.zygote_id or self.cluster_id)
        if zygote is None:
            raise RuntimeError(f"no engine zygote for cluster {self.cluster_id!r}; "
                               "ForkEngineSetLauncher works only inside an nbrpc Cluster")
        env = self.get_env()
        netns = getattr(self.parent, "netns", {}).get(env.get(WORKER_ENV, ""))
        if netns and "/" not in netns:
            netns = f"/run/netns/{netns}"  # a name, as `ip netns add` makes them
        self.pid = zygote.spawn(list(self.args), env=env, cwd=self.work_dir,
                                output=self.output_file, netns=netns)
        self.process = psutil.Process(self.pid)
        self.notify_start(self.pid)
        self._start_waiting()

    def _log_output(self, stop_data: dict | None = None) -> None:
        # A forked engine's exit code is its zygote's to know (None here), so
        # ipyparallel would log every exit as a failure. The cluster reports
        # unexpected exits itself, with this output.
        output = self.get_output(remove=False)
        if output:
            self.log.debug("Output for %s:\n%s", self.identifier, output[-5000:])


class ForkEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, each engine forked by the warm zygote."""

    launcher_class = ForkEngineLauncher
    engine_cmd = List([sys.executable, "-m", "ipyparallel.engine"], config=True)
    netns = Dict(config=True, help="""worker name -> the Linux network namespace its
        engine runs in (a name under /run/netns, or a path): hosts simulated on one
        machine, for teaching partitions and failures. Needs root; the driver must
        listen where the namespaces reach it (host=..., controller_ip=...).""")

    def start(self, n: int) -> list:
        dlist = super().start(n)
        # ipyparallel's engine set does not hand its stop settings to its engines,
        # which would wait 5 s (not stop_seconds_until_kill) before a KILL
        for el in self.launchers.values():
            el.stop_seconds_until_kill = self.stop_seconds_until_kill
            el.stop_timeout = self.stop_timeout
        return dlist
