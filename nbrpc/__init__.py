"""nbrpc: PyTorch's RPC programming model over ZeroMQ, made for Jupyter.

Importing nbrpc starts nothing: no threads, no sockets, no zmq context until
``nbrpc.rpc.init_rpc`` (or a cluster start).
"""

__version__ = "0.1.0"
