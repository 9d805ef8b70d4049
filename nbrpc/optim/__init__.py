"""``DistributedOptimizer``: one local optimizer per parameter owner.

Same API as ``torch.distributed.optim.DistributedOptimizer``.
"""

from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
