"""Where an nbrpc ``rpc_sync`` spends its time, stage by stage.

``python benchmarks/bench_breakdown.py`` starts two processes (as
``bench_rpc.py`` does: ``torch.multiprocessing.spawn`` + ``init_rpc``); rank 0
calls ``operator.pos(1)`` on rank 1 ``--calls`` times. Both processes stamp
each message with ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for
every process on the host) at the seams of the call path, by wrapping
nbrpc's own functions in this script (the library is not changed):

=====  =========================================  ================================
stage  from → to                                  what it is
=====  =========================================  ================================
1      rpc_sync called → IOLoop.send entered      caller: checks, pickling, bookkeeping
2      → IOLoop.send returned                     caller: signing, send
3      → callee's reading thread dispatches it    the kernel (over TCP also zmq's
                                                  I/O threads), recv, MAC check, unpack
4      → a thread starts serving it               callee: hand-off to the pool (none
                                                  on a channel: its thread serves)
5      → the handler starts                       callee: unpickling
6      → the handler returns                      the function itself
7      → IOLoop.send entered (the answer)         callee: pickling the answer
8      → IOLoop.send returned                     callee: signing, send
9      → caller's reading thread dispatches it    as 3, the other way (on a channel:
                                                  the calling thread reads it)
10     → the future is completed                  caller: unpickling, matching
11     → rpc_sync returns                         caller: waking the waiting thread
                                                  (none on a channel)
=====  =========================================  ================================

Medians per stage (µs), and the sum of the medians against the median total,
for connections over the Unix domain socket (peers on one host, the default:
``rpc_sync`` goes over the calling thread's own channel, see
:mod:`nbrpc.transport.channel`) and over loopback TCP (``local_ipc=False``:
the I/O threads and the pool). The wrappers cost ~1 µs a stamp,
so totals run ~10 µs above ``bench_rpc.py``'s.
"""

from __future__ import annotations

import argparse
import bisect
import json
import operator
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

STAGES = [
    "caller: checks, pickling, bookkeeping",
    "caller: signing + send",
    "transport to the callee's reading thread",
    "callee: hand-off to the pool (none on a channel)",
    "callee: unpickling",
    "the handler (operator.pos)",
    "callee: pickling the answer",
    "callee: signing + send",
    "transport back to the caller's reading thread",
    "caller: unpickling, completing the future",
    "caller: waking the waiting thread (none on a channel)",
]


def _instrument(stamps: dict[int, dict[str, float]]) -> None:
    """Wrap the seams of the call path; stamps[msg_id][point] = perf_counter()."""
    from nbrpc.agent.agent import Agent
    from nbrpc.agent.callee import Callee
    from nbrpc.agent.caller import Caller
    from nbrpc.agent.messages import REQUEST, RESPONSE
    from nbrpc.transport.io import IOLoop

    clock = time.perf_counter
    send, on_message, serve, complete = (IOLoop.send, Agent.dispatch, Callee.serve,
                                         Caller.complete)

    def timed_send(self, peer, kind, msg_id, payload, buffers=(), via=None, **more):
        t0 = clock()
        n = send(self, peer, kind, msg_id, payload, buffers, via, **more)
        if kind in (REQUEST, RESPONSE):
            stamps.setdefault(msg_id, {}).update({f"send0.{kind}": t0, f"send1.{kind}": clock()})
        return n

    def timed_on_message(self, env):
        if env.kind in (REQUEST, RESPONSE):
            stamps.setdefault(env.msg_id, {})[f"in.{env.kind}"] = clock()
        return on_message(self, env)

    def timed_serve(self, env):
        stamps.setdefault(env.msg_id, {})["pool"] = clock()
        return serve(self, env)

    def timed_complete(self, env):
        complete(self, env)
        stamps.setdefault(env.msg_id, {})["done"] = clock()

    IOLoop.send, Agent.dispatch = timed_send, timed_on_message
    Callee.serve, Caller.complete = timed_serve, timed_complete


def _worker(rank: int, port: int, outdir: str, calls: int, ipc: bool) -> None:
    from nbrpc import rpc
    from nbrpc.agent import current_agent
    from nbrpc.rpc import TensorPipeRpcBackendOptions

    stamps: dict[int, dict[str, float]] = {}
    _instrument(stamps)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    opts = TensorPipeRpcBackendOptions(local_ipc=ipc)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    agent = current_agent()
    served: list = []
    if rank == 1:
        handler = agent.handlers["call"]

        def stamped_call(msg: Any, sender: int) -> Any:
            t0 = time.perf_counter()
            try:
                return handler(msg, sender)
            finally:
                served.append((t0, time.perf_counter()))

        agent.handlers["call"] = stamped_call
    if rank == 0:
        rows = []
        for i in range(calls + 200):
            before = set(stamps)
            t0 = time.perf_counter()
            rpc.rpc_sync("w1", operator.pos, args=(1,))
            t1 = time.perf_counter()
            mids = [m for m in stamps if m not in before]
            if i >= 200 and len(mids) == 1:
                rows.append({"mid": mids[0], "c0": t0, "end": t1, **stamps[mids[0]]})
        peer = rpc.rpc_sync("w1", _their_stamps, args=())
        Path(outdir, "result.json").write_text(json.dumps({"rows": rows, "peer": peer}))
    else:
        _SERVED.extend([stamps, served])
    rpc.shutdown()


_SERVED: list = []


def _their_stamps() -> dict:
    stamps, served = _SERVED
    return {"stamps": {str(k): v for k, v in stamps.items()}, "served": served}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(calls: int, ipc: bool) -> list[list[float]]:
    """Per call, the 11 stage durations (µs) and the total, in order."""
    with tempfile.TemporaryDirectory(prefix="bench_breakdown_") as outdir:
        ctx = mp.spawn(_worker, args=(_free_port(), outdir, calls, ipc), nprocs=2, join=False)
        deadline = time.monotonic() + 300
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):  # one at a time
            if time.monotonic() > deadline:
                for p in ctx.processes:  # (started here)
                    p.kill()
                raise TimeoutError("the two processes did not finish within 300 s")
        data = json.loads(Path(outdir, "result.json").read_text())
    peer, served = data["peer"]["stamps"], sorted(data["peer"]["served"])
    starts = [h0 for h0, _ in served]
    out = []
    for row in data["rows"]:
        theirs = peer.get(str(row["mid"]))
        if not theirs or "done" not in row:
            continue
        i = bisect.bisect_left(starts, theirs["pool"])  # the first handler run after it
        if i == len(served):
            continue
        h0, h1 = served[i]
        points = [row["c0"], row["send0.1"], row["send1.1"], theirs["in.1"], theirs["pool"], h0,
                  h1, theirs["send0.2"], theirs["send1.2"], row["in.2"], row["done"], row["end"]]
        out.append([(b - a) * 1e6 for a, b in zip(points, points[1:])]
                   + [(row["end"] - row["c0"]) * 1e6])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    results = {}
    for label, ipc in (("Unix socket", True), ("loopback TCP", False)):
        print(f"running ({label}) ...", file=sys.stderr, flush=True)
        results[label] = run(args.calls, ipc)
    labels = list(results)
    print(f"rpc_sync(operator.pos) stage medians (µs), {args.calls} calls each, "
          f"load average at the end {os.getloadavg()[0]:.2f}")
    print(f"| stage | {' | '.join(labels)} |")
    print("|:---|" + "---:|" * len(labels))
    for i, name in enumerate(STAGES):
        cells = [f"{statistics.median(r[i] for r in results[k]):.1f}" for k in labels]
        print(f"| {i + 1}. {name} | {' | '.join(cells)} |")
    sums = [f"{sum(statistics.median(r[i] for r in results[k]) for i in range(11)):.1f}"
            for k in labels]
    print(f"| sum of the stage medians | {' | '.join(sums)} |")
    totals = [f"{statistics.median(r[11] for r in results[k]):.1f}" for k in labels]
    print(f"| median total | {' | '.join(totals)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
