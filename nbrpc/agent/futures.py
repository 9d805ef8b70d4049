"""The future type returned by ``rpc_async``: a ``torch.futures.Future``.

It adds one thing: :meth:`RpcFuture.wait` from the main thread can be
interrupted (Jupyter's interrupt button raises KeyboardInterrupt within a
second) and leaves the future, the call and the agent intact, so the same
future can be waited on again. ``torch.futures.wait_all``, ``collect_all``
and ``.then()`` work as for any torch future.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

_SLICE = 0.25  # seconds between checks while waiting; bounds interrupt latency


class RpcFuture(torch.futures.Future):
    """A torch future completed by an nbrpc agent."""

    def __init__(self, io_ident: Callable[[], int | None] | None = None) -> None:
        torch._C.Future.__init__(self, [])  # CPU only: skip the device-list conversion
        self._io_ident = io_ident

    def wait(self) -> Any:
        if not self.done():
            self._block()
        return super().wait()

    def _block(self) -> None:
        if self._io_ident is not None and threading.get_ident() == self._io_ident():
            raise RuntimeError(
                "A future was waited on from nbrpc's I/O thread (inside a callback "
                "given to .then() or add_done_callback). That would deadlock: chain "
                "another .then() instead of calling wait() or rpc_sync() in a callback."
            )
        done = threading.Lock()  # released by the completing thread
        done.acquire()
        self.add_done_callback(lambda _f: done.release())
        while not done.acquire(timeout=_SLICE):  # slices keep Ctrl-C prompt
            pass

