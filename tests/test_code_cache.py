"""Notebook code by value, once (nbrpc.serialize.code), in three tiers.

* Protocol state, no network: when a definition may be cached and when its
  entry changes; the receiver's cache (hits, misses before anything is
  unpickled, bounds, class state flip-flops); a message's code table.
* In-process agents: the second call names the code by hash; redefinition and
  rebound globals take effect; a callee that lost its cache gets the
  definitions again (resent once); lost, late and concurrent first messages.
* Real processes (marked ``multiprocess``): a driver script whose code lives in
  a real ``__main__`` calls a worker in another process, as a notebook would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import free_ports, local_group, poll_for

from nbrpc.errors import CodeCacheMiss, RpcTimeoutError, SerializationError
from nbrpc.rref import remote
from nbrpc.serialize import CodeCache, dumps, entry_for, loads, pickler
from nbrpc.serialize import code as code_mod

REPO = Path(__file__).resolve().parents[1]


def cell(source: str, ns: dict | None = None) -> dict:
    """Run ``source`` as a notebook cell would: its code lives in ``__main__``
    as far as cloudpickle can tell (not importable, so pickled by value)."""
    ns = {"__name__": "__main__"} if ns is None else ns
    exec(textwrap.dedent(source), ns)
    return ns


class Ctx:
    """What the agent's MessageContext gives the pickler: the cache, the peer, refs_ok."""

    def __init__(self, codes: CodeCache, peer: int = 1, refs_ok: bool = True) -> None:
        self.codes, self.peer, self.refs_ok = codes, peer, refs_ok
        self.full: list[bytes] | None = None
        self.refs = False


def send(obj: Any, sender: CodeCache, receiver: CodeCache, refs_ok: bool = True) -> Any:
    """One message from ``sender`` to ``receiver`` and its answer (confirmation)."""
    ctx = Ctx(sender, 1, refs_ok)
    payload, buffers = dumps(obj, ctx)
    value = loads(payload, buffers, Ctx(receiver, 0))
    if ctx.full:
        sender.confirm(1, ctx.full)
    return value


# -- what may be cached ----------------------------------------------------------
def test_importable_code_is_not_an_entry() -> None:
    assert entry_for(torch.add) is None and entry_for(json.dumps) is None
    assert entry_for(CodeCache) is None  # importable class: pickled by reference


def test_entry_is_reused_while_nothing_changed() -> None:
    ns = cell("""
        import math
        SCALE = 3
        def f(x, k=2):
            return math.floor(SCALE * x * k)
    """)
    e = entry_for(ns["f"])
    assert e is not None and entry_for(ns["f"]) is e
    assert len(e.digest) == code_mod.DIGEST_SIZE


@pytest.mark.parametrize("change", [
    "SCALE = 4",                                   # a global rebound (a later cell)
    "SCALE = 3.0",                                 # equal, but another type: still a change
    "f.__defaults__ = (5,)",                       # a default changed in place
    "f.__code__ = (lambda x, k=2: -x).__code__",  # the code replaced
    "f.tag = 'new'",                               # an attribute added
    "def helper(x):\n    return x",               # a helper it calls redefined
])
def test_any_change_gives_a_new_digest(change: str) -> None:
    ns = cell("""
        SCALE = 3
        def helper(x):
            return x + 1
        def f(x, k=2):
            return helper(SCALE * x * k)
    """)
    before = entry_for(ns["f"]).digest
    cell(change, ns)
    after = entry_for(ns["f"])
    assert after is not None and after.digest != before


def test_class_changes_give_new_digests() -> None:
    ns = cell("""
        class Box:
            size = 1
            def get(self):
                return self.size
        def make():
            return Box().get()
    """)
    box, make = entry_for(ns["Box"]).digest, entry_for(ns["make"]).digest
    ns["Box"].size = 2  # a class attribute
    assert entry_for(ns["Box"]).digest != box and entry_for(ns["make"]).digest != make
    ns["Box"].get = lambda self: -1  # a method replaced
    assert len({box, entry_for(ns["Box"]).digest}) == 2
    # the function's entry lists the class with the class's own digest
    e = entry_for(ns["make"])
    assert [d for _, d in e.classes] == [entry_for(ns["Box"]).digest]


def test_closure_cell_change_gives_a_new_digest() -> None:
    ns = cell("""
        def counter():
            n = 0
            def read():
                return n
            def bump():
                nonlocal n
                n += 1
            return read, bump
        read, bump = counter()
    """)
    before = entry_for(ns["read"]).digest
    ns["bump"]()
    assert entry_for(ns["read"]).digest != before


@pytest.mark.parametrize("source", [
    "STATE = []\ndef f():\n    return len(STATE)",                # reads a mutable list
    "CFG = {'lr': 1}\ndef f():\n    return CFG['lr']",             # a dict
    "W = torch.ones(2)\ndef f():\n    return W.sum()",             # a tensor
    "N = 0\ndef f():\n    global N\n    N += 1\n    return N",    # assigns a global
    "class f:\n    cache = {}",                                   # a class holding a dict
    "import dataclasses\n@dataclasses.dataclass\nclass f:\n    x: int = 0",  # Field objects
    "def f(acc=[]):\n    return acc",                             # a mutable default
])
def test_code_that_reads_mutable_state_is_sent_in_full(source: str) -> None:
    ns = cell("import torch\n" + source)
    assert entry_for(ns["f"]) is None


def test_mutable_global_is_sent_fresh_each_time() -> None:
    ns = cell("STATE = []\ndef f():\n    return list(STATE)")
    sender, receiver = CodeCache(), CodeCache(local=False)
    assert send(ns["f"], sender, receiver)() == []
    ns["STATE"].append(1)
    assert send(ns["f"], sender, receiver)() == [1]
    assert sender.sent_full == sender.sent_ref == 0  # never in the table


# -- the receiver's cache -----------------------------------------------------------
def test_second_message_names_code_by_hash() -> None:
    ns = cell("def f(x):\n    return x * 7")
    sender, receiver = CodeCache(), CodeCache(local=False)
    first = dumps(ns["f"], Ctx(sender))[0]
    assert send(ns["f"], sender, receiver)(2) == 14
    second = dumps(ns["f"], Ctx(sender))[0]
    assert len(second) < len(first) - 100  # the definition is not in it
    assert send(ns["f"], sender, receiver)(3) == 21
    assert (receiver.loaded, receiver.hits) == (1, 1)
    assert (sender.sent_full, sender.sent_ref) == (2, 2)  # (counting first and second)


def test_refs_only_where_allowed_and_confirmed() -> None:
    ns = cell("def f():\n    return 1")
    sender = CodeCache()
    ctx = Ctx(sender)
    dumps(ns["f"], ctx)
    assert ctx.full and not ctx.refs  # not confirmed yet: in full
    sender.confirm(1, ctx.full)
    answer = Ctx(sender, refs_ok=False)  # an answer cannot be resent: always in full
    dumps(ns["f"], answer)
    assert answer.full and not answer.refs
    other = Ctx(sender, peer=2)  # confirmed by peer 1 only
    dumps(ns["f"], other)
    assert other.full
    request = Ctx(sender)
    dumps(ns["f"], request)
    assert request.refs and not request.full
    sender.forget(1)
    again = Ctx(sender)
    dumps(ns["f"], again)
    assert again.full


class Witness:
    """Records being unpickled (as an RRef argument would register a fork)."""

    rebuilt: list[int] = []

    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> tuple:
        return _witness, (self.n,)


def _witness(n: int) -> Witness:
    Witness.rebuilt.append(n)
    return Witness(n)


def test_miss_is_raised_before_anything_is_unpickled() -> None:
    ns = cell("def f(w):\n    return w.n")
    sender, receiver = CodeCache(), CodeCache(local=False)
    sender.confirm(1, [entry_for(ns["f"]).digest])  # as if a receiver had confirmed it
    Witness.rebuilt.clear()
    payload, buffers = dumps((Witness(1), ns["f"], Witness(2)), Ctx(sender))
    with pytest.raises(CodeCacheMiss) as info:
        loads(payload, buffers, Ctx(receiver, 0))
    assert Witness.rebuilt == [] and info.value.digests == (entry_for(ns["f"]).digest,)
    assert receiver.misses == 1


def test_table_without_a_cache_is_refused() -> None:
    ns = cell("def f():\n    return 1")
    payload, buffers = dumps(ns["f"], Ctx(CodeCache()))
    with pytest.raises(SerializationError, match="no code cache"):
        loads(payload, buffers)


def test_definition_must_match_its_digest() -> None:
    ns = cell("def f():\n    return 1")
    e = entry_for(ns["f"])
    with pytest.raises(SerializationError, match="does not match its digest"):
        CodeCache(local=False).resolve([(e.digest, e.blob + b".", e.classes)])


def test_cache_is_bounded_and_evicts_least_recent() -> None:
    receiver = CodeCache(max_entries=3, local=False)
    fns = [cell(f"def f():\n    return {i}")["f"] for i in range(5)]
    entries = [entry_for(f) for f in fns]
    for e in entries:
        receiver.resolve([(e.digest, e.blob, e.classes)])
    assert receiver.stats()["held"] == 3
    with pytest.raises(CodeCacheMiss):
        receiver.resolve([(entries[0].digest, None, entries[0].classes)])
    assert receiver.resolve([(entries[4].digest, None, entries[4].classes)])[0]() == 4
    sender = CodeCache(max_entries=2)
    sender.confirm(1, [e.digest for e in entries])
    assert [sender.holds(1, e.digest) for e in entries] == [False] * 3 + [True] * 2


def test_class_state_flip_flop_is_rebuilt() -> None:
    """cloudpickle keeps one class object per class on the receiver and sets its
    state from each blob that mentions it: going back to an earlier state must
    set it again, not reuse the earlier entry as it is."""
    ns = cell("""
        class Box:
            size = 1
        def get():
            return Box.size
    """)
    receiver = CodeCache(local=False)
    rows = {}
    for size in (1, 2, 1):
        ns["Box"].size = size
        e = entry_for(ns["get"])
        rows[size] = (e.digest, e.blob, e.classes)
        receiver.resolve([rows[size]])
    assert receiver.loaded == 3  # the third is a known digest at another class state
    assert receiver.resolve([(rows[1][0], None, rows[1][2])])  # now current: a hit
    with pytest.raises(CodeCacheMiss):  # state 2 by hash only: must be sent again
        receiver.resolve([(rows[2][0], None, rows[2][2])])


def test_each_definition_once_per_message() -> None:
    ns = cell("def f():\n    return 1")
    ctx = Ctx(CodeCache())
    payload, _ = dumps([ns["f"], ns["f"], (ns["f"],)], ctx)
    assert len(ctx.full) == 1
    values = loads(payload, [], Ctx(CodeCache(local=False), 0))
    assert values[0] is values[1] is values[2][0]


def test_plain_messages_are_unchanged() -> None:
    payload, _ = dumps({"x": 1}, Ctx(CodeCache()))
    assert payload[0] == 0x80  # a bare pickle: no table, no cost
    assert pickler._TABLE != 0x80


# -- in-process agents ----------------------------------------------------------------
def test_second_call_by_hash_and_redefinition(trio) -> None:
    a, b, _ = trio
    ns = cell("""
        class Scaler:
            def __init__(self, k):
                self.k = k
            def apply(self, x):
                return self.k * x
        def run(x):
            return Scaler(3).apply(x)
    """)
    assert a.rpc_async("b", ns["run"], (2,)).wait() == 6
    assert a.rpc_async("b", ns["run"], (3,)).wait() == 9
    assert a.codes.sent_ref >= 1
    cell("def run(x):\n    return Scaler(3).apply(x) + 100", ns)  # a later cell redefines
    assert a.rpc_async("b", ns["run"], (3,)).wait() == 109
    cell("Scaler.apply = lambda self, x: -x", ns)  # a method patched
    assert a.rpc_async("b", ns["run"], (3,)).wait() == 97
    assert b.codes.stats()["misses"] == 0


def test_rebound_global_takes_effect(trio) -> None:
    a, _, _ = trio
    ns = cell("K = 2\ndef f(x):\n    return K * x")
    assert [a.rpc_async("b", ns["f"], (5,)).wait() for _ in range(2)] == [10, 10]
    ns["K"] = 3
    assert a.rpc_async("b", ns["f"], (5,)).wait() == 15


def test_callee_that_lost_its_cache_gets_the_definition_again(trio) -> None:
    a, b, _ = trio
    b.codes.local = False  # rebuild, as another process would
    ns = cell("def f(x):\n    return x + 1")
    assert [a.rpc_async("b", ns["f"], (i,)).wait() for i in range(2)] == [1, 2]
    b.codes.clear()  # as a restarted worker would hold nothing
    assert a.rpc_async("b", ns["f"], (5,)).wait() == 6
    assert (b.codes.misses, a.codes.resent) == (1, 1)
    assert a.rpc_async("b", ns["f"], (6,)).wait() == 7  # confirmed again: by hash
    assert b.codes.misses == 1


def test_resend_after_a_miss_keeps_rref_arguments(trio) -> None:
    a, b, c = trio
    b.codes.local = False  # rebuild, as another process would
    ns = cell("def total(r):\n    return r.to_here().sum().item()")
    rref = remote(a, "c", torch.ones, (4,), {}, -1)
    assert a.rpc_async("b", ns["total"], (rref,)).wait() == 4.0
    b.codes.clear()
    assert a.rpc_async("b", ns["total"], (rref,)).wait() == 4.0
    assert a.codes.resent == 1


def test_concurrent_first_calls_all_carry_the_definition(trio) -> None:
    """No answer has confirmed the definition yet, so none may name it by hash
    only, whatever order they arrive in."""
    a, b, _ = trio
    b.codes.local = False  # rebuild, as another process would
    ns = cell("def f(x):\n    return x * 2")
    b.faults.add("call", "delay", times=20, delay=0.5, reply=True)  # no answer yet
    futs = [a.rpc_async("b", ns["f"], (i,)) for i in range(20)]
    assert [f.wait() for f in futs] == [2 * i for i in range(20)]
    assert (a.codes.sent_full, a.codes.sent_ref, b.codes.misses) == (20, 0, 0)
    assert b.codes.loaded == 1  # rebuilt once, then reused from the cache


def test_lost_answer_leaves_the_definition_unconfirmed(trio) -> None:
    a, b, _ = trio
    ns = cell("def f(x):\n    return x")
    b.faults.add("call", "drop", reply=True)  # served (and held), but never confirmed
    with pytest.raises(RpcTimeoutError):
        a.rpc_async("b", ns["f"], (1,), timeout=0.5).wait()
    assert a.codes.sent_ref == 0 and not a.codes.holds(b.rank, entry_for(ns["f"]).digest)
    assert a.rpc_async("b", ns["f"], (2,)).wait() == 2  # in full again, then confirmed
    assert a.codes.holds(b.rank, entry_for(ns["f"]).digest)


def test_late_definition_then_ref(trio) -> None:
    a, b, _ = trio
    ns = cell("def f(x):\n    return -x")
    a.faults.add("call", "delay", delay=0.3)
    slow = a.rpc_async("b", ns["f"], (1,))
    fast = a.rpc_async("b", ns["f"], (2,))  # overtakes the first: it carries its own copy
    assert (fast.wait(), slow.wait()) == (-2, -1)
    assert (a.codes.sent_ref, b.codes.misses) == (0, 0)
    assert a.rpc_async("b", ns["f"], (3,)).wait() == -3
    assert a.codes.sent_ref == 1


def test_member_gone_forgets_what_it_held() -> None:
    with local_group(["a", "b", "c"], dynamic=True) as (a, _, c):
        ns = cell("def f():\n    return 1")
        a.rpc_async("c", ns["f"]).wait()
        digest = entry_for(ns["f"]).digest
        assert a.codes.holds(c.rank, digest)
        c.shutdown()  # leaves the group: a later process under that rank holds nothing
        assert poll_for(lambda: not a.codes.holds(c.rank, digest), timeout=10)


# -- real processes: a driver script with a real __main__ ------------------------------
DRIVER = """
    import json, os, subprocess, sys
    from nbrpc import rpc
    from nbrpc.agent import current_agent

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    worker = subprocess.Popen([sys.executable, "-c", (
        "from nbrpc import rpc; rpc.init_rpc('w1', rank=1, world_size=2); rpc.shutdown()")])
    rpc.init_rpc("driver", rank=0, world_size=2)
    out = {}

    class Box:
        size = 1
        def get(self):
            return self.size

    K = 10

    def use(x):
        return Box().get() * K + x

    out["first"] = [rpc.rpc_sync("w1", use, args=(i,)) for i in range(3)]
    Box.size = 2
    out["class_changed"] = rpc.rpc_sync("w1", use, args=(0,))
    Box.size = 1  # back to a state the worker has by hash
    out["class_back"] = rpc.rpc_sync("w1", use, args=(0,))
    out["instance_back"] = rpc.rpc_sync("w1", Box.get, args=(Box(),))
    K = 100
    out["global_rebound"] = rpc.rpc_sync("w1", use, args=(0,))

    def use(x):  # redefined, as a later cell would
        return -x

    out["redefined"] = rpc.rpc_sync("w1", use, args=(5,))
    out["stats"] = current_agent().codes.stats()
    rpc.shutdown()
    worker.wait(60)
    print(json.dumps(out), flush=True)
"""


@pytest.mark.multiprocess
def test_notebook_code_in_a_real_main(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script), str(free_ports(1)[0])],
                          capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["first"] == [10, 11, 12]
    assert out["class_changed"] == 20 and out["class_back"] == 10
    assert out["instance_back"] == 1
    assert out["global_rebound"] == 100 and out["redefined"] == -5
    stats = out["stats"]
    assert stats["sent_ref"] >= 2  # the 2nd and 3rd calls, at least
    assert stats["resent"] >= 1  # going back to size 1 by hash needed Box set again


def test_threads_share_entries_safely() -> None:
    ns = cell("def f(x):\n    return x")
    digests: set[bytes] = set()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(200):
                digests.add(entry_for(ns["f"]).digest)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(digests) == 1


def test_keyword_only_defaults_are_watched() -> None:
    ns = cell("def f(x, *, scale=2):\n    return x * scale")
    before = entry_for(ns["f"]).digest
    ns["f"].__kwdefaults__ = {"scale": 3}  # a new dict
    mid = entry_for(ns["f"]).digest
    ns["f"].__kwdefaults__["scale"] = 4  # the same dict, changed
    assert len({before, mid, entry_for(ns["f"]).digest}) == 3
