"""``%rpc_cluster`` and ``%%rpc_on``: the notebook's handles on an :class:`~nbrpc.cluster.Cluster`.

``%load_ext nbrpc`` registers them, and the rich displays of nbrpc's objects
(:mod:`nbrpc.jupyter.formatters`). The magics are thin: each subcommand is one
call of the Python API, so what a notebook does with magics a script does
with ``nbrpc.Cluster``. In a kernel, ``%rpc_cluster`` and its subcommands
return the live cluster view (``cluster.widget()``); elsewhere (a terminal,
a test's shell), the plain :class:`~nbrpc.cluster.ClusterStatus`.
"""

from __future__ import annotations

import argparse
import ast
import logging
import re
import shlex
import sys
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from ..cluster import Cluster, ClusterError, ClusterStatus
from ..errors import CellError
from . import formatters

log = logging.getLogger(__name__)

_OPTION = re.compile(r"^--([A-Za-z_][\w.]*)=(.*)$", re.S)


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (with the usage and a fix) instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message}\n{self.format_usage().strip()}\n"
                         f"(see: {self.prog} --help)")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            raise UsageError(message)
        raise _HelpShown()


class _HelpShown(Exception):
    """--help was printed; the magic returns nothing."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {value}")
    return value


def _torch_threads(text: str) -> int | str | None:
    if text.lower() in ("auto", "none"):
        return None if text.lower() == "none" else "auto"
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected auto, none or a number >= 1, got {text!r}") from None


def _cluster_parser() -> _Parser:
    p = _Parser(prog="%rpc_cluster", description=(
        "Start and manage a cluster of ipyparallel engines, each hosting an nbrpc agent "
        "(worker1..workerN); this kernel joins as 'driver' (rank 0)."),
        epilog="With no subcommand: status.")
    sub = p.add_subparsers(dest="command", metavar="{start,stop,restart,status,add,remove}")
    s = sub.add_parser("start", help="start N workers", description=(
        "Start N workers. Options of the form --Trait=value (e.g. --engines=\"{'host1': 2}\" "
        "for ssh, --account=abc for slurm) are passed to the engine launcher."))
    s.add_argument("n", type=_positive_int, help="number of workers")
    s.add_argument("--launcher", default="fork",
                   help="fork (default: forked from a warm process), local, or an "
                        "ipyparallel launcher: mpi, ssh, slurm, pbs, sge, lsf, ...")
    s.add_argument("--threads", type=_positive_int, default=16,
                   help="worker threads per agent (default 16)")
    s.add_argument("--torch-threads", type=_torch_threads, default="auto",
                   help="torch's intra-op threads per worker, and numpy's BLAS threads: "
                        "auto (default: the CPUs a worker may run on, divided among the "
                        "workers that share them), a number, or none (the libraries' "
                        "default: one per CPU in every worker)")
    s.add_argument("--timeout", type=_positive_float, default=60.0,
                   help="seconds to wait for the workers (default 60)")
    s.add_argument("--rpc-timeout", type=_positive_float, default=60.0,
                   help="default timeout of RPC calls, in seconds (default 60)")
    s.add_argument("--failure-timeout", type=_positive_float, default=None,
                   help="seconds a busy or stopped worker may stay silent before it is "
                        "declared dead (default: never on Linux; an exited worker, or one "
                        "whose host vanished, is noticed within seconds regardless)")
    s.add_argument("--encrypt", action="store_true",
                   help="CURVE-encrypt the workers' connections (networks you do not trust)")
    s.add_argument("--gpus", action="store_true",
                   help="give each worker one GPU of its host, round robin, and map tensors "
                        "device to device between members (the kernel: cuda:0, or the CPU)")
    s.add_argument("--host", default=None,
                   help="interface the driver listens on (default: loopback for local "
                        "launchers, else this host's routable address)")
    s.add_argument("--controller-ip", default=None,
                   help="interface of the controller's relay, for engines on other hosts")
    sub.add_parser("stop", help="stop every worker and the driver's agent",
                   description="Stop the cluster (bounded: what does not exit is killed).")
    r = sub.add_parser("restart", help="restart one worker (same name and rank), or all",
                       description="Restart worker NAME under the same name and rank, or "
                                   "the whole cluster with no NAME.")
    r.add_argument("name", nargs="?", default=None)
    sub.add_parser("status", help="show every worker's state",
                   description="Show name, rank, host, pid, state, threads, in-flight "
                               "calls and owned RRefs of every worker.")
    a = sub.add_parser("add", help="start N more workers", description="Start N more workers.")
    a.add_argument("n", type=_positive_int)
    m = sub.add_parser("remove", help="stop worker NAME for good",
                       description="Stop worker NAME; the group is told it left.")
    m.add_argument("name")
    return p


def _on_parser() -> _Parser:
    p = _Parser(prog="%%rpc_on", description=(
        "Run the cell on the engines of the named workers (in their IPython namespaces, "
        "where `from nbrpc import rpc` uses that worker's agent) and show their output, "
        "sorted by rank."))
    p.add_argument("workers", nargs="+", help="worker names, or 'all'")
    p.add_argument("--timeout", type=_positive_float, default=None,
                   help="seconds to wait (default: none; interrupt to stop waiting)")
    return p


def _launcher_options(extra: list[str]) -> dict[str, Any]:
    """``--name=value`` pairs to launcher traits (values as Python literals or strings)."""
    out: dict[str, Any] = {}
    for item in extra:
        m = _OPTION.match(item)
        if not m:
            raise UsageError(f"unrecognized argument {item!r}: launcher options are written "
                             "--trait=value (e.g. --account=abc)\n(see: %rpc_cluster start --help)")
        name, text = m.group(1).rsplit(".", 1)[-1], m.group(2)
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[name] = text
    return out


@magics_class
class ClusterMagics(Magics):
    """``%rpc_cluster`` and ``%%rpc_on`` (one cluster per kernel)."""

    cluster: Cluster | None = None

    @line_magic
    def rpc_cluster(self, line: str) -> Any:
        """Start and manage the kernel's nbrpc cluster. ``%rpc_cluster --help`` for usage."""
        parser = _cluster_parser()
        try:
            args, extra = parser.parse_known_args(shlex.split(line))
        except _HelpShown:  # argparse printed it
            return None
        command = args.command or "status"
        if extra and command != "start":
            raise UsageError(f"unrecognized arguments {extra} for %rpc_cluster {command}\n"
                             f"(see: %rpc_cluster {command} --help)")
        try:
            return getattr(self, f"_{command}")(args, extra)
        except ClusterError as e:
            raise UsageError(str(e)) from None

    def _start(self, args: argparse.Namespace, extra: list[str]) -> ClusterStatus:
        if self.cluster is not None and self.cluster.state != "stopped":
            raise UsageError(f"a cluster is already running ({len(self.cluster.workers)} "
                             "workers): use %rpc_cluster add N to grow it, or "
                             "%rpc_cluster stop first")
        cluster = Cluster(launcher=args.launcher, launcher_options=_launcher_options(extra),
                          threads=args.threads, timeout=args.timeout,
                          rpc_timeout=args.rpc_timeout, host=args.host,
                          failure_timeout=args.failure_timeout, encrypt=args.encrypt,
                          controller_ip=args.controller_ip, gpus=args.gpus,
                          torch_threads=args.torch_threads)
        cluster.start(args.n)
        old, self.cluster = self.cluster, cluster
        if self.shell.user_ns.get("rpc_cluster") in (None, old):  # not the user's own
            self.shell.user_ns["rpc_cluster"] = cluster
        return self._shown(cluster)

    def _stop(self, args: argparse.Namespace, extra: list[str]) -> Any:
        cluster = self._need("stop", running=False)
        cluster.stop()
        return self._shown(cluster)

    def _restart(self, args: argparse.Namespace, extra: list[str]) -> Any:
        cluster = self._need("restart")
        cluster.restart(args.name)
        return self._shown(cluster)

    def _status(self, args: argparse.Namespace, extra: list[str]) -> Any:
        if self.cluster is None:
            return ClusterStatus("-", "stopped", [])
        return self._shown(self.cluster)

    def _add(self, args: argparse.Namespace, extra: list[str]) -> Any:
        cluster = self._need("add")
        cluster.add(args.n)
        return self._shown(cluster)

    def _remove(self, args: argparse.Namespace, extra: list[str]) -> Any:
        cluster = self._need("remove")
        cluster.remove(args.name)
        return self._shown(cluster)

    def _shown(self, cluster: Cluster) -> Any:
        """What a subcommand returns: the live view in a kernel (its text/plain is
        the status's text), else the status itself."""
        if type(self.shell).__name__ == "ZMQInteractiveShell":
            try:
                return cluster.widget()
            except ImportError as e:  # no widget libraries: the static table will do
                log.info("no cluster widget: %s", e)
        return cluster.status()

    def _need(self, what: str, running: bool = True) -> Cluster:
        if self.cluster is None or (running and self.cluster.state != "running"):
            raise UsageError(f"no cluster is running, so there is nothing to {what}: "
                             "start one with %rpc_cluster start N")
        return self.cluster

    @cell_magic
    def rpc_on(self, line: str, cell: str) -> None:
        """Run the cell on the named workers' engines: ``%%rpc_on worker2`` (or several
        names, or ``all``); output is shown per worker, sorted by rank. If the cell
        raises on any of them, :class:`~nbrpc.errors.CellError` shows each one's own
        traceback of the cell, headed by its name."""
        parser = _on_parser()
        try:
            args = parser.parse_args(shlex.split(line))
        except _HelpShown:  # argparse printed it
            return
        cluster = self._need("run a cell on")
        names = cluster.names if args.workers == ["all"] else args.workers
        unknown = [n for n in names if n not in cluster.workers]
        if unknown:
            raise UsageError(f"no worker named {', '.join(map(repr, unknown))}; the cluster "
                             f"has {cluster.names} (or use 'all')")
        order = sorted(names, key=lambda n: cluster.workers[n].rank)
        results = {n: cluster.view(n).execute(cell, silent=False, block=False) for n in order}
        _wait_all(list(results.values()), args.timeout)
        errors = {}
        for name in order:
            ar = results[name]
            _show_output(name, ar, several=len(order) > 1)
            try:
                ar.get(0)
            except Exception as e:  # noqa: BLE001 - reported below, per worker
                errors[name] = _worker_error(e)
        if errors:
            raise CellError(errors)


def _worker_error(e: Exception) -> tuple[str, str, str]:
    """A worker's failure as (type name, message, traceback): ipyparallel's
    RemoteError carries the engine's own traceback (as its IPython wrote it:
    the cell's frames); its engine id and method ("[1:execute]") are left out."""
    name = getattr(e, "ename", None) or type(e).__name__
    message = getattr(e, "evalue", None)
    if message is None:
        message = str(e)
    tb = getattr(e, "traceback", None)
    return name, message, tb if isinstance(tb, str) else f"{name}: {message}"


def _wait_all(results: list[Any], timeout: float | None) -> None:
    """Wait for every AsyncResult (interruptible: short waits in a loop)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not all(ar.ready() for ar in results):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the cell did not finish within {timeout:g} s on every worker; "
                               "its runs go on (interrupt them with ipyparallel's abort)")
        for ar in results:
            ar.wait(0.05)
    for ar in results:  # "ready" is the reply; the output streams may still be on the way
        ar.wait_for_output(timeout=5.0 if timeout is None else max(1.0, timeout))


def _show_output(name: str, ar: Any, several: bool) -> None:
    """The worker's stdout, stderr, displays and result, headed by its name when several."""
    from IPython.display import display

    stdout, stderr = ar.stdout, ar.stderr
    if isinstance(stdout, list):
        stdout, stderr = stdout[0], stderr[0]
    outputs = ar.outputs[0] if ar.outputs and isinstance(ar.outputs[0], list) else ar.outputs
    result = ar.execute_result
    if isinstance(result, list):
        result = result[0]
    if several and (stdout or stderr or outputs or result is not None):
        sys.stdout.write(f"[{name}]\n")
    if stdout:
        sys.stdout.write(stdout if stdout.endswith("\n") else stdout + "\n")
    if stderr:
        sys.stderr.write(stderr)
    for out in outputs or []:
        display(out.get("data", out) if isinstance(out, dict) else out, raw=True)
    if result is not None:
        display(result.get("data", {}) if isinstance(result, dict) else result, raw=True)


def load(ip: Any) -> None:
    """``%load_ext nbrpc``: the magics, and the rich displays of nbrpc's objects."""
    ip.register_magics(ClusterMagics)
    formatters.register(ip)


def unload(ip: Any) -> None:
    """``%unload_ext nbrpc``: stop the kernel's cluster, remove the displays."""
    formatters.unregister(ip)
    magics = ip.magics_manager.registry.get("ClusterMagics")
    if magics is not None and magics.cluster is not None:
        magics.cluster.stop()
