"""The chat completion's SSE chunks: every frame's bytes, written directly, are the chunk's JSON, byte for byte."""

from __future__ import annotations

from array import array
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from actorproxy.core.messages import AssistantOutput
from actorproxy.core.parser import OutputDelta, ToolCallDelta
from actorproxy.core.turn_events import TurnDone, TurnIds
from actorproxy.protocols import openai_chat
from actorproxy.protocols.openai_chat import ChunkWriter
from actorproxy.schema.jsonio import dumps, loads


def _as_json_value(writer: ChunkWriter, delta: dict[str, Any], finish_reason: str | None = None,
                   logprobs: Any = None) -> bytes:
    """The frame the chunk's JSON value gives (how every chunk was written before)."""
    chunk = {**_base(writer), "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                           "logprobs": logprobs}]}
    return b"data: " + dumps(chunk) + b"\n\n"


def _base(writer: ChunkWriter) -> dict[str, Any]:
    """A chunk's id, object, created and model, as the writer's first frame has them."""
    return {k: v for k, v in loads(writer.start()[6:]).items() if k != "choices"}


texts = st.text()


@given(model=texts, completion_id=texts)
def test_the_first_chunks_frame_is_its_json(model: str, completion_id: str) -> None:
    writer = ChunkWriter(completion_id=completion_id, model=model)
    assert writer.start() == _as_json_value(writer, {"role": "assistant", "content": ""})
    assert list(_base(writer)) == ["id", "object", "created", "model"]
    assert (_base(writer)["id"], _base(writer)["model"]) == (completion_id, model)


@given(pieces=st.lists(st.builds(ToolCallDelta, index=st.integers(0, 99), id=st.none() | texts,
                                 name=st.none() | texts, arguments=texts), min_size=1, max_size=3),
       text=texts)
def test_a_tool_call_deltas_frames_are_their_chunks_json(pieces: list[ToolCallDelta], text: str) -> None:
    writer = ChunkWriter(completion_id="chatcmpl-1", model="m")
    expected = _as_json_value(writer, {"content": text}) if text else b""
    for piece in pieces:
        call: dict[str, Any] = {"index": piece.index}
        if piece.id is not None:
            call.update(id=piece.id, type="function", function={"name": piece.name, "arguments": piece.arguments})
        else:
            call["function"] = {"arguments": piece.arguments}
        expected += _as_json_value(writer, {"tool_calls": [call]})
    assert writer.delta(OutputDelta(content=text, tool_calls=tuple(pieces))) == expected


class _Tokenizer:
    """Each id a piece of its own, decoded alone."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["\u2581" + str(i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(str(i) for i in ids)


@given(finish=st.sampled_from(["stop", "length", "tool_calls"]), usage=st.booleans(), logprobs=st.booleans(),
       counts=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)))
def test_the_last_chunks_frames_are_their_json(finish: str, usage: bool, logprobs: bool,
                                               counts: tuple[int, int]) -> None:
    writer = ChunkWriter(completion_id="chatcmpl-1", model="m", include_usage=usage,
                         tokenizer=_Tokenizer() if logprobs else None)
    ids = TurnIds(array("i", [1]), array("i", [7]), array("f", [-0.5]), array("i", [0]))
    done = TurnDone(step_index=0, output=AssistantOutput("x", "", ()), finish_reason=finish,
                    prompt_tokens=counts[0], completion_tokens=counts[1], tool_call_parse_error=False, ids=ids)
    content = [{"token": "7", "logprob": -0.5, "bytes": [55], "top_logprobs": []}]
    expected = _as_json_value(writer, {}, finish, {"content": content, "refusal": None} if logprobs else None)
    if usage:
        expected += b"data: " + dumps({**_base(writer), "choices": [], "usage": {
            "prompt_tokens": counts[0], "completion_tokens": counts[1], "total_tokens": sum(counts)}}) + b"\n\n"
    assert writer.finish(done) == expected + b"data: [DONE]\n\n"


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


def test_no_frame_builds_the_chunks_json_value(monkeypatch: Any) -> None:
    """Only strings (and null) are encoded: the frames are written around them, with no object or array built."""
    encoded: list[type] = []

    def recording(value: Any) -> bytes:
        encoded.append(type(value))
        return dumps(value)

    monkeypatch.setattr(openai_chat, "dumps", recording)
    writer = ChunkWriter(completion_id="chatcmpl-1", model="m", include_usage=True)
    done = TurnDone(step_index=0, output=AssistantOutput("x", "", ()), finish_reason="stop",
                    prompt_tokens=3, completion_tokens=1, tool_call_parse_error=False)
    writer.start()
    writer.delta(OutputDelta(reasoning="r", content="c", tool_calls=(
        ToolCallDelta(0, "call_1", "f", '{"a"'), ToolCallDelta(0, None, None, ": 1}"))))
    writer.finish(done)
    openai_chat.completion_bytes(done, completion_id="chatcmpl-1", model="m", session_id="s")
    assert set(encoded) <= {str, type(None)}, encoded
