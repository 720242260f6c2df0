"""The Anthropic replies, written as bytes directly: the ``message`` object's JSON, and a stream's events'."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actorproxy.core.messages import AssistantOutput, ToolCall
from actorproxy.core.parser import OutputDelta, ToolCallDelta
from actorproxy.core.turn_events import TurnAccepted, TurnDone
from actorproxy.protocols import anthropic_reply
from actorproxy.protocols.anthropic import AnthropicFormat, EventWriter, parse_messages_body, thinking_signature
from actorproxy.protocols.format import ReplyInfo
from actorproxy.schema.jsonio import dumps, loads


def _expected(done: TurnDone, reply: ReplyInfo, thinking: bool) -> bytes:
    """The reply's JSON value, field by field in Anthropic's order (how the reply was written before)."""
    output = done.output
    blocks: list[dict[str, Any]] = []
    if output.reasoning and thinking:
        blocks.append({"type": "thinking", "thinking": output.reasoning,
                       "signature": thinking_signature(output.reasoning)})
    if output.content:
        blocks.append({"type": "text", "text": output.content})
    for call in output.tool_calls:
        tool_input = call.parsed if isinstance(call.parsed, dict) else json.loads(call.arguments)
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input})
    if done.finish_reason == "length":
        reason, sequence = "max_tokens", None
    elif output.tool_calls:
        reason, sequence = "tool_use", None
    elif done.stop_sequence is not None:
        reason, sequence = "stop_sequence", done.stop_sequence
    else:
        reason, sequence = "end_turn", None
    return dumps({
        "id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": blocks,
        "stop_reason": reason, "stop_sequence": sequence,
        "usage": {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens},
        "actorproxy": {"session_id": done.session_id or reply.session_id, "step_index": done.step_index,
                       "tool_call_parse_error": done.tool_call_parse_error},
    })


texts = st.text()
inputs = st.dictionaries(st.text(), st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(), max_size=3)
calls = st.lists(st.builds(lambda id_, name, value, parsed: ToolCall(
    id=id_, name=name, arguments=json.dumps(value), parsed=value if parsed else None),
    texts, texts, inputs, st.booleans()), max_size=3).map(tuple)


@given(content=texts, reasoning=texts, tool_calls=calls, model=texts, reply_id=texts,
       session=st.none() | texts, finish=st.sampled_from(["stop", "length", "tool_calls"]),
       stop=st.none() | texts, parse_error=st.booleans(), thinking=st.booleans(),
       counts=st.tuples(*[st.integers(0, 10**6)] * 3))
def test_a_messages_bytes_are_its_objects_json(
    content: str, reasoning: str, tool_calls: tuple[ToolCall, ...], model: str, reply_id: str,
    session: str | None, finish: str, stop: str | None, parse_error: bool, thinking: bool,
    counts: tuple[int, int, int],
) -> None:
    prompt, completion, step = counts
    done = TurnDone(step_index=step, output=AssistantOutput(content, reasoning, tool_calls), finish_reason=finish,
                    prompt_tokens=prompt, completion_tokens=completion, tool_call_parse_error=parse_error,
                    session_id=session, stop_sequence=stop)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    if thinking:
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    call = parse_messages_body(body)
    reply = ReplyInfo(reply_id, model, "asked")
    assert AnthropicFormat().render(call, reply, done) == _expected(done, reply, thinking)


def test_no_json_value_is_built_for_the_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only strings (and a tool call's input, the value the parser read) are encoded: the message is written as
    bytes around them, as chat's completion is."""
    encoded: list[Any] = []

    def counted(value: Any) -> bytes:
        encoded.append(value)
        return dumps(value)

    monkeypatch.setattr(anthropic_reply, "dumps", counted)
    tool_input = {"path": "a.py"}
    output = AssistantOutput("Reading.", "Look first.", (ToolCall("toolu_1", "read_file", '{"path": "a.py"}',
                                                                  parsed=tool_input),))
    done = TurnDone(step_index=0, output=output, finish_reason="tool_calls", prompt_tokens=3, completion_tokens=4,
                    tool_call_parse_error=False, session_id="s")
    call = parse_messages_body({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                                "thinking": {"type": "enabled", "budget_tokens": 1024}})
    AnthropicFormat().render(call, ReplyInfo("msg_1", "m", "s"), done)
    assert encoded and all(isinstance(value, str | None) or value is tool_input for value in encoded), encoded


#: Each event's members in the order Anthropic (and the writer before) puts them, and those of its objects.
_KEYS = {
    "message_start": ["type", "message"], "ping": ["type"], "message_stop": ["type"],
    "content_block_start": ["type", "index", "content_block"], "content_block_stop": ["type", "index"],
    "content_block_delta": ["type", "index", "delta"], "message_delta": ["type", "delta", "usage"],
}
_INNER = {
    "message": ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
    "usage": ["input_tokens", "output_tokens"], "thinking": ["type", "thinking", "signature"],
    "text": ["type", "text"], "tool_use": ["type", "id", "name", "input"], "thinking_delta": ["type", "thinking"],
    "signature_delta": ["type", "signature"], "text_delta": ["type", "text"],
    "input_json_delta": ["type", "partial_json"],
}

pieces = st.one_of(
    st.builds(lambda text: OutputDelta(reasoning=text), texts),
    st.builds(lambda text: OutputDelta(content=text), texts),
    st.builds(lambda new, index, id_, name, arguments: OutputDelta(tool_calls=(ToolCallDelta(
        index, id_ if new else None, name if new else None, arguments),)),
        st.booleans(), st.integers(0, 3), texts, texts, texts),
)


@given(deltas=st.lists(pieces, max_size=12), thinking=st.booleans(), model=texts, message_id=texts,
       prompt=st.integers(0, 10**6), finish=st.sampled_from(["stop", "length"]), stop=st.none() | texts)
def test_a_streams_frames_are_their_events_json(
    deltas: list[OutputDelta], thinking: bool, model: str, message_id: str, prompt: int, finish: str,
    stop: str | None,
) -> None:
    """Every frame is ``event: NAME`` and its event's JSON, exactly as orjson writes the value it reads to, with
    the members in Anthropic's order; the deltas carry the text, the reasoning and the arguments as sampled."""
    writer = EventWriter(message_id=message_id, model=model, thinking=thinking)
    done = TurnDone(0, AssistantOutput("", "", ()), finish, prompt, 5, False, stop_sequence=stop)
    frames = [writer.start(TurnAccepted(0, prompt)), writer.heartbeat(),
              *(writer.delta(delta) for delta in deltas), writer.finish(done)]
    events = b"".join(frames).split(b"\n\n")
    assert events.pop() == b""
    sent: dict[str, str] = {"text_delta": "", "thinking_delta": "", "input_json_delta": ""}
    for event in events:
        head, _, data = event.partition(b"\ndata: ")
        name = head.removeprefix(b"event: ").decode()
        value = loads(data)
        assert dumps(value) == data and value["type"] == name and list(value) == _KEYS[name]
        for key, inner in value.items():
            kind = inner.get("type", key) if isinstance(inner, dict) else None
            if kind in _INNER:
                assert list(inner) == _INNER[kind]
            if kind in sent:
                sent[kind] += inner[_INNER[kind][1]]
    assert sent["text_delta"] == "".join(delta.content for delta in deltas)
    assert sent["thinking_delta"] == ("".join(delta.reasoning for delta in deltas) if thinking else "")
    assert sent["input_json_delta"] == "".join(piece.arguments for delta in deltas for piece in delta.tool_calls)


def test_no_json_value_is_built_for_a_streamed_delta(monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta's frame is written as bytes around its strings, as chat's chunks are."""
    writer = EventWriter(message_id="msg_1", model="m")
    writer.start(TurnAccepted(0, 3))
    encoded: list[Any] = []

    def counted(value: Any) -> bytes:
        encoded.append(value)
        return dumps(value)

    monkeypatch.setattr(anthropic_reply, "dumps", counted)
    for delta in (OutputDelta(reasoning="Hm."), OutputDelta(content="Reading."),
                  OutputDelta(tool_calls=(ToolCallDelta(0, "toolu_1", "read_file", '{"path": '),)),
                  OutputDelta(tool_calls=(ToolCallDelta(0, None, None, '"a.py"}'),))):
        writer.delta(delta)
    assert encoded and all(isinstance(value, str) for value in encoded), encoded
