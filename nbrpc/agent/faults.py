"""Fault injection: drop or delay chosen outgoing messages, for tests.

Each agent has a :class:`FaultPlan` (``agent.faults``), empty unless a test
adds rules. A rule matches a request op (``"rref_fork"``, ``"rref_delete"``,
...) going out as a request, or the reply to it (``reply=True``), and fires
``times`` times.

>>> plan = FaultPlan()
>>> _ = plan.add("rref_delete", "drop")
>>> plan.take("rref_delete", reply=False), plan.take("rref_delete", reply=False)
(('drop', 0.0), None)
>>> plan.fired
[('rref_delete', 'request', 'drop')]
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class FaultRule:
    op: str
    action: str  # "drop" | "delay"
    times: int = 1
    delay: float = 0.0
    reply: bool = False


class FaultPlan:
    """Rules consulted on every send while any is left (one attribute read otherwise)."""

    def __init__(self) -> None:
        self.rules: list[FaultRule] = []
        self.fired: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def add(self, op: str, action: str = "drop", *, times: int = 1, delay: float = 0.0,
            reply: bool = False) -> FaultRule:
        """Drop (or delay by ``delay`` s) the next ``times`` messages of ``op``."""
        if action not in ("drop", "delay"):
            raise ValueError(f"action must be 'drop' or 'delay', got {action!r}")
        rule = FaultRule(op, action, times, delay, reply)
        with self._lock:
            self.rules.append(rule)
        return rule

    def take(self, op: str, reply: bool) -> tuple[str, float] | None:
        """The fault for this message, if a rule matches (and uses it up)."""
        with self._lock:
            for rule in self.rules:
                if rule.op == op and rule.reply == reply:
                    rule.times -= 1
                    if rule.times <= 0:
                        self.rules.remove(rule)
                    self.fired.append((op, "reply" if reply else "request", rule.action))
                    return rule.action, rule.delay
        return None
