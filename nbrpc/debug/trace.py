"""Message traces: what flew between the members while a block of code ran.

Every agent already keeps a bounded log of its messages (``send`` when a
request leaves, ``serve`` when its reply leaves the callee, ``recv`` when the
reply arrives, with sizes, ids and latencies), so tracing adds nothing to the
call path: :func:`trace` notes each member's clock when the block starts,
and when it ends gathers the entries logged in between, moves them onto the
driver's clock and pairs them into messages.

::

    driver                       worker1
      | send  call f   (msg 7)  -->|  serve starts   (t0 .. t1: the request)
      |<-- reply f     (msg 7)  ---|  serve ends     (t1 .. t2: the reply)
      | recv (latency t2 - t0)     |

A request's arrival is when the callee began to run it (the log does not see
time spent queued for a thread). Clocks: members on this host share the
driver's clock; for other hosts the offset is estimated from one round trip
(error at most half of it).

>>> from nbrpc import rpc, debug
>>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
>>> with debug.trace() as t:
...     _ = rpc.rpc_sync("d", abs, args=(-1,))
>>> print(t)
Trace of d: 2 messages (1 request, 1 reply), 0 events
  call: 1 request, 1 reply  d -> d
>>> [(m["kind"], m["what"]) for m in t.messages]
[('call', 'abs'), ('reply', 'abs')]
>>> rpc.shutdown()
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import views
from ..agent import current_agent, internal
from ..agent.agent import INTERNAL
from .words import fmt_bytes, plural

# Requests and replies are paired on (caller, callee, msg id); the other log
# entries (RRef lifecycle, autograd stages, members gone) are point events.
_MESSAGE_EVENTS = ("send", "serve", "serve-error", "recv", "timeout")


@internal
def _clock_here() -> tuple[float, str]:
    return time.time(), socket.gethostname()


@internal
def _events_here(start: float, end: float) -> tuple[list[tuple], bool]:
    return current_agent().events.between(start, end)


def family(op: str) -> str:
    """The family of a message op, as traces and widgets colour them.

    >>> [family(op) for op in ("call", "remote", "rref_delete", "autograd_grads", "x")]
    ['call', 'rref', 'rref-protocol', 'autograd', 'other']
    """
    if op == "call":
        return "call"
    if op in ("rref_fork", "rref_child_accept", "rref_delete"):
        return "rref-protocol"
    if op in ("remote", "rref_fetch", "rref_cancel_fetch"):
        return "rref"
    if op.startswith("autograd"):
        return "autograd"
    return "other"


ROUTE_WORDS = {"ipc": "by CUDA IPC", "staged": "staged through host memory",
               "in-process": "handed over in-process"}


def cuda_words(routes: dict[str, int]) -> str:
    """CUDA bytes by route, in words.

    >>> cuda_words({"staged": 8, "ipc": 64 << 20})
    '64.0 MiB by CUDA IPC, 8 B staged through host memory'
    """
    return ", ".join(f"{fmt_bytes(n)} {ROUTE_WORDS.get(r, r)}" for r, n in sorted(routes.items()))


def _routes(detail: str) -> dict[str, int]:
    """A ``cuda`` event's detail read back: bytes by route.

    >>> _routes("ipc=64 staged=8")
    {'ipc': 64, 'staged': 8}
    """
    out = {}
    for part in detail.split():
        route, _, n = part.partition("=")
        out[route] = int(n or 0)
    return out


@dataclass
class Trace:
    """The messages and events of a traced block, on the driver's clock.

    ``messages``: the requests any member sent while the block ran, and their
    replies, one dict each, in time order: ``kind``
    (``call``, ``rref``, ``rref-protocol``, ``autograd``, ``reply``), ``op``,
    ``what`` (function or RRef), ``src``, ``dst``, ``msg_id``, ``nbytes``, ``t0``
    (left) and ``t1`` (arrived; ``None`` if not within the trace), and for
    replies ``latency`` (the caller's wait) and ``error``. ``events``: RRef
    lifecycle, autograd stages, members gone (``worker``, ``time``, ``event``,
    ``op``, ``peer``, ``detail``). Times are seconds from the trace's start.
    ``lost``: members whose logs were not (fully) read, and why. nbrpc's own
    introspection calls (snapshots, status probes, ``why_alive``; their ``what``
    starts with ``nbrpc:``) are left out unless ``internal`` is set.

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> with debug.trace() as t:
    ...     _ = rpc.rpc_sync("d", abs, args=(-2,))
    ...     _ = rpc.rpc_async("d", abs, args=(-3,)).wait()
    >>> print(t)
    Trace of d: 4 messages (2 requests, 2 replies), 0 events
      call: 2 requests, 2 replies  d -> d
    >>> len(t.latencies()["call"]), sorted(t.to_chrome_trace())
    (2, ['displayTimeUnit', 'otherData', 'traceEvents'])
    >>> rpc.shutdown()
    """

    workers: list[str]
    start: float = 0.0
    duration: float = 0.0
    messages: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    lost: dict[str, str] = field(default_factory=dict)
    internal: bool = False
    settle: float = 2.0
    _offsets: dict[str, float] = field(default_factory=dict, repr=False)
    _started: float = field(default=0.0, repr=False)
    _timeout: float = field(default=10.0, repr=False)

    # -- recording -----------------------------------------------------------------
    def __enter__(self) -> Trace:
        agent = current_agent("debug.trace")
        host = socket.gethostname()
        futs = {}
        for w in agent.worker_infos():
            futs[w.name] = (time.time(), agent.rpc_async(w.id, _clock_here, (), None,
                                                         self._timeout))
        for name, (sent, fut) in futs.items():
            remote, remote_host = fut.wait()
            mid = (sent + time.time()) / 2
            self._offsets[name] = 0.0 if remote_host == host else remote - mid
        self.workers = list(futs)
        self._started = time.perf_counter()
        self.start = time.time()
        return self

    def __exit__(self, *exc: Any) -> None:
        agent = current_agent("debug.trace")
        # calls the block made but did not wait for (a context's release, an
        # async call) are answered before the logs are read, within ``settle`` s
        deadline = time.monotonic() + self.settle
        while agent.unanswered_since(self._started) and time.monotonic() < deadline:
            time.sleep(0.002)
        end = time.time()
        self.duration = end - self.start
        futs = {}
        for w in agent.worker_infos():
            off = self._offsets.get(w.name)
            if off is None:
                self.lost[w.name] = "joined during the trace (clock not known)"
                continue
            # (read to now: a reply's ``serve`` is logged just after it left, so a
            # call answered at the block's end may be logged after it; _build
            # keeps what happened within the block)
            futs[w.name] = agent.rpc_async(w.id, _events_here, (self.start + off, float("inf")),
                                           None, self._timeout)
        raw: dict[str, list[tuple]] = {}
        for name in self.workers:
            if name not in futs:
                self.lost.setdefault(name, "left the group during the trace")
                continue
            try:
                raw[name], overflowed = futs[name].wait()
            except Exception as e:  # noqa: BLE001 - one member's failure loses only its log
                self.lost[name] = f"its log could not be read: {type(e).__name__}: {e}"
                continue
            if overflowed:
                self.lost[name] = ("its event log overflowed: the start of the trace is "
                                   "missing (raise AgentOptions.event_log_size)")
        self._build(raw)

    def _build(self, raw: dict[str, list[tuple]]) -> None:
        """Pair the logs' entries into messages (times from the trace's start)."""
        sends, serves, recvs, cuda = {}, {}, {}, {}
        events = []
        for worker, entries in raw.items():
            off = self._offsets.get(worker, 0.0) + self.start
            for t, event, op, peer, msg_id, nbytes, duration, detail in entries:
                t -= off
                if event in ("serve", "serve-error"):  # (kept or not below)
                    serves[(peer, worker, msg_id)] = (t, op, nbytes, duration or 0.0,
                                                      event == "serve-error")
                elif t > self.duration:  # after the block
                    continue
                elif event == "send":
                    sends[(worker, peer, msg_id)] = (t, op, nbytes, detail)
                elif event == "cuda":  # CUDA tensors the message carried, by route
                    cuda[(worker, peer, msg_id)] = _routes(detail)
                elif event in ("recv", "timeout"):
                    recvs[(worker, peer, msg_id)] = (t, op, nbytes, duration, event)
                else:
                    events.append({"worker": worker, "time": t, "event": event, "op": op,
                                   "peer": peer, "detail": detail})
        # a reply that left after the block is not in it, unless it arrived within
        # it: a reply's ``serve`` is logged just after it left, maybe after its
        # caller saw it and left the block
        serves = {k: v for k, v in serves.items() if v[0] <= self.duration
                  or (k in recvs and recvs[k][4] == "recv")}
        messages = []
        for key, send in sends.items():  # what the block sent, and the answers
            caller, callee, msg_id = key
            serve, recv = serves.get(key), recvs.get(key)
            t, op, nbytes, what = send
            if not self.internal and what.startswith(INTERNAL):
                continue
            arrived = None if recv is None or recv[4] == "timeout" else recv[0]
            served = serve[0] - serve[3] if serve else None
            # a log notes a message just after it left: it left no later than it
            # was served, nor than its answer arrived (and an answer no later than
            # it arrived)
            left = min(x for x in (t, served, arrived) if x is not None)
            messages.append({
                "kind": family(op), "op": op, "what": what, "src": caller, "dst": callee,
                "msg_id": msg_id, "nbytes": nbytes, "t0": left, "t1": served})
            if key in cuda:
                messages[-1]["cuda"] = cuda[key]
            if serve or recv:
                messages.append({
                    "kind": "reply", "op": op, "what": what, "src": callee, "dst": caller,
                    "msg_id": msg_id, "nbytes": serve[2] if serve else None,
                    "t0": None if serve is None else serve[0] if arrived is None
                    else min(serve[0], arrived),
                    "t1": arrived,
                    "latency": recv[3] if recv else None,
                    "error": "timed out" if recv is not None and recv[4] == "timeout"
                    else ("raised" if serve and serve[4] else None)})
                if (callee, caller, msg_id) in cuda:
                    messages[-1]["cuda"] = cuda[(callee, caller, msg_id)]
        self.messages = sorted(messages, key=_order)
        self.events = sorted(events, key=lambda e: (e["time"], e["worker"]))

    # -- reading ---------------------------------------------------------------------
    def counts(self) -> dict[str, dict[tuple[str, str], list[int]]]:
        """Per kind, per (from, to): [requests, replies] (replies under their request's kind)."""
        out: dict[str, dict[tuple[str, str], list[int]]] = {}
        for m in self.messages:
            kind = family(m["op"])
            pair = (m["src"], m["dst"]) if m["kind"] != "reply" else (m["dst"], m["src"])
            out.setdefault(kind, {}).setdefault(pair, [0, 0])[m["kind"] == "reply"] += 1
        return out

    def latencies(self) -> dict[str, list[float]]:
        """Per kind, the callers' waits (seconds) of the replies that arrived."""
        out: dict[str, list[float]] = {}
        for m in self.messages:
            if m["kind"] == "reply" and m.get("latency") is not None and m["t1"] is not None:
                out.setdefault(family(m["op"]), []).append(m["latency"])
        return out

    def __str__(self) -> str:
        requests = sum(m["kind"] != "reply" for m in self.messages)
        replies = len(self.messages) - requests
        lines = [f"Trace of {', '.join(sorted(self.workers))}: "
                 f"{plural(len(self.messages), 'message')} ({plural(requests, 'request')}, "
                 f"{plural(replies, 'reply')}), {plural(len(self.events), 'event')}"]
        for kind, pairs in sorted(self.counts().items()):
            for (a, b), (n_req, n_rep) in sorted(pairs.items()):
                lines.append(f"  {kind}: {plural(n_req, 'request')}, {plural(n_rep, 'reply')}"
                             f"  {a} -> {b}")
        routes: dict[str, int] = {}
        for m in self.messages:
            for route, n in m.get("cuda", {}).items():
                routes[route] = routes.get(route, 0) + n
        if routes:  # (CUDA tensors by IPC travel outside the messages' bytes)
            lines.append(f"  CUDA tensors: {cuda_words(routes)}")
        lines += [f"  lost: {name}: {why}" for name, why in sorted(self.lost.items())]
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def widget(self, **options: Any) -> Any:
        """A sequence diagram: one lifeline per worker, arrows in time order, coloured
        by kind, a bar on the callee's lifeline for each request's run, hover for
        size, id and latency, filters by kind and worker."""
        return views.make("trace", self, **options)

    # -- export ----------------------------------------------------------------------
    def to_chrome_trace(self, path: str | Path | None = None) -> dict[str, Any]:
        """The trace as Chrome trace-event JSON (opens in Perfetto and chrome://tracing):
        a process per worker, a slice per call (caller) and per request served
        (callee), flow arrows for messages, instants for events. Written to
        ``path`` if given; returned as a dict either way."""
        pid = {name: i + 1 for i, name in enumerate(self.workers)}
        for m in self.messages:
            for name in (m["src"], m["dst"]):
                pid.setdefault(name, len(pid) + 1)
        out: list[dict[str, Any]] = []
        for name, p in pid.items():
            out.append({"ph": "M", "name": "process_name", "pid": p, "tid": 0,
                        "args": {"name": name}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": p, "tid": 0,
                        "args": {"sort_index": p}})
        spans = []  # a caller's wait (call) and a callee's work (serve) per request
        replies = {(m["src"], m["dst"], m["msg_id"]): m for m in self.messages
                   if m["kind"] == "reply"}
        for m in self.messages:
            rep = replies.get((m["dst"], m["src"], m["msg_id"]))
            if m["kind"] == "reply" or rep is None:
                continue
            label = f"{m['op']} {m['what']}".strip()
            args = {"msg_id": m["msg_id"], "from": m["src"], "to": m["dst"],
                    "request_bytes": m["nbytes"], "reply_bytes": rep["nbytes"]}
            if m["t0"] is not None and rep["t1"] is not None:
                spans.append((pid[m["src"]], m["t0"], rep["t1"], f"call {label}",
                              {**args, "latency_us": _us(rep["latency"] or 0.0)}))
            if m["t1"] is not None and rep["t0"] is not None:
                spans.append((pid[m["dst"]], m["t1"], rep["t0"], f"serve {label}", args))
        lanes = _Lanes()
        out += [lanes.slice(*span) for span in sorted(spans, key=lambda s: (s[1], s[0]))]
        for i, m in enumerate(self.messages):
            if m["t0"] is None or m["t1"] is None:
                continue
            label = f"{m['op']} {m['what']}".strip()
            src, dst = pid[m["src"]], pid[m["dst"]]
            out.append({"ph": "s", "id": i, "name": label, "cat": m["kind"], "pid": src,
                        "tid": lanes.at(src, m["t0"]), "ts": _us(m["t0"])})
            out.append({"ph": "f", "bp": "e", "id": i, "name": label, "cat": m["kind"],
                        "pid": dst, "tid": lanes.at(dst, m["t1"]), "ts": _us(m["t1"])})
        for e in self.events:
            out.append({"ph": "i", "s": "p", "name": e["event"], "pid": pid.get(e["worker"], 0),
                        "tid": 1, "ts": _us(e["time"]),
                        "args": {"op": e["op"], "peer": e["peer"], "detail": str(e["detail"])}})
        doc = {"traceEvents": out, "displayTimeUnit": "ms",
               "otherData": {"producer": "nbrpc", "workers": self.workers,
                             "lost": self.lost}}
        if path is not None:
            Path(path).write_text(json.dumps(doc))
        return doc


class _Lanes:
    """Threads (``tid``) for each process such that its slices never overlap on one
    (slices must be added in order of their start)."""

    def __init__(self) -> None:
        self._ends: dict[int, list[float]] = {}
        self._spans: dict[int, list[tuple[float, float, int]]] = {}

    def slice(self, pid: int, t0: float, t1: float, name: str,
              args: dict[str, Any]) -> dict[str, Any]:
        t1 = max(t0, t1)
        ends = self._ends.setdefault(pid, [])
        tid = next((i for i, end in enumerate(ends) if end <= t0), len(ends))
        if tid == len(ends):
            ends.append(t1)
        else:
            ends[tid] = t1
        self._spans.setdefault(pid, []).append((t0, t1, tid + 1))
        return {"ph": "X", "name": name, "pid": pid, "tid": tid + 1, "ts": _us(t0),
                "dur": _us(t1 - t0), "args": args}

    def at(self, pid: int, t: float) -> int:
        """The lane of a slice of ``pid`` that contains ``t`` (flows bind to it)."""
        for t0, t1, tid in self._spans.get(pid, []):
            if t0 <= t <= t1:
                return tid
        return 1


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _order(m: dict[str, Any]) -> tuple:
    t = m["t0"] if m["t0"] is not None else m["t1"]
    return (t if t is not None else float("inf"), m["kind"] == "reply", m["src"], m["msg_id"])


def trace(timeout: float = 10.0, internal: bool = False, settle: float = 2.0) -> Trace:
    """Record the messages between the members while a ``with`` block runs.

    ``with nbrpc.debug.trace() as t: ...`` then ``t.widget()`` (a sequence
    diagram), ``t.messages``, ``t.to_chrome_trace("run.json")``. Tracing reads
    the agents' always-on bounded event logs, so it costs nothing on the call
    path; only entering and leaving the block make one call to each member.
    ``internal=True`` keeps nbrpc's own introspection calls (the live cluster
    view's probes, ``debug`` snapshots) in the trace. Leaving the block first
    waits (at most ``settle`` seconds) for the answers to calls the block sent
    from here without waiting for them, so that they are in the trace too.

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> with debug.trace() as t:
    ...     _ = rpc.rpc_sync("d", abs, args=(-2,))
    >>> [(m["kind"], m["what"], m["src"], m["dst"]) for m in t.messages]
    [('call', 'abs', 'd', 'd'), ('reply', 'abs', 'd', 'd')]
    >>> rpc.shutdown()
    """
    return Trace(workers=[], internal=internal, settle=settle, _timeout=timeout)
