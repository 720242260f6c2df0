"""A streamed token alone, as the engine client hands it over (a one-id tuple), reads as in any other batch."""

from __future__ import annotations

from typing import Any

import pytest

from actorproxy.core.parser import OutputParser

TEXTS = [
    "<think>\nI should check.\n</think>\n\nLet me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
    "  Plain text with spaces at both ends, café 🌞 and 漢字の文字列.  \n\n",
    "thinking here\n</think>\n\nanswer with a STOP in it and more after",
]
SETTINGS: list[dict[str, Any]] = [
    {},
    {"reasoning_open": True},
    {"stop": ("STOP",)},
    {"reasoning_format": "none"},
    {"tool_call_format": "llama3"},
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("settings", SETTINGS)
def test_a_token_alone_reads_as_in_a_list(tokenizer: Any, text: str, settings: dict[str, Any]) -> None:
    ids = tokenizer.encode(text).tolist() + [tokenizer.eot_token_id]
    alone = OutputParser(tokenizer, tool_call_id=lambda i: f"call_{i}", **settings)
    listed = OutputParser(tokenizer, tool_call_id=lambda i: f"call_{i}", **settings)
    deltas_alone = [alone.feed((tid,)) for tid in ids] + [alone.finish()]
    deltas_listed = [listed.feed([tid]) for tid in ids] + [listed.finish()]
    assert deltas_alone == deltas_listed
    assert alone.output == listed.output
    assert alone.stopped == listed.stopped
    assert "".join(d.content for d in deltas_alone) or "".join(d.reasoning for d in deltas_alone)
