"""``make test-oldest``: pins for the oldest releases that nbrpc's requirements admit.

Each runtime dependency's lower bound in ``pyproject.toml`` (``torch>=2.9`` and
the others) is a promise to users who install nbrpc into an environment they
already have. This prints one pin per dependency, its ``>=`` floor as ``==``,
for ``pip install -c``: ``make test-oldest`` builds ``.venv-oldest`` with them
and runs the fast tiers there. The floors are read from the installed package's
metadata (made from ``pyproject.toml``) by the function ``import nbrpc`` checks
torch's floor with, so they are written, and parsed, once.

Usage: ``python tools/oldest.py > pins.txt``, in an environment with nbrpc installed.
"""

from __future__ import annotations

import importlib.metadata

from nbrpc import _floors


def pins(requires: list[str]) -> list[str]:
    """``name==floor`` for each runtime requirement; one with no lower bound is
    an error: its oldest release is not a version anyone chose.

    >>> pins(["torch>=2.9", "numpy<3,>=1.24", 'pytest>=8; extra == "test"'])
    ['torch==2.9', 'numpy==1.24']
    >>> pins(["psutil"])
    Traceback (most recent call last):
    ...
    ValueError: psutil in pyproject.toml has no lower bound (>=): give it the oldest release nbrpc supports
    """
    out = []
    for name, floor in _floors(requires).items():
        if floor is None:
            raise ValueError(f"{name} in pyproject.toml has no lower bound (>=): "
                             "give it the oldest release nbrpc supports")
        out.append(f"{name}=={floor}")
    return out


if __name__ == "__main__":
    print("\n".join(pins(importlib.metadata.requires("nbrpc") or [])))
