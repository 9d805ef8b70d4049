"""nbrpc: PyTorch's RPC programming model over ZeroMQ, made for Jupyter.

Importing nbrpc starts nothing: no threads, no sockets, no zmq context until
``nbrpc.rpc.init_rpc`` (or a cluster start).
"""

__version__ = "0.1.0"

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


def load_ipython_extension(ip):  # noqa: ANN001,ANN201 - IPython's hook
    """``%load_ext nbrpc``: registers ``%rpc_cluster`` and ``%%rpc_on``."""
    from .jupyter.magics import load

    load(ip)


def unload_ipython_extension(ip):  # noqa: ANN001,ANN201 - IPython's hook
    """``%unload_ext nbrpc``: stops the kernel's cluster, if one runs."""
    from .jupyter.magics import unload

    unload(ip)
