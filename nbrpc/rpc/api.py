"""The public RPC calls, with ``torch.distributed.rpc``'s names and signatures.

Each call runs through the *current agent*: inside a function running on an
agent's worker thread that is that agent (so several agents can share a test
process); anywhere else it is the one ``init_rpc`` started.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..agent import Agent, AgentOptions, RpcFuture, WorkerInfo, current_agent, set_default_agent
from ..agent.agent import _Default, call_args
from ..errors import AlreadyInitializedError, NbrpcError, RendezvousError
from ..rref import RRef
from ..rref import remote as _remote
from . import rendezvous
from .options import UNSET_RPC_TIMEOUT, BackendType, check_backend, read_options

log = logging.getLogger(__name__)
_init_lock = threading.Lock()


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: Any = None,
) -> None:
    """Start this process's agent and join the group.

    With ``world_size=N`` it returns once all N ranks have joined; with
    ``world_size=None`` members may join and leave a running group. Rank 0
    coordinates. ``rpc_backend_options`` may be nbrpc's or PyTorch's
    ``TensorPipeRpcBackendOptions``.

    >>> init_rpc("solo", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> rpc_sync("solo", max, args=(3, 7))
    7
    >>> shutdown()
    """
    check_backend(backend, rpc_backend_options)
    if backend is not None and getattr(backend, "name", None) not in ("TENSORPIPE", "NBRPC"):
        raise ValueError(f"backend {backend!r} is not supported; nbrpc accepts "
                         f"{BackendType.TENSORPIPE} (or None)")
    options = read_options(rpc_backend_options)
    if rank is None or rank < 0:
        rank = int(os.environ.get("RANK", -1))
    if rank < 0:  # PyTorch's phrase first (code matches on it)
        missing = ("environment variable RANK expected, but not set"
                   if options["init_method"].startswith("env://") else "rank parameter missing")
        raise ValueError(f"{missing}: init_rpc needs rank >= 0 (pass rank=..., or set RANK)")
    threads, timeout = options.pop("num_worker_threads"), options["rpc_timeout"]
    init_method = options.pop("init_method")
    join_timeout = timeout if timeout > 0 else 60.0
    with _init_lock:
        if _Default.agent is not None:
            raise AlreadyInitializedError(_Default.agent.name)
        rdv = rendezvous.parse(init_method, rank)

        def make(key: bytes) -> Agent:
            opts = AgentOptions(num_worker_threads=threads, host=rdv.bind_host,
                                port=rdv.bind_port, **options)
            return Agent(name, rank, key, world_size=world_size, options=opts)

        if rdv.file is None:
            agent = make(rdv.key)
            agent.start(rdv.coordinator, join_timeout)
        elif rank == 0:
            agent = _coordinate_through_file(make, rdv.file, world_size, join_timeout)
        else:
            agent = _join_through_file(make, rdv.file, join_timeout, world_size is None)
        set_default_agent(agent)


def _coordinate_through_file(make: Callable[[bytes], Agent], path: str,
                             world_size: int | None, timeout: float) -> Agent:
    """Rank 0 of a file:// group: publish, wait for the group, tidy the file."""
    key = rendezvous.file_key()
    agent = make(key)
    try:
        rendezvous.publish(path, agent.address, key)  # refuses a path someone else holds
    except BaseException:
        agent.shutdown(graceful=False)
        raise
    try:
        agent.start(None, timeout)
    except BaseException:
        _unlink(path)  # a dead address must not be found by the next run
        raise
    if world_size is not None:  # everyone has joined: a re-init must not find this address
        try:
            rendezvous.mark_static(path)  # (a dynamic joiner with this file is told)
        except RendezvousError as e:
            log.warning("nbrpc: %s", e)
            _unlink(path)
    agent.ext["rendezvous_file"] = path  # removed at shutdown
    return agent


def _join_through_file(make: Callable[[bytes], Agent], path: str, timeout: float,
                       dynamic: bool) -> Agent:
    """Ranks > 0 of a file:// group. A stale file (from a run that crashed) may
    be read before rank 0 replaces it: while waiting, re-read it, and start
    over with the new address and key if it changes."""
    deadline = time.monotonic() + timeout
    published = rendezvous.lookup(path, timeout, dynamic)
    agent = make(published[1])
    agent.begin(published[0])
    while not agent.wait_joined(min(0.2, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            agent.fail_join(timeout)
        try:
            now = rendezvous.lookup(path, 0.01)
        except RendezvousError:
            continue  # gone for a moment (rank 0 is about to publish), or not ours: keep ours
        if now != published:
            agent.shutdown(graceful=False)
            published = now
            agent = make(published[1])
            agent.begin(published[0])
    return agent


def _unlink(path: str) -> None:
    """Remove our rendezvous file; one that someone else put there is left alone."""
    try:
        if os.lstat(path).st_uid == os.geteuid():
            os.unlink(path)
    except OSError:
        pass


def shutdown(graceful: bool = True, timeout: float = 0, leak_check: bool | None = None) -> None:
    """Stop this process's agent.

    ``graceful=True`` first waits until no call is outstanding anywhere in
    the group (every worker calls shutdown), then deletes this worker's
    user RRefs (as PyTorch does) and waits until every fork and delete in
    the group has completed. ``timeout`` bounds those waits (0: the RPC
    timeout, 60 s by default); past it the agent stops anyway and the
    timeout is raised. Afterwards ``init_rpc`` may be called again in the
    same process; a second ``shutdown()`` does nothing.

    ``leak_check=True`` (or the environment variable ``NBRPC_LEAK_CHECK=1``)
    reports RRefs still alive at that point, with their creation sites, as
    an :class:`~nbrpc.rref.RRefLeakWarning` (and in the log).

    >>> opts = _free_port_options()
    >>> init_rpc("a", rank=0, world_size=1, rpc_backend_options=opts)
    >>> shutdown()
    >>> init_rpc("a", rank=0, world_size=1, rpc_backend_options=opts)  # same port
    >>> shutdown(); shutdown()
    """
    agent = _Default.agent
    if agent is None:
        return
    path = agent.ext.get("rendezvous_file")
    if path:  # first, so that no re-init can read this group's address
        rendezvous.withdraw(path, agent.address)
    try:
        if leak_check is None:
            leak_check = os.environ.get("NBRPC_LEAK_CHECK", "") not in ("", "0")
        agent.shutdown(graceful=graceful, timeout=timeout, leak_check=leak_check)
    finally:
        set_default_agent(None)


def rpc_async(to: Any, func: Callable, args: tuple | None = None,
              kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> RpcFuture:
    """Run ``func(*args, **kwargs)`` on ``to`` (name, rank or WorkerInfo); returns a
    ``torch.futures.Future`` of its result. ``timeout`` in seconds: -1 uses the
    agent's default, 0 means none.

    >>> import torch
    >>> init_rpc("a", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> futs = [rpc_async("a", torch.mul, args=(torch.ones(2), k)) for k in (2, 3)]
    >>> [f.value().tolist() for f in torch.futures.wait_all(futs) and futs]
    [[2.0, 2.0], [3.0, 3.0]]
    >>> rpc_async("a", pow, args=(2, 5)).then(lambda f: f.value() + 1).wait()
    33
    >>> shutdown()
    """
    __tracebackhide__ = True  # (IPython leaves nbrpc's frames out of tracebacks)
    try:
        return current_agent("rpc_async").rpc_async(to, func, args, kwargs, timeout)
    except Exception as e:
        _drop_our_frames(e)
        raise


def rpc_sync(to: Any, func: Callable, args: tuple | None = None,
             kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Run ``func(*args, **kwargs)`` on ``to`` and return its result (blocks,
    interruptibly). Remote exceptions re-raise here with their original type.

    >>> init_rpc("a", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> rpc_sync("a", divmod, args=(17, 5))
    (3, 2)
    >>> try:  # by rank; the remote ValueError comes back as itself
    ...     rpc_sync(0, int, args=("x",))
    ... except ValueError as e:
    ...     print(type(e).__name__, "from", e.remote_worker)
    ValueError from a
    >>> shutdown()
    """
    __tracebackhide__ = True
    try:
        return current_agent("rpc_sync").rpc_sync(to, func, args, kwargs, timeout)
    except Exception as e:
        _drop_our_frames(e)
        raise


def remote(to: Any, func: Callable, args: tuple | None = None,
           kwargs: dict | None = None, timeout: float = UNSET_RPC_TIMEOUT) -> RRef:
    """Create ``func(*args, **kwargs)`` on ``to`` and return an RRef to it at once.

    >>> init_rpc("a", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> counts = remote("a", dict, kwargs={"x": 1})
    >>> counts.rpc_sync().get("x"), counts.owner_name()
    (1, 'a')
    >>> shutdown()
    """
    __tracebackhide__ = True
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")
    try:
        agent = current_agent("remote")
        args, kwargs = call_args(args, kwargs)
        return _remote(agent, to, func, args, kwargs, timeout)
    except Exception as e:
        _drop_our_frames(e)
        raise


def _drop_our_frames(e: Exception) -> None:
    """Let ``e`` be raised again from the public function without nbrpc's frames,
    so its traceback ends at the user's line, when it is about the user's call:
    an nbrpc error (the destination, a value that does not pickle, a timeout)
    or an error raised on the callee and raised again here. Any other error
    (a bug in nbrpc) keeps every frame."""
    if isinstance(e, NbrpcError) or getattr(e, "remote_worker", None) is not None:
        e.__traceback__ = None


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """This worker's WorkerInfo, or the named worker's.

    >>> init_rpc("a", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> get_worker_info(), get_worker_info("a").id, get_rpc_timeout()
    (WorkerInfo(id=0, name=a), 0, 60.0)
    >>> shutdown()
    """
    agent = current_agent("get_worker_info")
    if worker_name is None:
        return agent.info
    m = agent.resolve(worker_name)
    return WorkerInfo(m.name, m.rank)


def is_available() -> bool:
    """Whether the RPC framework can be used: always, with nbrpc (PyTorch's
    answers ``False`` in builds without distributed support; ``torch.jit``
    asks it while compiling code that mentions RPC).

    >>> is_available()
    True
    """
    return True


def get_rpc_timeout() -> float:
    """The default timeout of this agent's calls, in seconds (the options'
    ``rpc_timeout``; a call's ``timeout=`` overrides it for that call).

    >>> from nbrpc import rpc
    >>> opts = rpc.api._free_port_options()
    >>> opts.rpc_timeout = 5
    >>> rpc.init_rpc("t", rank=0, world_size=1, rpc_backend_options=opts)
    >>> rpc.get_rpc_timeout()
    5.0
    >>> rpc.shutdown()
    """
    return current_agent("get_rpc_timeout").options.rpc_timeout


def _free_port_options() -> Any:
    """Options for a one-process group on a free loopback port (docstring examples)."""
    import socket

    from .options import TensorPipeRpcBackendOptions

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
