"""Random ids in uuid4's hex form, without building a :class:`uuid.UUID` (about 0.5 µs instead of 2).

``uuid.uuid4().hex`` validates and stores a 128-bit int, then formats it; this sets
the same version and variant bits on 16 random bytes and writes them as hex: the same
32 lowercase hex digits, from the same source (``os.urandom``).
"""

from __future__ import annotations

import os


def uuid4_hex() -> str:
    """What ``uuid.uuid4().hex`` returns: 32 hex digits, version 4, RFC 4122 variant."""
    b = bytearray(os.urandom(16))
    b[6] = b[6] & 0x0F | 0x40
    b[8] = b[8] & 0x3F | 0x80
    return b.hex()
