"""Functions that tests call remotely, defined once.

Importable by name in every process a test starts: in-process groups and
``torch.multiprocessing.spawn`` children have ``tests/`` on their path, and
:mod:`fault_util` puts it on ``PYTHONPATH`` for its processes. Functions that
must travel by value (defined in a driver script's ``__main__``) stay there.
"""

from __future__ import annotations

import time


def add(a, b=0):
    return a + b


def echo(x):
    return x


def whoami() -> str:
    """The name of the worker this runs on (script mode: ``nbrpc.rpc``'s agent)."""
    from nbrpc import rpc

    return rpc.get_worker_info().name


def sleep_then(seconds: float, value):
    """``value``, after ``seconds`` of sleep (the GIL released)."""
    time.sleep(seconds)  # deliberate: keeps a worker thread busy for ``seconds``
    return value
