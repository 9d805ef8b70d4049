"""What runs inside an engine: its agent, started by the driver through ipyparallel.

The driver calls :func:`start_agent` on each engine once it has registered
(``client[id].apply``), passing the group key and the driver's address: they
travel in ipyparallel's signed messages, never through files. The agent runs
in background threads, so the engine's own execution stays free for ``%px``
and ``%%rpc_on``. If the driver disappears (its kernel killed), the engine
exits by itself within a few seconds.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any
from urllib.parse import urlparse

import torch

from ..agent import Agent, AgentOptions, internal, set_default_agent
from ..agent.agent import _Default
from ..rpc.rendezvous import _local_ip_towards
from . import gpus as gpus_
from . import threads

log = logging.getLogger(__name__)

WORKER_ENV = "NBRPC_WORKER"  # set per engine set: which worker this engine is
_agent: list[Agent] = []  # this engine's agent (at most one)


def start_agent(names: dict[str, int], fallback: str, coordinator: str, key: bytes,
                options: dict[str, Any]) -> dict[str, Any]:
    """Start this engine's agent and send its Join (returns at once).

    The engine is the worker its launcher named in ``$NBRPC_WORKER`` (one of
    ``names``), else ``fallback``. Returns what the driver's status shows.
    """
    name = os.environ.get(WORKER_ENV)
    if name not in names:
        name = fallback
    rank = names[name]
    if _agent and _agent[0].state != "stopped":
        _agent[0].shutdown(graceful=False)
    _agent.clear()
    if _Default.agent is not None:  # e.g. a user's own init_rpc on this engine
        _Default.agent.shutdown(graceful=False)
    host = urlparse(coordinator).hostname or "127.0.0.1"
    options = dict(options)
    maps, gpus = options.pop("device_maps", None), options.pop("gpus", False)
    if maps is not None:  # (the cluster has device maps or GPUs)
        count = torch.cuda.device_count()
        options["devices"] = gpus_.config(rank, maps, gpus, count)
        if gpus:
            torch.cuda.set_device(options["devices"].home)  # this worker's "cuda"
    opts = AgentOptions(**{**options, "host": _local_ip_towards(socket.gethostbyname(host)),
                           "port": 0})
    agent = Agent(name, rank, key, world_size=None, options=opts)
    agent.gone_hooks.append(lambda gone: _exit_without_driver(agent, gone))
    agent.begin(coordinator)
    set_default_agent(agent)
    _agent.append(agent)
    return {"name": name, "rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
            "address": agent.address, "cpu_share": threads.cpu_share()}


def stop_agent() -> bool:
    """Stop this engine's agent, leaving the engine running (run through ipyparallel
    by the driver, for a worker whose process outlives its place in the group:
    one rank of an ``mpiexec`` of several workers). True if there was one."""
    if not _agent:
        return False
    _agent.pop().shutdown(graceful=False)
    return True


def _exit_without_driver(agent: Agent, gone: int) -> None:
    """A member-gone hook (on the agent's I/O thread): once the driver has gone
    (declared dead, or this worker evicted), end the engine, an orphan now."""
    if gone != 0 or agent.state in ("stopping", "stopped"):
        return
    log.warning("nbrpc: the driver %s; engine %r exits", agent.gone_why(0), agent.name)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


@internal
def probe() -> dict[str, Any]:
    """This worker's state for the driver's status view (runs on the agent's pool)."""
    agent = _agent[0] if _agent else _Default.agent
    info = describe(agent)
    info["busy_threads"] = max(0, info["busy_threads"] - 1)  # minus this probe
    return info


def describe(agent: Agent | None) -> dict[str, Any]:
    """An agent's row of the status: pid, host, threads, calls in flight, owned
    RRefs and their bytes (all, and those on GPUs), messages and bytes moved
    (sent + received)."""
    snap = agent.snapshot(events=0) if agent else {}
    counters = snap.get("counters", {})
    owned = _owned(snap.get("rrefs", {}))
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        # the pool's threads and those serving callers' own channels
        "threads": counters.get("threads", 0) + counters.get("channels", 0),
        "torch_threads": torch.get_num_threads(),  # (as the calling thread runs operators)
        "blas_threads": threads.blas_threads(),
        "busy_threads": counters.get("busy_threads", 0) + counters.get("channels_busy", 0),
        "in_flight": counters.get("in_flight", 0),
        "owned_rrefs": len(owned),
        "owned_bytes": sum(v.get("nbytes") or 0 for v in owned),
        "device_bytes": sum(v.get("nbytes") or 0 for v in owned if v.get("device")),
        "messages": counters.get("messages_sent", 0) + counters.get("messages_received", 0),
        "bytes_moved": counters.get("bytes_sent", 0) + counters.get("bytes_received", 0),
    }


def _owned(rrefs: Any) -> list[dict[str, Any]]:
    owners = rrefs.get("owned") if isinstance(rrefs, dict) else None
    return list(owners) if owners is not None else []
