"""Ids in uuid4's form (``core.ids``)."""

from __future__ import annotations

import uuid

from actorproxy.core.ids import uuid4_hex


def test_ids_are_uuid4_hex() -> None:
    for _ in range(1000):
        text = uuid4_hex()
        parsed = uuid.UUID(hex=text)
        assert parsed.hex == text and parsed.version == 4 and parsed.variant == uuid.RFC_4122
