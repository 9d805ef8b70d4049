"""nbrpc: PyTorch's RPC programming model over ZeroMQ, made for Jupyter.

Importing nbrpc starts nothing: no threads, no sockets, no zmq context until
``nbrpc.rpc.init_rpc`` (or a cluster start).
"""

from __future__ import annotations

import re
from typing import Any

__version__ = "0.1.0"
__all__ = ["Cluster", "ClusterError", "ClusterStatus", "load_ipython_extension", "show",
           "unload_ipython_extension"]


def _floors(requires: list[str]) -> dict[str, str | None]:
    """Each runtime requirement's ``>=`` bound, by name (None: it has none),
    from requirement strings as the package's metadata gives them; those of an
    extra are left out. What ``import nbrpc`` checks torch against, and what
    ``make test-oldest`` pins (tools/oldest.py).

    >>> _floors(["torch>=2.9", "numpy<3,>=1.24", "psutil", 'pytest>=8; extra == "test"'])
    {'torch': '2.9', 'numpy': '1.24', 'psutil': None}
    """
    floors: dict[str, str | None] = {}
    for text in requires:
        spec, _, marker = text.partition(";")
        if "extra" in marker:
            continue
        name = re.match(r"\s*([\w.-]+)", spec).group(1)
        low = [c.strip()[2:].strip() for c in spec.split(name, 1)[1].split(",")
               if c.strip().startswith(">=")]
        floors[name] = low[0] if low else None
    return floors


def _torch_too_old(version: str, floor: str | None) -> str | None:
    """What is wrong when torch ``version`` is older than ``floor`` (nbrpc's,
    from its metadata), with the fix; None when it is new enough or no floor is known.

    >>> _torch_too_old("2.4.1+cu121", "2.9")[:60]
    'nbrpc needs torch>=2.9, and this environment has torch 2.4.1'
    >>> _torch_too_old("2.13.0+cpu", "2.9") is None
    True
    """
    from torch.torch_version import TorchVersion

    if floor is None or TorchVersion(version) >= floor:
        return None
    return (f"nbrpc needs torch>={floor}, and this environment has torch {version} "
            f"(older releases lack autograd graph APIs nbrpc's backward uses). Upgrade "
            f"torch: pip install 'torch>={floor}' (a CPU-only build: add "
            "--index-url https://download.pytorch.org/whl/cpu).")


def _check_torch() -> None:
    """Refuse, at import, a torch older than nbrpc's floor, rather than fail
    deep inside a backward pass (pip enforces the floor; an environment built
    with --no-deps, or by conda, may not)."""
    import importlib.metadata

    import torch

    try:
        requires = importlib.metadata.requires("nbrpc") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return
    problem = _torch_too_old(str(torch.__version__), _floors(requires).get("torch"))
    if problem:
        raise ImportError(problem)


_check_torch()

# Layers that install themselves into every agent (request handlers, state):
# imported here so that an agent made through any entry point has them all.
from . import autograd as _autograd  # noqa: E402,F401
from . import rref as _rref  # noqa: E402,F401


def __getattr__(name):  # noqa: ANN001,ANN202 - lazy: ipyparallel loads only when used
    """``nbrpc.Cluster`` (and ``nbrpc.ClusterStatus``) without importing ipyparallel
    at ``import nbrpc``.

    >>> import nbrpc; nbrpc.Cluster.__module__
    'nbrpc.cluster.cluster'
    """
    if name in ("Cluster", "ClusterError", "ClusterStatus"):
        from . import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'nbrpc' has no attribute {name!r}")


def show(obj: Any = None, **options: Any) -> Any:
    """The widget of an nbrpc object: a message trace, an RRef graph or owner
    map (``show()`` alone: the group's RRef graph now), a backward stepper, a
    cluster, or an RRef (the graph with that value selected). ``options`` go
    to the object's ``widget()``.

    Needs the notebook packages (anywidget, ipywidgets, matplotlib).

    >>> import nbrpc
    >>> from nbrpc import rpc
    >>> rpc.init_rpc("s", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> kept = rpc.remote("s", dict)
    >>> view = nbrpc.show(kept)  # a cell's last line: the graph, this value selected
    >>> type(view).__name__
    'RRefGraphView'
    >>> nbrpc.show(42)
    Traceback (most recent call last):
      ...
    TypeError: nbrpc.show() shows traces, RRef graphs, owner maps, backward steppers, clusters and RRefs; got an int. ...
    >>> rpc.shutdown()
    """
    from . import views
    from .debug import rref_graph
    from .debug.words import a
    from .rref import RRef

    if obj is None:
        return rref_graph().widget(**options)
    if isinstance(obj, RRef):
        return rref_graph().widget(select=str(obj._id), **options)
    if hasattr(obj, "widget"):  # traces, graphs, owner maps, steppers, clusters
        return obj.widget(**options)
    raise TypeError(f"nbrpc.show() shows traces, RRef graphs, owner maps, backward steppers, "
                    f"clusters and RRefs; got {a(type(obj).__name__)}. Known views: "
                    f"{', '.join(views.known()) or '(none loaded yet)'}")


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext nbrpc``: registers ``%rpc_cluster`` and ``%%rpc_on``, and the rich
    (HTML) displays of RRefs, futures, cluster statuses, RRef graphs, traces and
    backward steppers. ``ip`` is IPython's ``InteractiveShell``; in a notebook::

        %load_ext nbrpc
        %rpc_cluster start 2

    (``tests/test_readme.py`` runs exactly this in a kernel; ``tests/test_magics.py``
    loads and unloads the extension in an IPython shell.)
    """
    from .jupyter.magics import load

    load(ip)


def unload_ipython_extension(ip: Any) -> None:
    """``%unload_ext nbrpc``: stops the kernel's cluster, if one runs, and removes
    the rich displays. In a notebook::

        %unload_ext nbrpc
    """
    from .jupyter.magics import unload

    unload(ip)
