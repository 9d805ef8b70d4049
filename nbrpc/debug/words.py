"""How the debugging texts count and name things, so that they read as English.

>>> plural(1, "user fork"), plural(2, "user fork"), plural(0, "item")
('1 user fork', '2 user forks', '0 items')
>>> plural(2, "reply"), plural(2, "key")
('2 replies', '2 keys')
>>> plural(3, "RRef object in Out", "RRef objects in Out")
'3 RRef objects in Out'
>>> a("ParameterServer"), a("Optimizer"), a("")
('a ParameterServer', 'an Optimizer', 'a ')
"""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and the noun: singular for exactly one, else ``nouns`` (by default
    the noun with an ``s``, or ``ies`` for a ``y`` after a consonant).

    >>> plural(1, "worker"), plural(3, "worker"), plural(2, "reply"), plural(0, "day")
    ('1 worker', '3 workers', '2 replies', '0 days')
    """
    if n == 1:
        return f"{n} {noun}"
    if nouns is None:
        y = noun.endswith("y") and noun[-2:-1].lower() not in ("a", "e", "i", "o", "u")
        nouns = noun[:-1] + "ies" if y else noun + "s"
    return f"{n} {nouns}"


def a(noun: str) -> str:
    """The noun with its indefinite article: ``a list``, ``an Optimizer``."""
    return f"{'an' if noun[:1].lower() in ('a', 'e', 'i', 'o', 'u') else 'a'} {noun}"


def fmt_bytes(n: int | float | None) -> str:
    """A size in bytes, in B, KiB, MiB or GiB.

    >>> fmt_bytes(16), fmt_bytes(64 << 20), fmt_bytes(None)
    ('16 B', '64.0 MiB', '?')
    """
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
