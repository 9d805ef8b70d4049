"""Run a Python module that must not outlive the process that started it.

``python -m nbrpc.cluster.guard MODULE ARGS...`` runs ``python -m MODULE ARGS...``
in this interpreter, with a daemon thread that ends the process as soon as
its parent is gone (it is re-parented: ``os.getppid()`` changes). Processes
the module forks (ipyparallel's controller forks its heart monitor) get the
same watch on *their* parent, so a whole tree goes when its root goes. The
cluster starts ipyparallel's controller this way, so that a kernel killed
with SIGKILL leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import threading
import time

log = logging.getLogger(__name__)


def watch_parent(parent: int, period: float = 0.25) -> threading.Thread:
    """Exit this process (code 3) within ``period`` seconds of ``parent`` dying,
    killing this process's own children first."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        log.warning("parent process %d is gone; exiting", parent)
        _kill_children()
        os._exit(3)

    t = threading.Thread(target=watch, name="nbrpc-parent-watch", daemon=True)
    t.start()
    return t


def _kill_children() -> None:
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _watch_in_forked_child() -> None:
    watch_parent(os.getppid())


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m nbrpc.cluster.guard MODULE [ARGS...]")
    watch_parent(os.getppid())
    os.register_at_fork(after_in_child=_watch_in_forked_child)
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
