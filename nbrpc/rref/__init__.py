"""Remote references: RRef objects and the owner tables behind them."""

from .rref import RRef, RRefContext, remote
from .state import OwnerTable, RRefId

__all__ = ["OwnerTable", "RRef", "RRefContext", "RRefId", "remote"]
