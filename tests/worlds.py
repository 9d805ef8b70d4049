"""Worlds of real processes for the multiprocess tiers: spawned once per module,
each child reporting one row per step, the parent collecting the rows.

A test module describes its worlds (which phases each rank runs) and writes a
``_child(rank, world, port, results, sync)`` that runs them inside
:func:`child`; its module fixture returns ``world_cache(lambda name:
run_world(name, _child, ...))``, so that each world is spawned by the first
test that asks for it (a module with a single world may return
``run_world(...)`` itself), and the tests read the rows through :class:`World`.
``sync`` is whatever the children share: barriers and events made from the
spawn context, and anything else a world needs (more free ports, a path).

Rows are dicts with ``world``, ``phase``, ``name``, ``rank``, ``ok`` and
whatever else the step reports (``secs``, ``info``, ``error``, ``pid``); a
child that crashes reports a ``<crash>`` row with its traceback.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from conftest import free_ports


@dataclass
class World:
    """What the processes of one spawned world reported: one row per step
    (``phase``, ``name``, ``rank``, ``ok``, ``error``, ...), and how they exited."""

    name: str
    rows: list
    exitcodes: list
    secs: float

    def row(self, phase: str, name: str, rank: int) -> dict:
        for r in self.rows:
            if (r["phase"], r["name"], r["rank"]) == (phase, name, rank):
                return r
        crashes = [r["error"] for r in self.rows if r["name"] == "<crash>"]
        pytest.fail(f"no row {phase}/{name} from rank {rank} in world {self.name!r} "
                    f"(exit codes {self.exitcodes}); crashes: {crashes}", pytrace=False)

    def ok(self, phase: str, name: str, rank: int) -> dict:
        r = self.row(phase, name, rank)
        if not r["ok"]:
            pytest.fail(f"{self.name}/{phase} {name} on rank {rank} failed:\n{r['error']}",
                        pytrace=False)
        return r


def world_cache(run: Callable[[str], World]) -> Callable[[str], World]:
    """``run(name)`` once per name: a module fixture returns this, so that each
    world is spawned by the first test that asks for it."""
    cache: dict[str, World] = {}

    def get(name: str) -> World:
        if name not in cache:
            cache[name] = run(name)
        return cache[name]

    return get


def run_world(name: str, child: Callable, nprocs: int, timeout: float,
              sync: Callable[..., dict], ports: int = 1) -> World:
    """Spawn ``child(rank, name, port, results, sync(ctx, *more))`` in ``nprocs``
    processes (``ctx``: the spawn context, for its barriers and events) and
    collect their rows (see :func:`spawn_world`). ``ports`` distinct free ports
    are found: ``port`` (the group's MASTER_PORT) and ``more``, the rest."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, *more = free_ports(ports)
    return spawn_world(name, child, (name, port, results, sync(ctx, *more)), nprocs, results,
                       timeout)


def spawn_world(name: str, child: Callable, args: tuple, nprocs: int, results: Any,
                timeout: float) -> World:
    """``mp.spawn(child, args)`` without joining; collect what the children put on
    ``results`` until they exit or ``timeout`` passes, then kill the ones still
    alive (only ours, by their handles)."""
    t0 = time.monotonic()
    procs = mp.spawn(child, args=args, nprocs=nprocs, join=False)
    rows: list = []
    deadline = t0 + timeout
    while any(p.is_alive() for p in procs.processes) and time.monotonic() < deadline:
        try:
            rows.append(results.get(timeout=0.1))
        except queue.Empty:
            pass
    for p in procs.processes:
        if p.is_alive():
            p.kill()
        p.join(5)
    while True:
        try:
            rows.append(results.get(timeout=0.2))
        except queue.Empty:
            break
    results.close()
    for f in procs.error_files:  # spawn's per-process error files (written on a crash)
        Path(f).unlink(missing_ok=True)
    return World(name, rows, [p.exitcode for p in procs.processes], time.monotonic() - t0)


# -- the child's side ------------------------------------------------------------------
@dataclass
class Reporter:
    """A child's rows, put on the parent's queue."""

    results: Any
    world: str
    rank: int

    def write(self, phase: str, name: str, ok: bool = True, **row: Any) -> None:
        self.results.put(dict(row, world=self.world, phase=phase, name=name, rank=self.rank,
                              ok=ok))

    def attempt(self, phase: str, name: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` and report it as one row: its result as ``info``, or its traceback."""
        info, error, secs = outcome(fn)
        self.write(phase, name, ok=error is None, secs=secs, info=info, error=error)


def outcome(fn: Callable[[], Any]) -> tuple[Any, str | None, float]:
    """(``fn()``, None, seconds), or (None, its traceback, seconds) if it raised."""
    t0 = time.monotonic()
    try:
        return fn(), None, time.monotonic() - t0
    except BaseException:
        return None, traceback.format_exc(), time.monotonic() - t0


def await_death(results: Any, ready: Any, timeout: float, code: int = 3) -> None:
    """A victim's last steps: flush its rows (so that it holds no queue lock when it
    is killed), set the event ``ready``, and wait to be killed; if nobody has killed
    it after ``timeout`` s, exit with ``code`` (the parent sees that, not -9)."""
    results.close()
    results.join_thread()
    ready.set()
    time.sleep(timeout)  # a hold, not a wait for an event: the killer's SIGKILL ends it
    os._exit(code)


@contextmanager
def child(rank: int, world: str, port: int, results: Any) -> Iterator[Reporter]:
    """A spawned child's frame: its group's rendezvous address in the environment,
    a ``<crash>`` row for whatever escapes, and no watchdog left armed (the
    body arms ``faulthandler.dump_traceback_later`` as its steps need)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    report = Reporter(results, world, rank)
    try:
        yield report
    except BaseException:
        report.write("?", "<crash>", ok=False, error=traceback.format_exc())
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
