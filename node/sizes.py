"""Human byte sizes for flags and summaries: `100MB`, `1.5GiB`, `4096`."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


MAX_SIZE_BYTES = 2.0**63  # sizes are byte counts that must fit the int64 of a proto field


def parse_size(text: str) -> int:
    """Bytes in `text`; decimal units (MB) are powers of 10, binary ones (MiB, M) of 1024.

    Raises:
        ValueError: not a size.
    """
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 512MB, 2GiB, 1048576)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not value < MAX_SIZE_BYTES:  # inf (a number of 400 digits) and NaN fail too
        shown = str(text).strip()
        raise ValueError(f"{shown[:40]!r}{'...' if len(shown) > 40 else ''} is larger than any disk or memory")
    return int(value)


def format_size(n: float) -> str:
    """`1.50 MB` style, decimal units like most download tools."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def parse_budget(text: str, reference_bytes: int) -> int:
    """A byte budget: a size (`20GB`) or a percentage of `reference_bytes` (`50%`).

    Raises:
        ValueError: neither.
    """
    text = str(text).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ValueError(f"{text!r} is not a percentage (example: 50%)") from None
        if not 0 <= pct <= 100:
            raise ValueError(f"{text!r}: a percentage must be between 0% and 100%")
        return int(reference_bytes * pct / 100)
    return parse_size(text)
