"""nbrpc: PyTorch's RPC programming model over ZeroMQ, made for Jupyter.

Importing nbrpc starts nothing: no threads, no sockets, no zmq context until
``nbrpc.rpc.init_rpc`` (or a cluster start).
"""

__version__ = "0.1.0"

# Layers that install themselves into every agent (request handlers, state):
# imported here so that an agent made through any entry point has them all.
from . import autograd as _autograd  # noqa: E402,F401
from . import rref as _rref  # noqa: E402,F401
