"""The Jupyter layer: magics (``%rpc_cluster``, ``%%rpc_on``) and rich displays."""

from .magics import ClusterMagics

__all__ = ["ClusterMagics"]
