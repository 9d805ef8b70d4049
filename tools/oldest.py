"""``make test-oldest``: pins for the oldest releases that nbrpc's requirements admit.

Each runtime dependency's lower bound in ``pyproject.toml`` (``torch>=2.9`` and
the others) is a promise to users who install nbrpc into an environment they
already have. This prints one pin per dependency, its ``>=`` floor as ``==``,
for ``pip install -c``: ``make test-oldest`` builds ``.venv-oldest`` with them
and runs the fast tiers there. The floors are read from the installed package's
metadata (made from ``pyproject.toml``, as ``import nbrpc`` reads torch's
floor), never written twice.

Usage: ``python tools/oldest.py > pins.txt``, in an environment with nbrpc installed.
"""

from __future__ import annotations

import importlib.metadata

from packaging.requirements import Requirement


def floors(requires: list[str]) -> list[str]:
    """``name==version`` for each runtime requirement (those without an extra's
    marker), its ``>=`` bound; a dependency with no lower bound is an error: its
    oldest release is not a version anyone chose.

    >>> floors(["torch>=2.9", "numpy<3,>=1.24", 'pytest>=8; extra == "test"'])
    ['torch==2.9', 'numpy==1.24']
    >>> floors(["psutil"])
    Traceback (most recent call last):
    ...
    ValueError: 'psutil' in pyproject.toml has no lower bound (>=): give it the oldest release nbrpc supports
    """
    pins = []
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        low = [s.version for s in req.specifier if s.operator == ">="]
        if not low:
            raise ValueError(f"{text!r} in pyproject.toml has no lower bound (>=): "
                             "give it the oldest release nbrpc supports")
        pins.append(f"{req.name}=={low[0]}")
    return pins


if __name__ == "__main__":
    print("\n".join(floors(importlib.metadata.requires("nbrpc") or [])))
