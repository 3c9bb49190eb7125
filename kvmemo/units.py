"""Sizes as users write them ('2GiB', '512MiB', 1048576) -> byte counts (stdlib only).

Invariant: a parsed size is a positive int (or zero where the field allows it, allow_zero);
anything else raises ValueError naming the field.
"""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size_bytes(text: str | int, field_name: str, allow_zero: bool = False) -> int:
    """'2GiB' -> 2147483648. Integers pass through. Raises ValueError naming the field."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"{field_name} must be a size such as '2GiB', '512MiB' or a byte count, "
                f"got {text!r}"
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{field_name} must be {'>=' if allow_zero else '>'} 0 bytes, "
                         f"got {text!r}")
    return value
