"""A pool of up to ``num_worker_threads`` threads that run incoming calls.

Threads start on demand, so a freshly started agent costs little memory.
The pool tells threads that are *busy* from threads that are *blocked*: a
burst of quick calls must stay on a few threads instead of waking sixteen
that fight over the GIL (and each start its own OpenMP team for torch: a
64 MB echo took twice as long after such a burst), while a pool whose
threads are all blocked (in nested calls) must grow, or it deadlocks.

* nbrpc's own waits (``RpcFuture.wait``, so ``rpc_sync``, ``to_here``, a
  distributed backward) run inside :func:`blocking`, which marks the pool
  thread as blocked. When queued tasks outnumber the idle threads and every
  busy thread is blocked, a thread starts at once.
* Any other wait (user code on an ``Event``, a plain torch future, a sleep) is
  caught by a fallback: ``GROW_AFTER`` seconds after queued tasks came to
  outnumber the idle threads, if they still do and *no task has finished
  meanwhile*, a thread starts (and again every ``GROW_AFTER``). The delay is
  several of the interpreter's GIL switch intervals (5 ms), so that a thread
  merely waiting for the GIL on a loaded machine is not taken for a blocked
  one (2 ms grew a 2-core CI machine's pool to 16 during a burst). A check
  that runs late (by over ``GROW_AFTER``) proves nothing: the whole process
  was held up (a garbage collection, the machine's other processes), so it
  looks again instead of growing.

``busy`` counts the threads running a task right now, ``blocked`` those of
them waiting inside :func:`blocking`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()
GROW_AFTER = 0.025
_local = threading.local()  # .pool: the WorkerPool that owns the current thread


@contextmanager
def blocking() -> Iterator[None]:
    """Mark the calling thread as blocked (waiting on another worker) while
    the block runs. In a pool thread this lets the pool start another thread
    at once for queued tasks; elsewhere it does nothing.

    >>> with blocking():
    ...     pass
    """
    pool = getattr(_local, "pool", None)
    if pool is None:
        yield
        return
    pool._enter_blocking()
    try:
        yield
    finally:
        pool._leave_blocking()


class WorkerPool:
    def __init__(
        self,
        max_threads: int,
        name: str,
        on_thread_start: Callable[[], None] | None = None,
        call_later: Callable[..., object] | None = None,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self._name = name
        self._on_start = on_thread_start
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._idle = 0
        self._blocked = 0  # busy threads waiting inside blocking()
        self._stopped = False
        self._call_later = call_later
        self._check_pending = False
        self._finished = 0  # tasks done, the progress signal for growing
        self._finished_at_check = 0
        self._check_due = 0.0

    @property
    def size(self) -> int:
        return len(self._threads)

    @property
    def busy(self) -> int:
        return len(self._threads) - self._idle

    @property
    def blocked(self) -> int:
        return self._blocked

    @property
    def queued(self) -> int:
        return self._q.qsize()

    def submit(self, fn: Callable, *args: Any) -> None:
        self._q.put((fn, args))
        self._need_more()

    def _need_more(self) -> None:
        """Called when a task is queued, when an idle thread turns busy and when
        a busy one blocks: if queued tasks outnumber idle threads, add one: now
        if no thread can get to them (there is none, or every busy one is
        blocked), else after GROW_AFTER if no task finishes meanwhile (idle
        threads about to take a task are not stuck). "Idle" threads may be
        spoken for by earlier tasks, hence the queue."""
        if self._q.qsize() <= self._idle or self._stopped or (
                len(self._threads) >= self.max_threads):
            return
        busy = len(self._threads) - self._idle
        if not self._threads or self._call_later is None or 0 < busy <= self._blocked:
            self._grow()
        elif not self._check_pending:
            self._schedule_check()

    def _enter_blocking(self) -> None:
        with self._lock:
            self._blocked += 1
        self._need_more()

    def _leave_blocking(self) -> None:
        with self._lock:
            self._blocked -= 1

    def _schedule_check(self) -> None:
        self._check_pending = True
        self._finished_at_check = self._finished
        self._check_due = time.monotonic() + GROW_AFTER
        self._call_later(GROW_AFTER, self._grow_if_stuck)

    def _grow_if_stuck(self) -> None:
        self._check_pending = False
        if self._q.qsize() <= self._idle or self._stopped:
            return
        on_time = time.monotonic() - self._check_due < GROW_AFTER
        if on_time and self._finished == self._finished_at_check:  # no progress: blocked
            self._grow()
        if len(self._threads) < self.max_threads:
            self._schedule_check()

    def _grow(self) -> None:
        with self._lock:
            if self._q.qsize() <= self._idle or len(self._threads) >= self.max_threads:
                return
            t = threading.Thread(
                target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
            )
            self._threads.append(t)
            self._idle += 1
            t.start()

    def _work(self) -> None:
        _local.pool = self
        if self._on_start is not None:
            self._on_start()
        q, lock = self._q, self._lock
        while True:
            item = q.get()
            if item is _STOP:
                with lock:
                    self._idle -= 1
                return
            with lock:
                self._idle -= 1
            self._need_more()
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # a task's failure must not kill the thread
                log.exception("nbrpc worker task %r failed", fn)
            # drop the task before waiting for the next: its arguments (a
            # message's buffers, a freed RRef value) must not outlive it
            del item, fn, args
            with lock:
                self._idle += 1
                self._finished += 1

    def stop(self, timeout: float = 5.0) -> list[str]:
        """Ask every thread to finish, waiting ``timeout`` s in all; returns the
        names of those still running (stuck in user code)."""
        self._stopped = True
        for _ in self._threads:
            self._q.put(_STOP)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]
