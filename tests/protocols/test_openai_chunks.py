"""The chat completion's SSE chunks: a text delta's bytes written directly are the chunk's JSON, byte for byte."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from actorproxy.core.parser import OutputDelta
from actorproxy.protocols.openai_chat import ChunkWriter
from actorproxy.schema.jsonio import dumps, loads


def _as_json_value(writer: ChunkWriter, delta: dict[str, str]) -> bytes:
    """The frame the chunk's JSON value gives (how every chunk was written before)."""
    base = {k: v for k, v in loads(writer.start()[6:]).items() if k != "choices"}  # id, object, created, model
    chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}]}
    return b"data: " + dumps(chunk) + b"\n\n"


@given(text=st.text(min_size=1), model=st.text(), completion_id=st.text())
def test_a_text_deltas_frame_is_its_chunks_json(text: str, model: str, completion_id: str) -> None:
    writer = ChunkWriter(completion_id=completion_id, model=model)
    assert writer.delta(OutputDelta(content=text)) == _as_json_value(writer, {"content": text})
    assert writer.delta(OutputDelta(reasoning=text)) == _as_json_value(writer, {"reasoning_content": text})
    both = writer.delta(OutputDelta(reasoning=text, content="x"))
    assert both == _as_json_value(writer, {"reasoning_content": text}) + _as_json_value(writer, {"content": "x"})
    frame = loads(writer.delta(OutputDelta(content=text))[6:])
    assert frame["choices"][0]["delta"] == {"content": text} and frame["model"] == model


def test_an_empty_delta_writes_nothing() -> None:
    assert ChunkWriter(completion_id="c", model="m").delta(OutputDelta()) == b""
