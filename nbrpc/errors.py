"""Every exception nbrpc raises, in one shallow tree.

Errors carry fields (worker, timeout, request id) and say what to do next.
Where PyTorch's RPC raises ``RuntimeError`` for the same situation, ours
subclasses ``RuntimeError`` too, so code written against
``torch.distributed.rpc`` keeps catching what it caught before.

::

    NbrpcError (RuntimeError)
    ├── NotInitializedError        init_rpc() has not been called
    ├── AlreadyInitializedError    init_rpc() twice without shutdown()
    ├── UnknownWorkerError         destination name / rank not in the group
    ├── RpcTimeoutError            also a TimeoutError
    ├── WorkerGoneError            the peer left the group or died
    ├── SerializationError         an argument or result could not be pickled
    │   ├── CodeCacheMiss          a request named code by hash the callee no longer has
    │   ├── MessageTooLargeError   more bytes than the receiver's max_message_size
    │   └── DeviceRouteError       a tensor on a device no device map sends anywhere
    ├── RendezvousError            init_rpc could not form the group
    │   └── DeviceMapError         the group's device maps do not fit (also a ValueError)
    ├── ShutdownError              the agent is shutting down
    ├── RemoteError                a remote failure whose type did not unpickle
    ├── BackwardStageError         a distributed backward stage raised on a worker
    ├── CompositeError             several workers failed in one fan-out (every one listed)
    └── CellError                  a cell run with %%rpc_on raised on one or more workers
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["AlreadyInitializedError", "BackwardStageError", "CellError", "CodeCacheMiss",
           "CompositeError", "DeviceMapError", "DeviceRouteError", "MessageTooLargeError",
           "NbrpcError", "NotInitializedError", "RemoteError", "RemoteTraceback",
           "RendezvousError", "RpcTimeoutError", "SerializationError", "ShutdownError",
           "UnknownWorkerError", "WorkerGoneError"]


class NbrpcError(RuntimeError):
    """Base class of every nbrpc error (a ``RuntimeError``, as PyTorch's RPC errors).

    >>> from nbrpc import rpc
    >>> try:
    ...     rpc.rpc_sync("nobody", abs, args=(-1,))
    ... except RuntimeError as e:  # what code written for torch.distributed.rpc catches
    ...     type(e).__name__, isinstance(e, NbrpcError)
    ('NotInitializedError', True)
    """


class NotInitializedError(NbrpcError):
    """An RPC function called where no agent runs: before ``init_rpc`` (or
    ``%rpc_cluster start``), or after ``shutdown``.

    >>> from nbrpc import rpc
    >>> rpc.get_worker_info()
    Traceback (most recent call last):
      ...
    nbrpc.errors.NotInitializedError: RPC has not been initialized. get_worker_info needs an agent: call nbrpc.rpc.init_rpc(name, rank=..., world_size=...) first (in a notebook: %rpc_cluster start N).
    """

    def __init__(self, what: str = "this call") -> None:
        # PyTorch's two phrases: its Python API says the first, RRef() the second.
        head = ("Current RPC agent is not set! Did you initialize the RPC framework?"
                if what.startswith("RRef") else "RPC has not been initialized.")
        super().__init__(
            f"{head} {what} needs an agent: call nbrpc.rpc.init_rpc(name, rank=..., "
            "world_size=...) first (in a notebook: %rpc_cluster start N)."
        )


class AlreadyInitializedError(NbrpcError):
    """``init_rpc`` on a thread whose process already runs an agent.

    >>> from nbrpc import rpc
    >>> opts = rpc.api._free_port_options()
    >>> rpc.init_rpc("once", rank=0, world_size=1, rpc_backend_options=opts)
    >>> rpc.init_rpc("twice", rank=0, world_size=1, rpc_backend_options=opts)
    Traceback (most recent call last):
      ...
    nbrpc.errors.AlreadyInitializedError: RPC is already initialized in this process as 'once'. Call nbrpc.rpc.shutdown() before init_rpc() again.
    >>> rpc.shutdown()
    """

    def __init__(self, name: str) -> None:
        super().__init__(
            f"RPC is already initialized in this process as {name!r}. "
            "Call nbrpc.rpc.shutdown() before init_rpc() again."
        )


class UnknownWorkerError(NbrpcError, KeyError):
    """Raised when a destination names no member of the group (also a ``KeyError``).

    >>> from nbrpc import rpc
    >>> rpc.init_rpc("u", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> rpc.rpc_sync("worker9", abs, args=(-1,))
    Traceback (most recent call last):
      ...
    nbrpc.errors.UnknownWorkerError: could not find destination name 'worker9': no worker in the group has that name; known: u
    >>> rpc.shutdown()
    """

    def __init__(self, dest: object, known: Iterable[str]) -> None:
        self.dest = dest
        self.known = sorted(known)
        name = dest if isinstance(dest, str) else getattr(dest, "name", None)  # or a WorkerInfo
        if isinstance(name, str):
            what, has = f"name {name!r}", "that name"
        else:
            what, has = f"id {dest!r}", "that rank"
        NbrpcError.__init__(  # PyTorch's phrase first: code matches on it
            self, f"could not find destination {what}: no worker in the group has {has}; "
            f"known: {', '.join(self.known) or '(none)'}"
        )

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return self.args[0]


class RpcTimeoutError(NbrpcError, TimeoutError):
    """A call, a fetch or a rendezvous ran past its timeout (also a ``TimeoutError``).
    The call fails; the agent, and the function still running remotely, do not.

    >>> import time
    >>> from nbrpc import rpc
    >>> rpc.init_rpc("t", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> rpc.rpc_sync("t", time.sleep, args=(0.5,), timeout=0.1)
    Traceback (most recent call last):
      ...
    nbrpc.errors.RpcTimeoutError: RPC ran for more than set timeout (100 ms) and will now be marked with an error ('call' on 't'). Pass a larger timeout= (0 means no timeout), or check that the worker is not blocked.
    >>> rpc.rpc_sync("t", abs, args=(-1,))  # the agent is unharmed
    1
    >>> rpc.shutdown()
    """

    def __init__(self, what: str, timeout: float, worker: str | None = None) -> None:
        self.timeout = timeout
        self.worker = worker
        where = f" on {worker!r}" if worker else ""
        advice = ("Pass a larger timeout= (0 means no timeout), or check that the worker "
                  "is not blocked.")
        if what.startswith("RPC "):  # a call: PyTorch's phrase first (code matches on it)
            text = (f"RPC ran for more than set timeout ({timeout * 1000:g} ms) and will now "
                    f"be marked with an error ({what[4:]}{where}). {advice}")
        else:
            text = (f"{what}{where} ran for more than the set timeout ({timeout:g} s) and "
                    f"was marked failed. {advice}")
        super().__init__(text)


class WorkerGoneError(NbrpcError, ConnectionError):
    """The destination left the group, or stopped answering.

    It pickles as its fields, so one raised on a worker and sent back reads the same:

    >>> import pickle
    >>> e = WorkerGoneError("worker1", "died (its connection closed)")
    >>> str(pickle.loads(pickle.dumps(e))) == str(e), e.worker
    (True, 'worker1')
    """

    def __init__(self, worker: str, why: str = "left the group") -> None:
        self.worker, self.why = worker, why
        super().__init__(f"Worker {worker!r} {why}; calls to it cannot complete.")

    def __reduce__(self):
        return (type(self), (self.worker, self.why))


class SerializationError(NbrpcError):
    """An argument, a result or an exception could not be pickled.

    ``path`` names the part that did not pickle when it is known
    (``args[0]``, ``kwargs['opts'].lock``, ``result['k']``), ``worker`` the
    worker the value was going to or coming from.

    >>> import pickle
    >>> e = SerializationError("could not pickle argument 0", "args[0]", "worker1")
    >>> e.path, e.worker, pickle.loads(pickle.dumps(e)).path
    ('args[0]', 'worker1', 'args[0]')
    """

    def __init__(self, message: str, path: str | None = None, worker: str | None = None
                 ) -> None:
        super().__init__(message)
        self.path = path
        self.worker = worker

    def __reduce__(self):
        return (SerializationError, (self.args[0], self.path, self.worker))


class MessageTooLargeError(SerializationError):
    """A request or an answer larger than its receiver accepts (its
    ``max_message_size``, which members tell each other when they join): refused
    by the sender, before anything is sent, so the call fails at once rather
    than at its timeout. ``size`` and ``limit`` are in bytes.

    >>> import pickle
    >>> e = pickle.loads(pickle.dumps(MessageTooLargeError("too large", 5, 4, "w1")))
    >>> e.size, e.limit, e.worker
    (5, 4, 'w1')
    """

    def __init__(self, message: str, size: int, limit: int, worker: str | None = None) -> None:
        super().__init__(message, None, worker)
        self.size, self.limit = size, limit

    def __reduce__(self):
        return (MessageTooLargeError, (self.args[0], self.size, self.limit, self.worker))


class DeviceRouteError(SerializationError):
    """A tensor on a device that no device map sends to its destination (a
    CUDA tensor with no map to that worker, or a reply tensor on a device the
    caller's map does not name). PyTorch's words first (it raises a
    ``RuntimeError``), then what to set. Only the one call fails.

    >>> import pickle
    >>> e = pickle.loads(pickle.dumps(DeviceRouteError("Request device mapping ...", "w1")))
    >>> isinstance(e, RuntimeError), e.worker
    (True, 'w1')
    """

    def __init__(self, message: str, worker: str | None = None) -> None:
        super().__init__(message, None, worker)

    def __reduce__(self) -> tuple:
        return DeviceRouteError, (self.args[0], self.worker)


class CodeCacheMiss(SerializationError):
    """A request referred to a function or class by content hash that the
    receiver does not hold (it restarted, or evicted it). Raised on the
    receiver before anything else of the request is unpickled; the caller
    sends the request again with the definitions, once. Users see it only if
    that retry misses too."""

    def __init__(self, digests: Iterable[bytes]) -> None:
        self.digests = tuple(digests)
        names = ", ".join(d.hex()[:12] for d in self.digests)
        super().__init__(
            f"this worker no longer holds the definition of code sent earlier by hash "
            f"({names}); the caller resends it with the definition. If you see this, "
            "the resend missed too: call again.")

    def __reduce__(self) -> tuple:
        return CodeCacheMiss, (self.digests,)


class RendezvousError(NbrpcError):
    """init_rpc could not form the group (bad init_method, duplicate name, ...).

    >>> from nbrpc import rpc
    >>> opts = rpc.TensorPipeRpcBackendOptions(init_method="http://10.0.0.1:80")
    >>> rpc.init_rpc("r", rank=0, world_size=1, rpc_backend_options=opts)
    Traceback (most recent call last):
      ...
    nbrpc.errors.RendezvousError: unsupported init_method 'http://10.0.0.1:80'; use env://, tcp://HOST:PORT or file:///PATH
    """


class DeviceMapError(RendezvousError, ValueError):
    """A member's device maps or devices do not fit the group (``node`` names it).

    The message is PyTorch's, word for word (``torch.distributed.rpc`` raises a
    ``ValueError`` from ``init_rpc``), then what to change.

    >>> import pickle
    >>> e = pickle.loads(pickle.dumps(DeviceMapError("Node w0 has duplicated devices", "w0")))
    >>> isinstance(e, ValueError), e.node, str(e).splitlines()[0]
    (True, 'w0', 'Node w0 has duplicated devices')
    """

    def __init__(self, message: str, node: str) -> None:
        self.node = node
        super().__init__(
            f"{message}\nCheck the device_maps and devices in {node}'s "
            "TensorPipeRpcBackendOptions (set_device_map, set_devices): every device must "
            "exist on its worker (CUDA indices below that worker's device count, or "
            "'cpu'), and each map must be one-to-one.")

    def __reduce__(self) -> tuple:
        return type(self), (str(self).split("\nCheck the device_maps")[0], self.node)


class ShutdownError(NbrpcError):
    """The agent is shutting down and takes no new calls."""


class RemoteTraceback(Exception):
    """Holds a remote traceback as text; attached as ``__cause__`` of re-raised errors."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class RemoteError(NbrpcError):
    """A remote failure whose exception type could not be rebuilt here.

    Keeps the worker, the remote type's qualified name, its message and the
    remote traceback, like ipyparallel's ``RemoteError``. Its message holds
    PyTorch's phrase ("Original exception on remote side was ...") that code
    written for ``torch.distributed.rpc`` matches on.

    >>> str(RemoteError("w1", "app.Custom", "foo", "", why="TypeError: needs 2 args"))
    "Original exception on remote side was app.Custom: foo (raised on 'w1'; ...)"
    """

    def __init__(self, worker: str, type_name: str, message: str, traceback: str,
                 why: str = "") -> None:
        self.worker = worker
        self.type_name = type_name
        self.message = message
        self.traceback = traceback
        self.why = why
        because = f" ({why})" if why else ""
        super().__init__(
            f"Original exception on remote side was {type_name}: {message} (raised on "
            f"{worker!r}; its type could not be rebuilt here{because}, so it arrives as "
            "RemoteError; the remote traceback is in .traceback)")

    def __reduce__(self):
        return (RemoteError, (self.worker, self.type_name, self.message, self.traceback,
                              self.why))

    def _render_traceback_(self) -> list[str]:
        """IPython shows the remote traceback instead of the local one."""
        return [f"RemoteError on {self.worker!r}:", *self.traceback.rstrip().splitlines()]


class BackwardStageError(NbrpcError):
    """A stage of a distributed backward pass raised on a worker (a custom
    ``Function.backward``, an engine error). The message starts as PyTorch's
    ("Error on Node N: ..."); the exception raised there is ``original`` and
    this one's ``__cause__``, with the worker's traceback.

    >>> e = BackwardStageError(2, "worker2", ValueError("boom"), 7)
    >>> str(e).split(" (")[0], type(e.original).__name__
    ('Error on Node 2: boom', 'ValueError')
    """

    def __init__(self, rank: int, worker: str, original: BaseException, context_id: int
                 ) -> None:
        self.rank, self.worker, self.original = rank, worker, original
        super().__init__(
            f"Error on Node {rank}: {original} ({type(original).__name__} on {worker!r}, "
            f"in the distributed backward pass of autograd context {context_id}; the "
            "original exception is .original, with the traceback there as its cause)")

    def __reduce__(self):
        return (BackwardStageError._rebuild, (self.args[0], self.rank, self.worker,
                                              self.original))

    @staticmethod
    def _rebuild(message: str, rank: int, worker: str, original: BaseException
                 ) -> BackwardStageError:
        e = BackwardStageError.__new__(BackwardStageError)
        NbrpcError.__init__(e, message)
        e.rank, e.worker, e.original = rank, worker, original
        return e


class CompositeError(NbrpcError):
    """Several workers failed in one fan-out operation (``DistributedOptimizer.step``).

    ``errors`` maps each failing worker's name to its exception; the message
    lists them all, not just the last one."""

    def __init__(self, what: str, errors: dict[str, BaseException]) -> None:
        self.errors = dict(errors)
        lines = [f"  {w}: {type(e).__name__}: {e}" for w, e in sorted(self.errors.items())]
        super().__init__(f"{what} failed on {len(self.errors)} worker(s):\n" + "\n".join(lines))

    def __reduce__(self):
        return (CompositeError._rebuild, (self.args[0], list(self.errors)))

    @staticmethod
    def _rebuild(message: str, workers: list[str]) -> CompositeError:
        e = CompositeError.__new__(CompositeError)
        NbrpcError.__init__(e, message)
        e.errors = dict.fromkeys(workers)
        return e


class CellError(NbrpcError):
    """A cell run with ``%%rpc_on`` raised on one or more workers.

    ``errors`` maps each such worker to its error's type name, message and
    traceback (the worker's own, as its IPython wrote it). In IPython the
    error shows those tracebacks, each headed by its worker's name, and
    nothing of the magic that ran the cell.

    >>> e = CellError({"worker1": ("ZeroDivisionError", "division by zero",
    ...                            "Cell In[3], line 1\\nZeroDivisionError: division by zero")})
    >>> str(e)
    'the cell failed on worker1: ZeroDivisionError: division by zero'
    >>> e._render_traceback_()[:2]
    ['[worker1]', 'Cell In[3], line 1']
    """

    def __init__(self, errors: dict[str, tuple[str, str, str]]) -> None:
        self.errors = dict(errors)
        parts = [f"{w}: {name}: {message}" for w, (name, message, _) in self.errors.items()]
        super().__init__("the cell failed on " + "; on ".join(parts))

    def __reduce__(self):
        return (CellError, (self.errors,))

    def _render_traceback_(self) -> list[str]:
        """IPython shows each worker's traceback instead of the local one."""
        lines: list[str] = []
        for worker, (name, message, tb) in self.errors.items():
            lines.append(f"[{worker}]")
            lines += (tb.rstrip() or f"{name}: {message}").splitlines()
        return lines
