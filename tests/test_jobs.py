"""Batch jobs behind workers, with no batch system: a fake ``squeue`` on PATH.

The real thing runs in tests/test_slurm.py (the ``slurm`` tier).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nbrpc.cluster import Cluster, jobs
from nbrpc.cluster.cluster import _Worker
from nbrpc.cluster.progress import Progress

FAKE_SQUEUE = """#!/bin/sh
echo "$@" >> {log}
{body}
"""


@pytest.fixture
def squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install a fake squeue answering ``body`` (shell); returns the log of its calls."""
    log = tmp_path / "calls"

    def install(body: str) -> Path:
        exe = tmp_path / "squeue"
        exe.write_text(FAKE_SQUEUE.format(log=log, body=body))
        exe.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
        return log
    return install


def test_squeue_is_asked_for_the_jobs_and_read(squeue) -> None:
    log = squeue('printf "17|PENDING|(Resources)|\\n18|RUNNING|n2|n2\\n"')
    seen = jobs.slurm_jobs(["17", "18"])
    assert log.read_text().split() == ["-h", "--states=all", "-j", "17,18", "-o",
                                       jobs.SQUEUE_FORMAT]
    assert str(seen["17"]) == "Slurm job 17 PENDING (Resources)"
    assert str(seen["18"]) == "Slurm job 18 RUNNING on n2"


@pytest.mark.parametrize("body", ["echo 'slurm_load_jobs error: Invalid job id' >&2; exit 1",
                                  "sleep 30"])
def test_a_squeue_that_fails_or_hangs_is_no_answer(squeue, monkeypatch, body: str) -> None:
    squeue(body)
    monkeypatch.setattr(jobs, "SQUEUE_TIMEOUT", 0.5)
    t0 = time.monotonic()
    assert jobs.slurm_jobs(["17"], timeout=jobs.SQUEUE_TIMEOUT) == {}
    assert time.monotonic() - t0 < 5


def test_no_squeue_is_no_answer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert jobs.slurm_jobs(["17"]) == {}


def test_the_engine_sets_job_is_found_by_its_batch_system() -> None:
    class SlurmEngineSetLauncher:
        job_id = "42"

    class LocalEngineSetLauncher:
        pass

    assert jobs.job_of(SlurmEngineSetLauncher()) == jobs.Job("slurm", "42")
    assert jobs.job_of(LocalEngineSetLauncher()) is None


def queued_cluster() -> Cluster:
    c = Cluster(launcher="slurm", host="127.0.0.1")
    c.workers = {"worker1": _Worker("worker1", 1, job=jobs.Job("slurm", "17")),
                 "worker2": _Worker("worker2", 2, job=jobs.Job("slurm", "18")),
                 "worker3": _Worker("worker3", 3)}
    return c


def test_waiting_workers_are_told_with_their_jobs_reason(squeue) -> None:
    log = squeue('printf "17|PENDING|(PartitionDown)|\\n18|RUNNING|n1|n1\\n"')
    c = queued_cluster()
    ws = list(c.workers.values())
    assert c._ask_queue(ws) and not c._ask_queue(ws)  # at most once a second
    assert len(log.read_text().splitlines()) == 1
    names = set(c.workers)
    assert c._queue_note(names) == ("worker1: Slurm job 17 PENDING (PartitionDown); "
                                    "worker2: Slurm job 18 RUNNING on n1")
    assert c._queue_note(names, waiting_only=True) == \
        "worker1: Slurm job 17 PENDING (PartitionDown)"
    assert c._ask_queue(ws, every=0)  # the timeout's last look


def test_a_job_squeue_forgot_keeps_what_was_known(squeue) -> None:
    squeue("exit 0")  # answers nothing
    c = queued_cluster()
    c.workers["worker1"].job = jobs.Job("slurm", "17", "RUNNING", nodes="n2")
    c._ask_queue(list(c.workers.values()), every=0)
    assert str(c.workers["worker1"].job) == "Slurm job 17 RUNNING on n2"


def test_progress_notes_do_not_count() -> None:
    p = Progress(2, "starting")
    p.note("worker1: Slurm job 17 PENDING (Priority)")
    assert (p.done, p.prepared, p.fraction) == (0, 0, 0.0)


def test_a_starting_cluster_shows_who_joined_and_the_jobs_without_probing(squeue) -> None:
    from conftest import local_group

    squeue('printf "17|PENDING|(Priority)|\\n"')
    c = queued_cluster()
    with local_group(["driver"], dynamic=True) as (driver,):
        c.agent, c.state = driver, "starting"
        try:
            s = c.status()
        finally:
            c.agent, c.state = None, "stopped"
    assert [(w.name, w.state, w.job) for w in s.workers] == [
        ("driver", "ready", ""), ("worker1", "starting", "Slurm job 17 PENDING (Priority)"),
        ("worker2", "starting", "Slurm job 18"), ("worker3", "starting", "")]
    assert s.summary() == "nbrpc cluster (slurm launcher): starting, 0 of 3 workers ready"


def test_only_batch_launchers_queue() -> None:
    assert Cluster(launcher="slurm", host="127.0.0.1")._queued
    assert Cluster(launcher="pbs", host="127.0.0.1")._queued
    assert not any(Cluster(launcher=name, host="127.0.0.1")._queued
                   for name in ("fork", "local", "ssh", "mpi"))
