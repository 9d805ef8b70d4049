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
