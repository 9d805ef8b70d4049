"""Torch's and BLAS's threads per cluster worker (nbrpc.cluster.threads) with
no engines: the plan from each worker's CPUs, the option's checks, what a worker reports.
On real engines: tests/test_cluster.py (marked ``cluster``)."""

from __future__ import annotations

import os
import threading

import numpy  # noqa: F401 - its BLAS library is what apply() sets (torch loads it too)
import pytest
import torch
from threadpoolctl import ThreadpoolController

from nbrpc.cluster import Cluster, threads
from nbrpc.cluster.engine import describe
from nbrpc.cluster.threads import CpuShare, plan


def test_workers_on_the_same_cpus_divide_them_and_others_keep_theirs() -> None:
    shares = {"worker1": CpuShare(8, "host-a"), "worker2": CpuShare(8, "host-a"),
              "worker3": CpuShare(8, "host-a"), "worker4": CpuShare(4, "host-b"),
              "worker5": CpuShare(1, "host-c"), "worker6": CpuShare(1, "host-c")}
    assert plan("auto", shares) == {"worker1": 2, "worker2": 2, "worker3": 2, "worker4": 4,
                                    "worker5": 1, "worker6": 1}  # (never 0)


def test_a_worker_whose_environment_sets_omp_num_threads_keeps_it_but_still_counts() -> None:
    shares = {"worker1": CpuShare(4, "a"), "worker2": CpuShare(4, "a", omp_env="4")}
    assert plan("auto", shares) == {"worker1": 2}
    assert plan(3, shares) == {"worker1": 3, "worker2": 3}  # a number is the user's choice
    assert plan(None, shares) == {}


def test_this_process_share_names_its_cpus_and_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    mine = threads.cpu_share()
    assert mine == threads.cpu_share()  # the same process: the same CPU set
    assert mine.cpus == len(os.sched_getaffinity(0)) and mine.omp_env is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.cpu_share().omp_env == "3"


@pytest.mark.parametrize("bad", [0, -1, 1.5, "all", True])
def test_a_cluster_refuses_a_thread_count_it_cannot_use(bad: object) -> None:
    with pytest.raises(ValueError, match="torch_threads must be 'auto', None or a whole number"):
        Cluster(torch_threads=bad)  # (before anything starts)


def test_apply_sets_torch_and_the_environment_of_processes_started_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # (so that the test's end restores it)
    try:
        assert threads.apply(1) == 1 == torch.get_num_threads()
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def test_a_workers_status_reports_its_torch_threads() -> None:
    assert describe(None)["torch_threads"] == torch.get_num_threads()


@pytest.fixture()
def blas_at_two(monkeypatch: pytest.MonkeyPatch):
    """numpy's BLAS libraries at 2 threads for the test, and back as they were after it."""
    for var in ("OMP_NUM_THREADS", *threads.BLAS_ENV["openblas"], "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "7")  # (so that the test's end restores it)
        monkeypatch.delenv(var)
    ctl = ThreadpoolController().select(user_api="blas")
    if not ctl.lib_controllers:
        pytest.skip("numpy here has no BLAS library threadpoolctl knows")
    before = [lib.num_threads for lib in ctl.lib_controllers]
    torch_before = torch.get_num_threads()
    for lib in ctl.lib_controllers:
        lib.set_num_threads(2)
    assert threads.blas_threads().endswith(" 2")
    yield
    torch.set_num_threads(torch_before)
    for lib, n in zip(ctl.lib_controllers, before):
        lib.set_num_threads(n)
        getattr(lib, "clear_controlling_thread", lambda: None)()  # (threadpoolctl >= 3.8)


@pytest.mark.usefixtures("blas_at_two")
def test_apply_sets_numpys_blas_threads_too() -> None:
    threads.apply(1)
    apis = [part.split()[0] for part in threads.blas_threads().split(", ")]
    assert threads.blas_threads() == ", ".join(f"{api} 1" for api in apis)


@pytest.mark.usefixtures("blas_at_two")
def test_after_apply_the_users_own_limits_still_work_on_other_threads() -> None:
    """(threadpoolctl 3.8 lets only the first thread that set OpenBLAS's pool set it
    again: apply() must not keep that role for the engine's main thread.)"""
    threads.apply(1)
    other = threading.Thread(target=lambda: [
        lib.set_num_threads(2)
        for lib in ThreadpoolController().select(user_api="blas").lib_controllers])
    other.start()
    other.join(10)
    assert threads.blas_threads().endswith(" 2") and " 1" not in threads.blas_threads()


@pytest.mark.usefixtures("blas_at_two")
def test_a_blas_library_whose_own_variable_is_set_keeps_its_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        monkeypatch.setenv(var, "2")
    threads.apply(1)
    assert torch.get_num_threads() == 1
    assert threads.blas_threads().endswith(" 2") and " 1" not in threads.blas_threads()


def test_a_workers_status_reports_its_blas_threads() -> None:
    assert describe(None)["blas_threads"] == threads.blas_threads() != ""


def test_the_blas_libraries_are_looked_for_again_only_after_an_import(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(Looking walks every loaded library, 0.8 ms; a live view's probes read the
    counts twice a second.)"""
    import sys
    import types

    import threadpoolctl

    looks = []
    init = threadpoolctl.ThreadpoolController.__init__
    monkeypatch.setattr(threadpoolctl.ThreadpoolController, "__init__",
                        lambda self: looks.append(1) or init(self))
    monkeypatch.setattr(threads, "_blas", (-1, []))
    first = threads.blas_threads()
    assert threads.blas_threads() == first and len(looks) == 1  # (nothing imported since)
    monkeypatch.setitem(sys.modules, "an_extension_just_imported", types.ModuleType("x"))
    assert threads.blas_threads() == first and len(looks) == 2
