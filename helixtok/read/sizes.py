"""Sizes as people write them: 1GiB, 512MiB, 200GB or 100000000 bytes."""

from __future__ import annotations

import re

from ..format.errors import ConfigError

SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(value: str | int) -> int:
    """Bytes in `value` (an int, or a size like "64MiB"); a ConfigError naming the value otherwise."""
    if isinstance(value, int):
        return value
    m = SIZE_RE.match(str(value))
    if not m or (m.group(2) or "").lower() not in UNITS:
        raise ConfigError(f"{value!r} is not a size like 1GiB, 512MiB or 100000000")
    return int(float(m.group(1)) * UNITS[(m.group(2) or "").lower()])
