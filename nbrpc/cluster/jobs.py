"""The batch jobs behind workers: ids, and for Slurm their state and why they wait.

With a batch launcher (``"slurm"``, ``"pbs"``, ...) each worker is one job,
submitted by ipyparallel's engine-set launcher, which keeps the job id
(``job_id``) but never looks at the queue again. For Slurm, nbrpc asks
``squeue`` (at most once a second while workers start, and for the cluster's
status), so the progress line and the cluster view say which jobs still wait
and why (Slurm's reason: ``Resources``, ``Priority``, ``PartitionDown``, ...),
and a start that times out names the reason instead of only "not ready".
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SQUEUE_TIMEOUT = 5.0  # seconds one squeue may take (slurmctld busy or gone)
# %i job id, %T state (PENDING, RUNNING, CANCELLED, ...), %R reason (pending) or
# nodes (running), %N nodes
SQUEUE_FORMAT = "%i|%T|%R|%N"


@dataclass(frozen=True)
class Job:
    """One worker's batch job as last seen: ``state`` is the batch system's word
    (``""`` until the queue was asked), ``reason`` why it waits, ``nodes`` where it runs.

    >>> str(Job("slurm", "17", "PENDING", "Resources"))
    'Slurm job 17 PENDING (Resources)'
    >>> str(Job("slurm", "18", "RUNNING", nodes="n1")), str(Job("pbs", "4.head"))
    ('Slurm job 18 RUNNING on n1', 'PBS job 4.head')
    """

    system: str  # the launcher's batch system: "slurm", "pbs", ...
    job_id: str
    state: str = ""
    reason: str = ""
    nodes: str = ""

    def __str__(self) -> str:
        text = f"{_SYSTEMS.get(self.system, self.system)} job {self.job_id}"
        if self.state:
            text += f" {self.state}"
        if self.state == "PENDING" and self.reason and self.reason != "None":
            text += f" ({self.reason})"
        elif self.nodes and self.state in ("RUNNING", "COMPLETING"):
            text += f" on {self.nodes}"
        return text


_SYSTEMS = {"slurm": "Slurm", "pbs": "PBS", "sge": "SGE", "lsf": "LSF",
            "htcondor": "HTCondor", "winhpc": "Windows HPC"}


def job_of(engine_set: Any) -> Job | None:
    """The job an ipyparallel engine set submitted, or None (not a batch launcher,
    or not submitted yet)."""
    job_id = getattr(engine_set, "job_id", None)
    if not job_id:
        return None
    name = type(engine_set).__name__.lower()
    system = next((s for s in _SYSTEMS if name.startswith(s)), "batch")
    return Job(system, str(job_id))


def parse_squeue(text: str) -> dict[str, Job]:
    """``squeue -h -o '%i|%T|%R|%N'`` lines, by job id.

    >>> jobs = parse_squeue("17|PENDING|(PartitionDown)|\\n18|RUNNING|n2|n2\\n")
    >>> jobs["17"].reason, jobs["18"].state, jobs["18"].nodes
    ('PartitionDown', 'RUNNING', 'n2')
    """
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            job_id, state, reason, nodes = parts
            running = state in ("RUNNING", "COMPLETING")
            reason = "" if running else reason.strip("()")  # squeue writes "(Resources)"
            out[job_id] = Job("slurm", job_id, state, reason, nodes)
    return out


def slurm_jobs(job_ids: list[str], squeue: str = "squeue",
               timeout: float = SQUEUE_TIMEOUT) -> dict[str, Job]:
    """What Slurm says of ``job_ids`` (finished ones too, while Slurm keeps them:
    ``MinJobAge``, 300 s by default). A job Slurm no longer knows is absent; if
    squeue cannot answer (missing, slurmctld down, too slow), the result is empty
    and the reason is logged: the caller keeps what it knew."""
    if not job_ids:
        return {}
    exe = shutil.which(squeue)
    if exe is None:
        log.debug("no %s on PATH: Slurm job states unknown", squeue)
        return {}
    cmd = [exe, "-h", "--states=all", "-j", ",".join(job_ids), "-o", SQUEUE_FORMAT]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.debug("squeue: %s", e)
        return {}
    if r.returncode != 0:  # e.g. every id purged: "Invalid job id specified"
        log.debug("squeue exited %d: %s", r.returncode, r.stderr.strip())
        return {}
    return parse_squeue(r.stdout)
