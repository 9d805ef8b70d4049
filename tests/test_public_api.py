"""The public API is documented as the project's standard asks: every public
function has type hints and a docstring with an example (a doctest, which
``make test`` runs, or an IPython block where only a notebook can run it), and
every public class has a docstring. "Public" is what each module's ``__all__``
names, for the modules a user imports."""

from __future__ import annotations

import importlib
import inspect

import pytest

MODULES = ["nbrpc", "nbrpc.rpc", "nbrpc.rpc.functions", "nbrpc.autograd", "nbrpc.optim",
           "nbrpc.nn", "nbrpc.debug", "nbrpc.errors", "nbrpc.cluster"]


def public(module: str) -> list[tuple[str, object]]:
    mod = importlib.import_module(module)
    assert hasattr(mod, "__all__"), f"{module} has no __all__: what is public is not said"
    return [(f"{module}.{name}", getattr(mod, name)) for name in mod.__all__
            if not inspect.ismodule(getattr(mod, name))]


def has_example(doc: str) -> bool:
    """A doctest, or an indented literal block (``::``) for IPython-only code.

    >>> has_example("Adds.\\n\\n>>> add(1, 2)\\n3"), has_example("In a notebook::\\n\\n    %x")
    (True, True)
    >>> has_example("Adds two numbers.")
    False
    """
    return ">>>" in doc or "::\n" in doc


def missing_hints(fn: object) -> list[str]:
    """The parameters (and ``return``) of ``fn`` that have no annotation.

    >>> def f(a: int, b) -> None: ...
    >>> missing_hints(f)
    ['b']
    """
    sig = inspect.signature(fn)
    names = [p.name for p in sig.parameters.values()
             if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    return names + (["return"] if sig.return_annotation is inspect.Signature.empty else [])


@pytest.mark.parametrize("module", MODULES)
def test_public_functions_have_hints_and_examples(module: str) -> None:
    problems = []
    for name, obj in public(module):
        doc = inspect.getdoc(obj) or ""
        if not doc:
            problems.append(f"{name}: no docstring")
        elif inspect.isfunction(obj) and not has_example(doc):
            problems.append(f"{name}: no example in its docstring")
        if inspect.isfunction(obj) and missing_hints(obj):
            problems.append(f"{name}: no type hints for {', '.join(missing_hints(obj))}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("ours, theirs", [
    ("nbrpc.rpc", "torch.distributed.rpc"), ("nbrpc.autograd", "torch.distributed.autograd"),
    ("nbrpc.optim", "torch.distributed.optim"), ("nbrpc.nn", "torch.distributed.nn")])
def test_every_public_function_and_class_of_pytorchs_rpc_api_is_here(ours: str,
                                                                     theirs: str) -> None:
    """What code written for PyTorch's RPC API calls by name exists in nbrpc's
    module of the same role (``torch_alias`` maps one onto the other). Left out:
    PyTorch's other distributed APIs that its modules re-export (collectives,
    ZeroRedundancyOptimizer, functional optimizers), its agents' C++ classes, the
    RPC profiler (see tests/torch_suites.py), and what its modules only import for
    their own use (``Generator``, ``urlparse``, ``timedelta``, ``method_factory``)."""
    elsewhere = {
        "torch.distributed.rpc": {"PyRRef", "RpcAgent", "TensorPipeAgent", "Store",
                                  "AllGatherStates", "RemoteProfilerManager",
                                  "enable_gil_profiling", "server_process_global_profiler",
                                  "method_factory", "new_method", "Generator", "urlparse",
                                  "timedelta"},
        "torch.distributed.autograd": {"DistAutogradContext"},
        "torch.distributed.optim": {"PostLocalSGDOptimizer", "ZeroRedundancyOptimizer",
                                    "apply_optimizer_in_backward", "as_functional_optim",
                                    "named_optimizer"},
        "torch.distributed.nn": {"Function", "ReduceOp", "all_gather", "all_reduce",
                                 "all_to_all", "all_to_all_single", "broadcast", "gather",
                                 "reduce", "reduce_scatter", "scatter", "group"},
    }[theirs]
    mod, torch_mod = importlib.import_module(ours), importlib.import_module(theirs)
    api = {name for name in dir(torch_mod) if not name.startswith("_")
           and (inspect.isfunction(getattr(torch_mod, name))
                or inspect.isclass(getattr(torch_mod, name))
                or inspect.isbuiltin(getattr(torch_mod, name)))}
    missing = sorted(name for name in api - elsewhere if not hasattr(mod, name))
    assert not missing, f"{ours} lacks {theirs}'s {missing}"
