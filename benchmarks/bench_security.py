"""What nbrpc's security costs, side by side with torch.distributed.rpc (TensorPipe).

Run it with ``.venv/bin/python benchmarks/bench_security.py``; ``--quick`` runs a
few iterations only (a smoke test), ``--markdown`` prints the table as Markdown.

Three configurations, each in its own pair of processes started with
``torch.multiprocessing.spawn`` (``init_rpc("workerN", rank=N, world_size=2)``,
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT`` per run, the ``env://``
init method, whose group key nbrpc takes from the per-user key file):

- ``torch``: ``torch.distributed.rpc`` with its default TensorPipe options
  (no authentication, no encryption): the reference.
- ``nbrpc``: ``nbrpc.rpc`` with ``TensorPipeRpcBackendOptions(encrypt=False)``,
  i.e. the defaults (set explicitly so that ``NBRPC_ENCRYPT`` in the
  environment cannot change them): a connection is admitted only with the
  group's token (ZeroMQ PLAIN checked by nbrpc's ZAP handler), and every
  message is HMAC-signed with the group key and checked against replay.
- ``nbrpc+curve``: ``TensorPipeRpcBackendOptions(encrypt=True)``: the same,
  and every connection CURVE-encrypted by libzmq (as ``NBRPC_ENCRYPT=1``).

Each process imports one RPC library; rank 0 measures and writes its results
to a JSON file that this process reads; rank 1 only serves. The remote
functions live in ``_targets.py`` so both libraries pickle them by reference.

What is measured (rank 0 calling rank 1 over loopback):

1. ``rpc_sync`` of a no-op: median and p99 round trip (µs).
2. Echo of a float32 tensor of 1 MB and 64 MB (1 MB = 2**20 bytes): median
   round trip and bandwidth = 2 * size / median round trip (GB/s = 1e9 B/s).
   On one host nbrpc sends buffers of 2 MB and more through shared memory
   (only a signed header goes by socket, so CURVE does not touch the
   bytes), and TensorPipe through its shm transport and cma channel: the
   64 MB echo mostly bypasses the sockets in all three columns.
3. "64 MB by socket": the 64 MB echo again, in a second pair of processes
   per configuration in which the bytes must cross the TCP socket: for
   nbrpc ``nbrpc.transport.shm.MIN_BYTES`` is set to 2**62 in both workers
   before ``init_rpc`` (checked: rank 0's ``bytes_sent`` counter must grow by
   the tensor's size per call), for torch
   ``TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])``.
   This is what encryption costs on bulk data.
4. Calls during a hostile flood (nbrpc configurations only): a third
   process, started by rank 0, connects a plain ``zmq.DEALER`` (no key, no
   CURVE) to rank 1's address, taken from ``nbrpc.debug.snapshot()["members"]``,
   and sends as fast as it can rounds of one 32 MB frame of zeros and 64
   frames of 200 random bytes, every other one with the fixed header's shape
   right so that rank 1 must compute its HMAC to refuse it (send high-water
   mark 4, the 32 MB buffer sent zero-copy, libzmq's reconnect interval
   10 ms; when the queue stays full for 100 ms, as when CURVE refuses the
   handshake, it drops the connection and makes a new one). Rank 0 makes
   20 untimed ``rpc_sync`` no-op calls to rank 1, then times as many as fit
   in ``flood_s`` seconds: median, p99, and the median over the quiet median
   of 1.; then, the flooder stopped, the same calls again ("after").
   Below the table: rank 1's ``snapshot()["counters"]["dropped"]`` (drop
   reason -> count, fetched by ``rpc_sync``), what the flooder's socket
   took, the connection events its socket monitor saw, and rank 1's peak
   RSS (sampled by the flooder from ``/proc``). The flooder has no key, so
   it never completes a handshake (PLAIN without the token; CURVE without
   the server key) and nothing it sends reaches nbrpc; a peer that did get
   in (a sniffed token) is the fuzz test's subject
   (``tests/test_security_fuzz.py``). To keep the machine
   alive, the flooder pauses while its target's RSS is above
   ``flood_rss_cap_mb`` (the time paused is printed).
5. Control (``nbrpc`` only): the same flood for the same time, aimed at a
   bystander process (a plain ROUTER that receives and drops every frame,
   ``recv_multipart(copy=False)``) while rank 0 calls rank 1 as in 4. On a
   2-core machine the flooder and its target take CPU time from both
   workers, which a remote attacker would not: this row is that share, and
   the difference to 4. is what rank 1 itself spends on the garbage.

Every loop is bounded and each run is killed after ``--timeout`` seconds.
Calls that raise are counted and listed under "problems"; the exit status is
1 when there are any.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _targets
import torch
import torch.multiprocessing as mp
from bench_rpc import free_port, percentile, run_steps, time_calls

SETUPS = ("torch", "nbrpc", "nbrpc+curve")
MODULES = {"torch": "torch.distributed.rpc", "nbrpc": "nbrpc.rpc", "nbrpc+curve": "nbrpc.rpc"}
PEER = "worker1"
SIZES = {"1 MB": 1 << 20, "64 MB": 64 << 20}
NO_SHM = 1 << 62  # nbrpc.transport.shm.MIN_BYTES in the "by socket" runs


@dataclasses.dataclass(frozen=True)
class Config:
    """Iteration counts: (warm-up, timed) pairs, and the flood's set-up."""

    sync: tuple[int, int] = (200, 2000)
    echo: dict[str, tuple[int, int]] = dataclasses.field(default_factory=lambda: {
        "1 MB": (10, 200), "64 MB": (2, 10)})
    socket_echo: tuple[int, int] = (2, 10)  # 64 MB by socket
    flood: tuple[int, int] = (20, 100_000)  # rpc_sync no-op calls during the flood
    flood_s: float = 10.0  # ... the timed ones stop after this long (the usual end)
    after: tuple[int, int] = (20, 500)  # ... and after it
    flood_big: int = 32 << 20
    flood_small: int = 200
    flood_smalls_per_big: int = 64
    flood_rss_cap_mb: float = 4096.0
    call_timeout_s: float = 20.0
    serve_timeout_s: float = 100.0


QUICK = Config(sync=(20, 200), echo={"1 MB": (2, 20), "64 MB": (1, 3)}, socket_echo=(1, 3),
               flood=(5, 100_000), flood_s=3.0, after=(5, 100))


# -- the flooder (a process of its own, started by rank 0) ----------------------------
def flood(address: str, pid: int, cfg: Config, ready: Any, stop: Any, results: Any) -> None:
    """Send garbage to ``address`` from a plain DEALER until ``stop`` is set; put
    what was sent, the handshake events seen and ``pid``'s peak RSS in ``results``."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    for opt, value in ((zmq.SNDHWM, 4), (zmq.LINGER, 0), (zmq.SNDTIMEO, 100),
                       (zmq.RECONNECT_IVL, 10)):
        sock.setsockopt(opt, value)
    monitor = sock.get_monitor_socket()
    sock.connect(address)
    big = bytes(cfg.flood_big)
    rng = random.Random(0)
    smalls = [_garbage(rng, cfg.flood_small, forged=i % 2 == 1) for i in range(256)]
    sent: Counter[str] = Counter()
    events: Counter[str] = Counter()
    peak = rss = _rss_of(pid)
    paused = 0.0
    next_sample = 0.0
    ready.set()
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_sample:  # rank 1's memory, and what the socket went through
            rss = _rss_of(pid)
            peak = max(peak, rss)
            next_sample = now + 0.02
            while monitor.poll(0):
                events[zmq.Event(recv_monitor_message(monitor)["event"]).name] += 1
        if rss > cfg.flood_rss_cap_mb:  # do not take the machine down
            time.sleep(0.05)
            paused += 0.05
            next_sample = 0.0
            continue
        try:
            sock.send(big, copy=False)
            sent["big"] += 1
            for _ in range(cfg.flood_smalls_per_big):
                sock.send(smalls[sent["small"] % len(smalls)])
                sent["small"] += 1
        except zmq.Again:  # the queue is full: no connection took the frames (CURVE
            sent["blocked"] += 1  # refused the handshake); a fresh one tries again
            sock.disconnect(address)
            sock.connect(address)
    while monitor.poll(0):
        events[zmq.Event(recv_monitor_message(monitor)["event"]).name] += 1
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
    ctx.term()
    results.put({"sent": dict(sent), "events": dict(events), "peak_rss_mb": peak,
                 "paused_s": paused})


def _garbage(rng: random.Random, n: int, forged: bool) -> bytes:
    """``n`` random bytes; ``forged``: with the fixed header's shape right (no flags,
    a header length of 48 at byte 32 + 20), so that the receiver must compute the
    HMAC before it can refuse the frame (else the header length rejects it first)."""
    b = bytearray(rng.randbytes(n))
    if forged:
        b[32 + 2] = 0  # flags: no DIGEST, no SHM
        b[32 + 20:32 + 24] = (48).to_bytes(4, "little")
    return bytes(b)


def sink(endpoints: Any, stop: Any) -> None:
    """The control: a plain ROUTER on a free port that receives and drops everything."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    endpoints.put(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    received = 0
    while not stop.is_set():
        if sock.poll(100):
            sock.recv_multipart(copy=False)
            received += 1
    sock.close(linger=0)
    ctx.term()
    endpoints.put(received)


def _rss_of(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


# -- rank 0's benchmarks ------------------------------------------------------------
def bench_sync(rpc: Any, reps: tuple[int, int], failures: list[str],
               key: str = "sync") -> dict[str, float]:
    samples = time_calls(lambda: rpc.rpc_sync(PEER, _targets.noop), *reps, failures)
    return {f"{key}_median_us": statistics.median(samples) * 1e6,
            f"{key}_p99_us": percentile(samples, 99) * 1e6}


def bench_echo(rpc: Any, label: str, reps: tuple[int, int], failures: list[str],
               sent: Callable[[], int] | None = None) -> dict[str, float]:
    """Echo a tensor of SIZES[label]; with ``sent`` (rank 0's socket byte counter),
    also the bytes that went by socket per call."""
    nbytes = SIZES[label.removesuffix(" by socket")]
    x = torch.randn(nbytes // 4, dtype=torch.float32)
    before = sent() if sent else 0
    samples = time_calls(lambda: rpc.rpc_sync(PEER, _targets.echo, args=(x,)), *reps, failures)
    out = {}
    if sent:
        out[f"echo_{label}_socket_bytes"] = (sent() - before) / sum(reps)
    back = rpc.rpc_sync(PEER, _targets.echo, args=(x,))  # checked after timing
    if not (isinstance(back, torch.Tensor) and torch.equal(back, x)):
        raise AssertionError(f"echo of {label} returned a different tensor")
    med = statistics.median(samples)
    return {**out, f"echo_{label}_us": med * 1e6, f"echo_{label}_gbps": 2 * nbytes / med / 1e9}


@contextlib.contextmanager
def flooding(address: str, pid: int, cfg: Config, report: dict[str, Any]) -> Iterator[None]:
    """A :func:`flood` process sending garbage to ``address`` for the block's
    duration; its report (and ``pid``'s peak RSS) goes into ``report``."""
    spawn = multiprocessing.get_context("spawn")
    ready, stop, results = spawn.Event(), spawn.Event(), spawn.Queue()
    proc = spawn.Process(target=flood, args=(address, pid, cfg, ready, stop, results),
                         daemon=True)
    proc.start()
    try:
        if not ready.wait(60.0):
            raise RuntimeError("the flooder did not start within 60 s")
        time.sleep(0.2)  # let the flood get going
        yield
    finally:
        stop.set()
        try:
            report.update(results.get(timeout=30.0))
        except Exception as e:
            report["error"] = f"{type(e).__name__}: {e}"
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()


@contextlib.contextmanager
def sinking(report: dict[str, Any]) -> Iterator[tuple[str, int]]:
    """A :func:`sink` process for the block's duration: (its address, its pid)."""
    spawn = multiprocessing.get_context("spawn")
    endpoints, stop = spawn.Queue(), spawn.Event()
    proc = spawn.Process(target=sink, args=(endpoints, stop), daemon=True)
    proc.start()
    try:
        yield endpoints.get(timeout=60.0), proc.pid
    finally:
        stop.set()
        try:
            report["received"] = endpoints.get(timeout=10.0)
        except Exception as e:
            report["error"] = f"{type(e).__name__}: {e}"
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()


def time_flooded(rpc: Any, cfg: Config, key: str, failures: list[str]) -> dict[str, float]:
    """rpc_sync no-op calls to rank 1: ``cfg.flood[0]`` untimed, then timed ones
    for ``cfg.flood_s`` (at most ``cfg.flood[1]``); each may take ``cfg.call_timeout_s``."""
    warmup, timed = cfg.flood
    samples: list[float] = []
    t_end = None
    for i in range(warmup + timed):
        if i == warmup:
            t_end = time.perf_counter() + cfg.flood_s
        elif t_end is not None and time.perf_counter() > t_end:
            break
        t = time.perf_counter()
        try:
            rpc.rpc_sync(PEER, _targets.noop, timeout=cfg.call_timeout_s)
        except Exception as e:
            failures.append(f"{key} call {i}: {type(e).__name__}: {e}")
            continue
        if i >= warmup:
            samples.append(time.perf_counter() - t)
    if not samples:
        raise RuntimeError(f"no call succeeded ({key}); first: {failures[:1]}")
    return {f"{key}_median_us": statistics.median(samples) * 1e6,
            f"{key}_p99_us": percentile(samples, 99) * 1e6, f"{key}_calls": len(samples)}


def bench_flood(rpc: Any, cfg: Config, rec: dict[str, Any], failures: list[str]) -> dict:
    """rpc_sync no-op to rank 1 while a flooder process sends it garbage, then after."""
    from nbrpc import debug

    address = next(m["address"] for m in debug.snapshot(events=0)["members"]
                   if m["name"] == PEER)
    with flooding(address, rpc.rpc_sync(PEER, os.getpid), cfg, rec.setdefault("flooder", {})):
        out = time_flooded(rpc, cfg, "flood", failures)
    out.update(bench_sync(rpc, cfg.after, failures, key="after"))
    rec["dropped"] = rpc.rpc_sync(PEER, debug.snapshot, args=(0,))["counters"]["dropped"]
    return out


def bench_control(rpc: Any, cfg: Config, rec: dict[str, Any], failures: list[str]) -> dict:
    """The same flood aimed at a bystander process (:func:`sink`): what the machine
    being busy costs the calls, without rank 1 receiving any garbage."""
    report = rec.setdefault("control", {})
    with sinking(report) as (address, pid), flooding(address, pid, cfg, report):
        return time_flooded(rpc, cfg, "control", failures)


def measure(rpc: Any, setup: str, socket: bool, cfg: Config, rec: dict[str, Any],
            save: Callable[[], None]) -> None:
    sent = None
    if setup != "torch":
        from nbrpc import debug

        def sent() -> int:
            return debug.snapshot(events=0)["counters"]["bytes_sent"]

    if socket:
        steps = [("echo 64 MB by socket", sum(cfg.socket_echo),
                  lambda f: bench_echo(rpc, "64 MB by socket", cfg.socket_echo, f, sent))]
    else:
        steps = [("rpc_sync", sum(cfg.sync), lambda f: bench_sync(rpc, cfg.sync, f))]
        steps += [(f"echo {label}", sum(reps),
                   lambda f, label=label, reps=reps: bench_echo(rpc, label, reps, f, sent))
                  for label, reps in cfg.echo.items()]
        if setup != "torch":
            steps.append(("flood", sum(cfg.flood) + sum(cfg.after),
                          lambda f: bench_flood(rpc, cfg, rec, f)))
        if setup == "nbrpc":
            steps.append(("flood of a bystander", sum(cfg.flood),
                          lambda f: bench_control(rpc, cfg, rec, f)))
    run_steps(steps, rec, save)


# -- the spawned worker ------------------------------------------------------------
def backend_options(rpc: Any, setup: str, socket: bool) -> Any:
    if setup == "torch":
        return (rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])
                if socket else rpc.TensorPipeRpcBackendOptions())
    return rpc.TensorPipeRpcBackendOptions(encrypt=setup == "nbrpc+curve")


def _worker(rank: int, setup: str, socket: bool, port: int, outdir: str, cfg: Config) -> None:
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    rec: dict[str, Any] = {"rank": rank}
    out = Path(outdir) / f"rank{rank}.json"

    def save() -> None:  # after every step, so a run killed at its deadline still reports
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, out)

    rpc = importlib.import_module(MODULES[setup])
    if socket and setup != "torch":
        from nbrpc.transport import shm

        shm.MIN_BYTES = NO_SHM  # every buffer by socket (both ways: both workers)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 rpc_backend_options=backend_options(rpc, setup, socket))
    save()
    try:
        if rank == 0:
            try:
                measure(rpc, setup, socket, cfg, rec, save)
            except Exception:
                rec["fatal"] = traceback.format_exc()
            finally:
                try:
                    rpc.rpc_sync(PEER, _targets.release)
                except Exception as e:
                    rec.setdefault("errors", {})["release"] = f"{type(e).__name__}: {e}"
        else:
            rec["released"] = _targets.wait_released(cfg.serve_timeout_s)
    finally:
        save()
        rpc.shutdown()


# -- the parent --------------------------------------------------------------------
def run_setup(setup: str, socket: bool, port: int, cfg: Config,
              limit_s: float) -> dict[str, Any]:
    """Spawn the two workers of one configuration, wait (bounded), collect their records."""
    with tempfile.TemporaryDirectory(prefix="bench_security_") as outdir:
        t = time.perf_counter()
        ctx = mp.spawn(_worker, args=(setup, socket, port, outdir, cfg), nprocs=2, join=False)
        problem = None
        deadline = time.monotonic() + limit_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    problem = f"timed out after {limit_s:g} s (processes killed)"
                    break
        except Exception as e:  # a worker raised or died: torch reports it here
            lines = str(e).strip().splitlines()
            problem = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        res: dict[str, Any] = {"wall_s": time.perf_counter() - t, "problem": problem}
        for rank in (0, 1):
            try:
                res[f"rank{rank}"] = json.loads((Path(outdir) / f"rank{rank}.json").read_text())
            except (OSError, ValueError):
                res[f"rank{rank}"] = {}
    return res


def problems(results: dict[tuple[str, bool], dict[str, Any]]) -> list[str]:
    out = []
    for (setup, socket), res in results.items():
        who = setup + (" (by socket)" if socket else "")
        if res["problem"]:
            out.append(f"{who}: {res['problem']}")
        for rank in (0, 1):
            rec = res[f"rank{rank}"]
            if not rec:
                out.append(f"{who}: rank {rank} wrote no results")
            if rec.get("fatal"):
                out.append(f"{who}: rank {rank} failed:\n{rec['fatal']}")
            for name, err in rec.get("errors", {}).items():
                out.append(f"{who}: {name}: {err}")
            if rank == 1 and rec and rec.get("released") is False:
                out.append(f"{who}: rank 1 was never released (served until its timeout)")
        for part in ("flooder", "control"):
            error = (res["rank0"].get(part) or {}).get("error")
            if error:
                out.append(f"{who}: {part}: {error}")
        per_call = res["rank0"].get("metrics", {}).get("echo_64 MB by socket_socket_bytes")
        if socket and per_call is not None and per_call < SIZES["64 MB"]:
            out.append(f"{who}: only {per_call / 2**20:.1f} MiB went by socket per 64 MB echo")
    return out


# -- the table ---------------------------------------------------------------------
RATIOS = (("nbrpc", "torch"), ("nbrpc+curve", "nbrpc"))
HEADER = ["metric", *SETUPS, "nbrpc/torch", "curve/nbrpc"]


@dataclasses.dataclass
class Row:
    metric: str
    values: dict[str, float | None]  # by setup
    fmt: str = "{:.1f}"
    ranges: dict[tuple[str, str], tuple[float, float]] = dataclasses.field(
        default_factory=dict)  # per ratio: lowest and highest over the repetitions

    def ratio(self, a: str, b: str) -> float | None:
        x, y = self.values.get(a), self.values.get(b)
        return None if x is None or not y else x / y


def merge_repetitions(reps: list[list[Row]]) -> list[Row]:
    """One row per metric: each value's median over the repetitions, and the
    range of each per-repetition ratio (the noise)."""
    merged = []
    for versions in zip(*reps, strict=True):
        values = {}
        for setup in SETUPS:
            got = [v for v in (r.values[setup] for r in versions) if v is not None]
            values[setup] = statistics.median(got) if got else None
        ranges = {}
        for pair in RATIOS:
            ratios = [x for x in (r.ratio(*pair) for r in versions) if x is not None]
            if len(ratios) > 1:
                ranges[pair] = (min(ratios), max(ratios))
        merged.append(dataclasses.replace(versions[0], values=values, ranges=ranges))
    return merged


def build_rows(results: dict[tuple[str, bool], dict[str, Any]]) -> list[Row]:
    def metric(key: str, socket: bool = False) -> dict[str, float | None]:
        return {s: results[s, socket]["rank0"].get("metrics", {}).get(key) for s in SETUPS}

    def slowdown(key: str) -> dict[str, float | None]:
        flood, quiet = metric(f"{key}_median_us"), metric("sync_median_us")
        return {s: flood[s] / quiet[s] if flood[s] and quiet[s] else None for s in SETUPS}

    rows = [Row("rpc_sync no-op, median (µs)", metric("sync_median_us")),
            Row("rpc_sync no-op, p99 (µs)", metric("sync_p99_us"))]
    for label in SIZES:
        rows += [Row(f"echo {label} tensor, median RTT (µs)", metric(f"echo_{label}_us"),
                     "{:.0f}"),
                 Row(f"echo {label} tensor, bandwidth (GB/s)", metric(f"echo_{label}_gbps"),
                     "{:.3f}")]
    label = "64 MB by socket"
    rows += [
        Row(f"echo {label}, median RTT (µs)", metric(f"echo_{label}_us", True), "{:.0f}"),
        Row(f"echo {label}, bandwidth (GB/s)", metric(f"echo_{label}_gbps", True), "{:.3f}"),
        Row("rpc_sync no-op during the flood, median (µs)", metric("flood_median_us")),
        Row("rpc_sync no-op during the flood, p99 (µs)", metric("flood_p99_us")),
        Row("… flood median / quiet median (x)", slowdown("flood"), "{:.2f}"),
        Row("rpc_sync no-op after the flood, median (µs)", metric("after_median_us")),
        Row("control: the flood hits a bystander process, median (µs)",
            metric("control_median_us")),
        Row("control: p99 (µs)", metric("control_p99_us")),
        Row("… control median / quiet median (x)", slowdown("control"), "{:.2f}"),
    ]
    return rows


def _cells(row: Row) -> list[str]:
    def num(v: float | None, fmt: str) -> str:
        return "n/a" if v is None else fmt.format(v)

    def ratio(pair: tuple[str, str]) -> str:
        cell = num(row.ratio(*pair), "{:.2f}x")
        if pair in row.ranges:
            cell += " ({:.2f}–{:.2f})".format(*row.ranges[pair])
        return cell

    return [row.metric, *(num(row.values[s], row.fmt) for s in SETUPS),
            *(ratio(pair) for pair in RATIOS)]


def render_text(rows: list[Row]) -> str:
    table = [HEADER] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]

    def fmt(line: list[str]) -> str:
        return "  ".join([line[0].ljust(widths[0]),
                          *(c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True))])

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(HEADER), rule] + [fmt(line) for line in table[1:]])


def render_markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |",
             "|" + "|".join([":---"] + ["---:"] * (len(HEADER) - 1)) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def describe(cfg: Config, quick: bool) -> list[str]:
    echo = ", ".join(f"{k}: {w}+{n}" for k, (w, n) in cfg.echo.items())
    return [
        f"nbrpc's security vs torch.distributed.rpc (TensorPipe){' [--quick]' if quick else ''}",
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} "
        f"CPUs, {platform.machine()}; 2 processes on 127.0.0.1 (+1 flooder); load average at "
        f"the end {os.getloadavg()[0]:.2f} (other work on the machine skews the numbers)",
        f"iterations (warm-up+timed): rpc_sync {cfg.sync[0]}+{cfg.sync[1]}; echo {echo}; "
        f"64 MB by socket {cfg.socket_echo[0]}+{cfg.socket_echo[1]}; during the flood "
        f"{cfg.flood[0]} + as many as fit in {cfg.flood_s:g} s, after it "
        f"{cfg.after[0]}+{cfg.after[1]}",
        "nbrpc: connections admitted by token, every message HMAC-signed and replay-checked; "
        "nbrpc+curve: the same, every "
        "connection CURVE-encrypted (TensorPipeRpcBackendOptions(encrypt=True)); torch: no "
        "authentication, no encryption",
        "bandwidth = 2 * tensor size / median round trip (GB/s = 1e9 B/s; 1 MB = 2**20 B)",
        "64 MB: on one host nbrpc moves buffers ≥ 2 MB through shared memory (only the "
        "signed header crosses the socket, so CURVE never sees the bytes) and TensorPipe "
        "through its shm transport / cma channel",
        "64 MB by socket: separate runs with nbrpc.transport.shm.MIN_BYTES = 2**62 in both "
        "nbrpc workers (before init_rpc), and torch with _transports=['uv'], "
        "_channels=['basic']: the bytes cross TCP (and, for curve, libsodium)",
        f"flood (nbrpc only): another process sends rank 1 rounds of one "
        f"{cfg.flood_big >> 20} MB zero frame + {cfg.flood_smalls_per_big} frames of "
        f"{cfg.flood_small} random bytes (half with a well-formed header) from a plain zmq "
        "DEALER (no key, no CURVE: its handshakes fail) as fast as it can, while rank 0 "
        "calls rank 1",
        "control: the same flood aimed at a bystander process that drops every frame, "
        "while rank 0 calls rank 1: the cost of the machine being busy (2 cores), not of "
        "rank 1 handling garbage",
    ]


def _flooder_note(f: dict[str, Any], cfg: Config) -> str:
    sent = f.get("sent", {})
    gb = (sent.get("big", 0) * cfg.flood_big + sent.get("small", 0) * cfg.flood_small) / 1e9
    events = ", ".join(f"{k} {v}" for k, v in sorted(f.get("events", {}).items()))
    return (f"the flooder's socket took {sent.get('big', 0)} big + {sent.get('small', 0)} "
            f"small frames ({gb:.2f} GB) and was full {sent.get('blocked', 0)} times "
            f"(100 ms each, then reconnected); its monitor saw {events or 'no events'}; the target's peak RSS "
            f"{f.get('peak_rss_mb', 0):.0f} MiB, the flood paused {f.get('paused_s', 0):.1f} s "
            "for RSS above the cap")


def flood_notes(results: dict[tuple[str, bool], dict[str, Any]], cfg: Config) -> list[str]:
    lines = []
    for setup in SETUPS[1:]:
        rec = results[setup, False]["rank0"]
        metrics = rec.get("metrics", {})
        f = rec.get("flooder") or {}
        if f.get("sent") is None:
            lines.append(f"{setup}, flood: no report from the flooder")
        else:
            lines.append(f"{setup}, flood: {metrics.get('flood_calls', 0):.0f} timed calls; "
                         f"{_flooder_note(f, cfg)}; rank 1's dropped counters afterwards: "
                         f"{rec.get('dropped', 'n/a')}")
        by_shm = metrics.get("echo_64 MB_socket_bytes")
        by_socket = results[setup, True]["rank0"].get("metrics", {}).get(
            "echo_64 MB by socket_socket_bytes")
        if by_shm is not None and by_socket is not None:
            lines.append(f"{setup}: bytes that crossed rank 0's socket per 64 MB echo "
                         f"(its bytes_sent counter): {by_shm / 1024:.1f} KiB by default, "
                         f"{by_socket / 2**20:.1f} MiB in the by-socket run")
        c = rec.get("control") or {}
        if c.get("sent") is not None:
            lines.append(f"{setup}, control (flood of a bystander ROUTER that drops every "
                         f"frame): {metrics.get('control_calls', 0):.0f} timed calls; "
                         f"{_flooder_note(c, cfg)}; the bystander received "
                         f"{c.get('received', 'n/a')} frames")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few iterations (a smoke test)")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds after which one configuration's processes are killed "
                         "(default 100, 60 with --quick)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="run every configuration this many times, the order reversed "
                         "every other time, and report medians (default 2, 1 with --quick)")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    limit = args.timeout or (60.0 if args.quick else 100.0)
    cfg = dataclasses.replace(cfg, serve_timeout_s=limit)
    repeat = max(1, args.repeat or (1 if args.quick else 2))
    ports: set[int] = set()
    reps: list[list[Row]] = []
    notes: list[str] = []
    issues: list[str] = []
    for rep in range(repeat):
        results: dict[tuple[str, bool], dict[str, Any]] = {}
        order = [(setup, socket) for socket in (False, True) for setup in SETUPS]
        for setup, socket in order if rep % 2 == 0 else order[::-1]:
            port = free_port(ports)
            ports.add(port)
            what = f"{setup}{' (64 MB by socket)' if socket else ''}"
            print(f"[{rep + 1}/{repeat}] running {what} (MASTER_PORT={port}) ...",
                  file=sys.stderr, flush=True)
            results[setup, socket] = run_setup(setup, socket, port, cfg, limit)
            print(f"  done in {results[setup, socket]['wall_s']:.1f} s", file=sys.stderr,
                  flush=True)
        reps.append(build_rows(results))
        tag = f"repetition {rep + 1}: " if repeat > 1 else ""
        notes += [tag + line for line in flood_notes(results, cfg)]
        issues += [tag + line for line in problems(results)]
    bullet = "- " if args.markdown else ""
    print("\n".join(bullet + line for line in describe(cfg, args.quick)))
    if repeat > 1:
        print(f"{bullet}values: median over {repeat} repetitions (for 2, their mean); in "
              "brackets the lowest and highest per-repetition ratio")
    print()
    rows = merge_repetitions(reps)
    print(render_markdown(rows) if args.markdown else render_text(rows))
    print()
    print("\n".join(bullet + line for line in notes))
    if issues:
        print("\nproblems:")
        print("\n".join(f"- {p}" for p in issues))
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main())
