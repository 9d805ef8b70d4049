"""Transport: frames, signing and the I/O thread. Knows nothing of pickle or torch."""

from .frames import BadMessage, Envelope, ShmRef, new_key, pack, unpack
from .io import IOLoop

__all__ = ["BadMessage", "Envelope", "IOLoop", "ShmRef", "new_key", "pack", "unpack"]
