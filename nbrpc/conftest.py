"""Doctests of the package: one that fails part-way leaves no RPC agent behind
(pytest loads this file for the doctests under nbrpc/; numpy ships one too).

pytest stops a doctest at its first failing example, so a docstring that
calls ``init_rpc`` would otherwise skip its ``shutdown()`` and every later
doctest's ``init_rpc`` would fail with ``AlreadyInitializedError``: one
failure would read as many.
"""

from __future__ import annotations

import logging

import pytest
from _pytest.doctest import DoctestItem

log = logging.getLogger(__name__)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if not isinstance(item, DoctestItem):
        return
    from .rpc import api

    agent = api._Default.agent
    if agent is not None:
        log.warning("doctest %s left RPC initialized as %r: shutting it down", item.name,
                    agent.name)
        api.shutdown(graceful=False)
