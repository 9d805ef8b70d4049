"""Clusters of ipyparallel engines hosting nbrpc agents (the notebook's ``%rpc_cluster``)."""

from .cluster import Cluster, ClusterError
from .status import ClusterStatus, WorkerStatus

__all__ = ["Cluster", "ClusterError", "ClusterStatus", "WorkerStatus"]
