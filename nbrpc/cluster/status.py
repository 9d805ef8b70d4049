"""The cluster's status as plain data, with a deterministic text view.

``text/plain`` shows only what does not vary between runs of the same
notebook (names, ranks, states, counts), so nbval can compare it. The rows
also carry what does vary (hosts, pids, threads in use, in-flight calls,
owned RRefs and their bytes, message counters): the Jupyter layer draws them
(``nbrpc.jupyter.cluster_view``: the live widget and the static HTML table).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

STATES = ("starting", "ready", "busy", "dead")


@dataclass
class WorkerStatus:
    """One row of :class:`ClusterStatus`."""

    name: str
    rank: int
    host: str | None = None
    pid: int | None = None
    state: str = "starting"
    threads: int = 0
    busy_threads: int = 0
    in_flight: int = 0
    owned_rrefs: int = 0
    owned_bytes: int = 0  # approximate size of the values it owns (tensors, modules, ...)
    messages: int = 0  # messages sent + received since its agent started (heartbeats too)
    bytes_moved: int = 0  # bytes sent + received since its agent started
    detail: str = ""
    job: str = ""  # its batch job, as last seen (e.g. "Slurm job 17 RUNNING on n1")
    device: str = ""  # its own device in a cluster with gpus=True ("cuda:1", "cpu")
    device_bytes: int = 0  # bytes of the values it owns that are off its CPU (on GPUs)
    torch_threads: int = 0  # torch's intra-op threads, as its calls run them (0: not known)
    blas_threads: str = ""  # its BLAS libraries' threads, e.g. "openblas 1" ("": none or not known)


@dataclass
class ClusterStatus:
    """The driver and every worker, by rank.

    >>> s = ClusterStatus("fork", "running", [WorkerStatus("driver", 0, state="ready"),
    ...                                       WorkerStatus("worker1", 1, state="dead")])
    >>> print(s)
    nbrpc cluster (fork launcher): 1 worker, 1 dead
      rank  name     state
      0     driver   ready
      1     worker1  dead
    >>> s["worker1"].state, s.count("dead")
    ('dead', 1)
    """

    launcher: str
    state: str
    workers: list[WorkerStatus]

    def __getitem__(self, name: str) -> WorkerStatus:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(f"no worker named {name!r} in this status; "
                       f"it has {[w.name for w in self.workers]}")

    def count(self, state: str) -> int:
        return sum(w.state == state for w in self.workers if w.rank != 0)

    def to_dict(self) -> dict[str, Any]:
        return {"launcher": self.launcher, "state": self.state,
                "workers": [asdict(w) for w in self.workers]}

    def summary(self) -> str:
        n = sum(w.rank != 0 for w in self.workers)
        if self.state == "starting" and self.workers:
            return (f"nbrpc cluster ({self.launcher} launcher): starting, "
                    f"{self.count('ready')} of {n} workers ready")
        if self.state != "running":
            return f"nbrpc cluster (no workers): {self.state}"
        counts = [f"{self.count(s)} {s}" for s in STATES if self.count(s)]
        noun = "worker" if n == 1 else "workers"
        if counts == [f"{n} ready"]:
            return f"nbrpc cluster ({self.launcher} launcher): {n} {noun} ready"
        return f"nbrpc cluster ({self.launcher} launcher): {n} {noun}, " + ", ".join(counts)

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.workers:
            width = max(len("name"), *(len(w.name) for w in self.workers))
            lines.append(f"  rank  {'name':<{width}}  state")
            lines += [f"  {w.rank:<4}  {w.name:<{width}}  {w.state}" for w in self.workers]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def fill_row(row: WorkerStatus, info: dict[str, Any]) -> WorkerStatus:
    """Copy a probe's counters into a status row (pid and host too, when given)."""
    for key in ("busy_threads", "in_flight", "owned_rrefs", "owned_bytes", "device_bytes",
                "messages", "bytes_moved", "pid", "host", "torch_threads",
                "blas_threads"):
        if info.get(key) is not None:
            setattr(row, key, info[key])
    return row
