"""An agent's options (``AgentOptions``) and their checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..transport.frames import DEFAULT_MAX_MESSAGE
from ..transport.zmqhub import LOST_HOSTS_CLOSE_LINKS
from .devices import DeviceConfig

# Busy is not dead: where a lost host's links close (Linux), a member whose
# kernel still acknowledges its connection is never declared dead for its
# silence alone, however long a C call holds its GIL; elsewhere, after 30 s.
DEFAULT_FAILURE_TIMEOUT = math.inf if LOST_HOSTS_CLOSE_LINKS else 30.0


@dataclass
class AgentOptions:
    num_worker_threads: int = 16
    rpc_timeout: float = 60.0
    host: str = "127.0.0.1"
    port: int = 0
    event_log_size: int = 10_000
    heartbeat_interval: float = 0.5  # seconds between heartbeats; 0 turns detection off
    # a member silent this long while its kernel still acknowledges its connection
    # (busy, stopped, swapping: the rule for what the link cannot show) is declared
    # dead; by default never on Linux (see DEFAULT_FAILURE_TIMEOUT)
    failure_timeout: float = DEFAULT_FAILURE_TIMEOUT
    # a member whose connection closed (its process exited, or its host stopped
    # acknowledging for about a second, zmqhub.UNACKED_MS: power loss, a partition,
    # a frozen VM) and that has been silent this long is declared dead
    link_timeout: float = 1.0
    max_message_size: int = DEFAULT_MAX_MESSAGE  # bytes a received message may declare
    max_message_age: float = 300.0  # older (by the sender's clock) is refused as a replay
    encrypt: bool = False  # CURVE-encrypt every connection (untrusted networks)
    local_ipc: bool = True  # peers on the same host connect over a Unix domain socket
    control_retry: float = 1.0  # first retry of an unanswered protocol message (doubles)
    gc_freeze: bool = True  # keep full GC collections short while running (see gcfreeze)
    devices: DeviceConfig | None = None  # CUDA devices and device maps (checked at join)


def _check_options(opts: AgentOptions) -> None:
    for field in ("heartbeat_interval", "failure_timeout", "link_timeout", "max_message_age"):
        value = getattr(opts, field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"{field} must be a number of seconds >= 0, got {value!r}")
    if opts.heartbeat_interval and opts.failure_timeout < 2 * opts.heartbeat_interval:
        raise ValueError(
            f"failure_timeout ({opts.failure_timeout:g} s) must be at least twice "
            f"heartbeat_interval ({opts.heartbeat_interval:g} s)")
    if not isinstance(opts.max_message_size, int) or opts.max_message_size < 1 << 20:
        raise ValueError(f"max_message_size must be an int of at least 1 MiB, got "
                         f"{opts.max_message_size!r}")

