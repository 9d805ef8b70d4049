"""Make ``torch.distributed.rpc``, ``.autograd``, ``.optim.DistributedOptimizer``
and ``.nn.RemoteModule`` resolve to nbrpc in this process.

Imported first in every process that runs PyTorch's own RPC test suites
(``tests/test_torch_suites.py``: the fork server preloads it), before those
suites are imported, so that their ``import torch.distributed.rpc as rpc`` and
``from torch.distributed.rpc import RRef`` bind nbrpc, unchanged.

The public API is nbrpc's. The suites also import, at module level, a few of
TensorPipe's private helpers (``torch.distributed.rpc.api._use_rpc_pickler``,
``.internal.PythonUDF``, ...): those submodules stay PyTorch's own, so the
imports succeed; the tests that call them are excluded in
``tests/torch_suites.py``. The private function the suites' wait helpers call
(``_rref_context_get_debug_info``) is answered from nbrpc's own RRef tables.

Never import this in the pytest process itself: it replaces modules for the
whole interpreter.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.distributed
import torch.distributed.autograd  # noqa: F401  (the real module, replaced below)
import torch.distributed.nn
import torch.distributed.nn.api.remote_module as _torch_remote_module
import torch.distributed.optim
import torch.distributed.rpc as _torch_rpc  # its submodules (api, internal, ...) stay

import nbrpc.autograd
import nbrpc.nn
import nbrpc.optim
import nbrpc.rpc
from nbrpc.agent import current_agent


def _rref_context_get_debug_info() -> dict[str, str]:
    """TensorPipe's RRef-context counters, from nbrpc's RRef tables (as strings,
    as PyTorch returns them)."""
    state = current_agent("_rref_context_get_debug_info").ext["rref"].state
    owned = list(state.owned.values())
    users = list(state.users.values())
    pending = [u for u in users if u.state == "pending"]
    return {
        "num_owner_rrefs": str(len(owned)),
        "num_pending_futures": str(len(pending)),
        "num_pending_users": str(len(pending) + len(state.children)),
        "num_forks": str(sum(len(o.forks) for o in owned)),
    }


def _module(name: str, attrs: dict[str, Any], doc: str) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    mod.__dict__.update(attrs)
    return mod


def install() -> None:
    """Point ``torch.distributed.{rpc,autograd}``, ``DistributedOptimizer`` and
    ``RemoteModule`` at nbrpc (idempotent)."""
    if getattr(torch.distributed.rpc, "__nbrpc_alias__", False):
        return
    public = {k: getattr(nbrpc.rpc, k) for k in dir(nbrpc.rpc) if not k.startswith("__")}
    rpc = _module("torch.distributed.rpc", public, "nbrpc.rpc under torch's name")
    rpc.__nbrpc_alias__ = True
    rpc.__path__ = _torch_rpc.__path__  # so its real submodules still import
    for sub in ("api", "internal", "constants", "backend_registry", "options", "utils",
                "server_process_global_profiler", "rref_proxy"):
        real = sys.modules.get(f"torch.distributed.rpc.{sub}")
        if real is not None and not hasattr(rpc, sub):
            setattr(rpc, sub, real)
    rpc.functions = nbrpc.rpc.functions
    rpc._rref_context_get_debug_info = _rref_context_get_debug_info
    # Imported by rpc_test at module level; only excluded tests call it.
    rpc._get_debug_info = _torch_rpc._get_debug_info
    sys.modules["torch.distributed.rpc"] = rpc
    sys.modules["torch.distributed.rpc.functions"] = nbrpc.rpc.functions
    torch.distributed.rpc = rpc

    autograd = _module("torch.distributed.autograd", dict(vars(nbrpc.autograd)),
                       "nbrpc.autograd under torch's name")
    sys.modules["torch.distributed.autograd"] = autograd
    torch.distributed.autograd = autograd

    torch.distributed.optim.DistributedOptimizer = nbrpc.optim.DistributedOptimizer
    torch.distributed.nn.RemoteModule = nbrpc.nn.RemoteModule
    _torch_remote_module.RemoteModule = nbrpc.nn.RemoteModule


install()
