"""Remote references: RRef objects, the fork/delete protocol and its tables."""

from .context import RRefContext, RRefLeakWarning
from .rref import RRef, remote
from .state import RRefId, RRefState

__all__ = ["RRef", "RRefContext", "RRefId", "RRefLeakWarning", "RRefState", "remote"]
