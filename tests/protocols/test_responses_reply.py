"""The Responses replies, written as bytes directly: the ``response`` object's JSON, and a stream's events'.

The reference here builds each reply as the JSON value the writer built before (field by field, in
the same order); the bytes written must be that value's encoding, as parsed JSON with its members in
the same order.
"""

from __future__ import annotations

import json
from array import array
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actorproxy.core.messages import AssistantOutput, ToolCall, output_as_message
from actorproxy.core.parser import OutputDelta, ToolCallDelta
from actorproxy.core.requests import Identity
from actorproxy.core.turn_events import TurnDone, TurnIds
from actorproxy.errors import EngineError, ProxyError
from actorproxy.protocols import responses_api, responses_events, responses_format
from actorproxy.protocols.format import ReplyInfo
from actorproxy.protocols.responses_api import parse_responses_body
from actorproxy.protocols.responses_events import encrypt_reasoning
from actorproxy.protocols.responses_format import ResponsesFormat
from actorproxy.schema.jsonio import dumps, loads


class _Tokenizer:
    """Each id is its own one-character piece (not byte-level: decoded alone)."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["\u2581" + chr(0x4E00 + i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


IDS = TurnIds(array("i", [1]), array("i", [3, 4]), array("f", [-0.5, -1.25]), array("i", [0, 0]))
LOGPROBS = [{"token": chr(0x4E00 + i), "logprob": lp, "bytes": list(chr(0x4E00 + i).encode()), "top_logprobs": []}
            for i, lp in ((3, -0.5), (4, -1.25))]


def _call(encrypted: bool, logprobs: bool, **fields: Any) -> Any:
    include = [name for name, asked in (("reasoning.encrypted_content", encrypted),
                                        ("message.output_text.logprobs", logprobs)) if asked]
    return parse_responses_body({"model": "m", "input": "hi", "include": include, **fields})


class _Reference:
    """The reply's JSON values as they were built before: the items, the response object, the events."""

    def __init__(self, call: Any, response_id: str, model: str, created_at: int) -> None:
        self.call, self.id, self.model, self.created_at = call, response_id, model, created_at
        self.stem = response_id.removeprefix("resp_")
        self.items: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []

    def open(self, kind: str, **fields: Any) -> dict[str, Any]:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item: dict[str, Any] = {"id": f"{prefix}_{self.stem}_{len(self.items)}", "type": kind}
        if kind == "reasoning":
            item.update(summary=[], content=[])
        elif kind == "message":
            item.update(role="assistant", content=[])
        item.update(fields, status="in_progress")
        self.items.append(item)
        return item

    def done(self, item: dict[str, Any], text: str) -> dict[str, Any]:
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            if self.call.include_encrypted:
                item["encrypted_content"] = encrypt_reasoning(text)
        elif item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs}]
        else:
            item["arguments"] = text
        item["status"] = "completed"
        return item

    def response(self, status: str, done: TurnDone | None = None, error: ProxyError | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if done is not None and done.finish_reason == "length" else None
        usage = None if done is None else {
            "input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": self.items, "error": None if error is None else {"code": error.code, "message": error.message},
            "incomplete_details": incomplete, "usage": usage, **self.call.echo}
        if done is not None:
            body["actorproxy"] = {"step_index": done.step_index, "session_id": done.session_id,
                                  "tool_call_parse_error": done.tool_call_parse_error}
        return body

    def whole(self, done: TurnDone) -> dict[str, Any]:
        """The non-streamed reply."""
        if self.call.logprobs:
            self.logprobs = LOGPROBS
        output = done.output
        if output.reasoning:
            self.done(self.open("reasoning"), output.reasoning)
        if output.content or not output.tool_calls:
            self.done(self.open("message"), output.content)
        for call in output.tool_calls:
            self.done(self.open("function_call", call_id=call.id, name=call.name, arguments=""), call.arguments)
        return self.response("incomplete" if done.finish_reason == "length" else "completed", done)

    def stream(self, deltas: list[OutputDelta], end: TurnDone | ProxyError) -> list[dict[str, Any]]:
        """The events of a streamed reply, in order (each a JSON value, its ``sequence_number`` last)."""
        events: list[dict[str, Any]] = []
        opened: list[Any] = [None, []]  # the open item, its text's pieces

        def event(kind: str, **data: Any) -> None:
            events.append(json.loads(json.dumps({"type": kind, **data, "sequence_number": len(events)})))

        def where() -> dict[str, Any]:
            return {"item_id": opened[0]["id"], "output_index": len(self.items) - 1}

        def close() -> None:
            item = opened[0]
            if item is None:
                return
            text, at = "".join(opened[1]), where()
            if item["type"] == "reasoning":
                event("response.reasoning_text.done", **at, content_index=0, text=text)
                event("response.content_part.done", **at, content_index=0,
                      part={"type": "reasoning_text", "text": text})
            elif item["type"] == "message":
                event("response.output_text.done", **at, content_index=0, text=text, logprobs=self.logprobs)
                event("response.content_part.done", **at, content_index=0, part={
                    "type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs})
            else:
                event("response.function_call_arguments.done", **at, name=item["name"], arguments=text)
            self.done(item, text)
            event("response.output_item.done", output_index=at["output_index"], item=item)
            opened[:] = [None, []]

        def begin(kind: str, **fields: Any) -> None:
            close()
            opened[0] = self.open(kind, **fields)
            event("response.output_item.added", output_index=len(self.items) - 1, item=dict(opened[0]))
            part = {"reasoning": {"type": "reasoning_text", "text": ""},
                    "message": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}.get(kind)
            if part is not None:
                event("response.content_part.added", **where(), content_index=0, part=part)

        event("response.created", response=self.response("in_progress"))
        event("response.in_progress", response=self.response("in_progress"))
        for delta in deltas:
            if delta.reasoning:
                if opened[0] is None or opened[0]["type"] != "reasoning":
                    begin("reasoning")
                opened[1].append(delta.reasoning)
                event("response.reasoning_text.delta", **where(), content_index=0, delta=delta.reasoning)
            if delta.content:
                if opened[0] is None or opened[0]["type"] != "message":
                    begin("message")
                opened[1].append(delta.content)
                event("response.output_text.delta", **where(), content_index=0, delta=delta.content, logprobs=[])
            for piece in delta.tool_calls:
                if piece.id is not None:
                    begin("function_call", call_id=piece.id, name=piece.name or "", arguments="")
                if piece.arguments:
                    opened[1].append(piece.arguments)
                    event("response.function_call_arguments.delta", **where(), delta=piece.arguments)
        if isinstance(end, ProxyError):
            event("error", code=end.code, message=end.message, param=end.param)
            event("response.failed", response=self.response("failed", error=end))
            return events
        if self.call.logprobs:
            self.logprobs = LOGPROBS
            for item in self.items:
                if item["type"] == "message" and item["status"] == "completed":
                    item["content"][0]["logprobs"] = LOGPROBS
        close()
        status = "incomplete" if end.finish_reason == "length" else "completed"
        event(f"response.{status}", response=self.response(status, end))
        return events


def _ordered(value: Any) -> str:
    """A JSON value's text with its members in the order it has them (``==`` on dicts ignores the order)."""
    return json.dumps(value, ensure_ascii=False)


texts = st.text()
calls = st.lists(st.builds(ToolCall, id=texts, name=texts, arguments=texts), max_size=3).map(tuple)
echoed_fields = st.fixed_dictionaries({}, optional={
    "instructions": texts, "metadata": st.dictionaries(texts, texts, max_size=2),
    "temperature": st.floats(0, 2), "max_output_tokens": st.integers(1, 10**6), "store": st.booleans(),
    "previous_response_id": texts, "tools": st.just([{"type": "function", "name": "f", "parameters": {}}]),
})


#: A finished turn: any output (reasoning, text, tool calls), finish reason, usage; the sampled ids' logprobs.
dones = st.builds(
    lambda output, finish, counts, parse_error, session: TurnDone(
        counts[2], output, finish, counts[0], counts[1], parse_error, session_id=session, ids=IDS),
    st.builds(AssistantOutput, texts, texts, calls), st.sampled_from(["stop", "length", "tool_calls"]),
    st.tuples(*[st.integers(0, 10**6)] * 3), st.booleans(), st.none() | texts)


@given(done=dones, model=texts, stem=texts, encrypted=st.booleans(), logprobs=st.booleans(), fields=echoed_fields)
def test_a_responses_bytes_are_its_objects_json(
    done: TurnDone, model: str, stem: str, encrypted: bool, logprobs: bool, fields: dict[str, Any]
) -> None:
    call = _call(encrypted, logprobs, **fields)
    reply = ReplyInfo("resp_" + stem, model, "asked")
    body = ResponsesFormat(_Tokenizer()).render(call, reply, done)
    expected = _Reference(call, reply.id, model, loads(body)["created_at"]).whole(done)
    assert body == dumps(expected)


pieces = st.one_of(
    st.builds(lambda text: [OutputDelta(reasoning=text)], texts),
    st.builds(lambda text: [OutputDelta(content=text)], texts),
    st.builds(lambda reasoning, text: [OutputDelta(reasoning=reasoning, content=text)], texts, texts),
    st.builds(lambda index, id_, name, arguments, more: [
        OutputDelta(tool_calls=(ToolCallDelta(index, id_, name, arguments),)),
        *(OutputDelta(tool_calls=(ToolCallDelta(index, None, None, piece),)) for piece in more)],
        st.integers(0, 3), texts, st.none() | texts, texts, st.lists(texts, max_size=3)),
)
ends = st.one_of(st.sampled_from(["stop", "length", "tool_calls"]),
                 st.builds(EngineError, texts), st.builds(lambda m: ProxyError(m, param="input"), texts))


@given(runs=st.lists(pieces, max_size=8), end=ends, model=texts, stem=texts, encrypted=st.booleans(),
       logprobs=st.booleans(), fields=echoed_fields, session=st.none() | texts)
def test_a_streams_frames_are_their_events_json(
    runs: list[list[OutputDelta]], end: str | ProxyError, model: str, stem: str, encrypted: bool, logprobs: bool,
    fields: dict[str, Any], session: str | None,
) -> None:
    """Every frame is ``event: TYPE`` and the JSON of the event the writer built before, members in order: every
    kind of item and delta, the logprobs at the text's end, an incomplete reply and a failure after the start."""
    deltas = [delta for run in runs for delta in run]
    call = _call(encrypted, logprobs, **fields)
    reply = ReplyInfo("resp_" + stem, model, "asked")
    writer = ResponsesFormat(_Tokenizer()).writer(call, reply)
    frames = [writer.start(None), *(writer.delta(delta) for delta in deltas)]  # type: ignore[arg-type]
    if isinstance(end, str):
        ending: TurnDone | ProxyError = TurnDone(3, AssistantOutput("", "", ()), end, 5, 2, True, session_id=session,
                                                 ids=IDS)
        frames.append(writer.finish(ending))
    else:
        ending = end
        frames.append(writer.error(end))
    blocks = b"".join(frames).split(b"\n\n")
    assert blocks.pop() == b""
    sent = []
    for block in blocks:
        head, _, data = block.partition(b"\ndata: ")
        value = loads(data)
        assert head == b"event: " + value["type"].encode()
        sent.append(value)
    created = sent[0]["response"]["created_at"]
    expected = _Reference(call, reply.id, model, created).stream(deltas, ending)
    assert [_ordered(event) for event in sent] == [_ordered(event) for event in expected]


def _reply(tool_input: str = '{"city": "Paris"}') -> TurnDone:
    output = AssistantOutput("It is sunny.", "Check first.", (ToolCall("call_1", "weather", tool_input),))
    return TurnDone(step_index=0, output=output, finish_reason="tool_calls", prompt_tokens=3, completion_tokens=4,
                    tool_call_parse_error=False, session_id="s", ids=IDS)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    encoded: list[Any] = []

    def counted(value: Any) -> bytes:
        encoded.append(value)
        return dumps(value)

    for module in (responses_events, responses_format):
        monkeypatch.setattr(module, "dumps", counted, raising=False)
    return encoded


def test_no_json_value_is_built_for_the_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only strings are encoded (and the logprobs, when asked for, as chat's): the response object is written as
    bytes around them, as chat's completion and Anthropic's message are; its items are kept for a later
    ``item_reference`` as the bytes written."""
    fmt = ResponsesFormat(_Tokenizer())
    call = fmt.parse(fmt.load(dumps({"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f"}],
                                     "include": ["reasoning.encrypted_content"]})))
    encoded = _counting(monkeypatch)
    fmt.render(call, ReplyInfo("resp_1", "m", "s"), _reply())
    assert encoded and all(isinstance(value, str | None) for value in encoded), encoded


def test_no_json_value_is_built_for_a_streamed_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's every frame is written as bytes around its strings, its start and end too."""
    fmt = ResponsesFormat(_Tokenizer())
    call = fmt.parse(fmt.load(dumps({"model": "m", "input": "hi", "stream": True})))
    encoded = _counting(monkeypatch)
    writer = fmt.writer(call, ReplyInfo("resp_1", "m", "s"))
    writer.start(None)  # type: ignore[arg-type]
    for delta in (OutputDelta(reasoning="Hm."), OutputDelta(content="Sunny."),
                  OutputDelta(tool_calls=(ToolCallDelta(0, "call_1", "weather", '{"city": '),)),
                  OutputDelta(tool_calls=(ToolCallDelta(0, None, None, '"Paris"}'),))):
        writer.delta(delta)
    writer.finish(_reply())
    assert encoded and all(isinstance(value, str | None) for value in encoded), encoded


@pytest.mark.parametrize("stream", [False, True])
def test_a_stored_responses_items_resolve_as_they_were_sent(stream: bool) -> None:
    """An ``item_reference`` to a stored response's item is that item as the reply sent it, whether the reply was
    streamed or not: the reasoning with its encrypted content, the text with its logprobs, the call."""
    fmt = ResponsesFormat(_Tokenizer())
    body = {"model": "m", "input": "hi", "stream": stream,
            "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}
    call = fmt.parse(fmt.load(dumps(body)))
    reply, done = ReplyInfo("resp_abc", "m", "s"), _reply()
    if stream:
        writer = fmt.writer(call, reply)
        events = [loads(block.partition(b"data: ")[2]) for block in b"".join([
            writer.start(None),  # type: ignore[arg-type]
            writer.delta(OutputDelta(reasoning="Check first.")), writer.delta(OutputDelta(content="It is sunny.")),
            writer.delta(OutputDelta(tool_calls=(ToolCallDelta(0, "call_1", "weather", '{"city": "Paris"}'),))),
            writer.finish(done)]).split(b"\n\n")[:-1]]
        output = events[-1]["response"]["output"]
    else:
        output = loads(fmt.render(call, reply, done))["output"]
    assert [item["id"] for item in output] == ["rs_abc_0", "msg_abc_1", "fc_abc_2"]
    assert output[1]["content"][0]["logprobs"] == LOGPROBS
    references = {"model": "m", "input": [{"type": "item_reference", "id": item["id"]} for item in output]}
    resolved, owners = fmt.issued.resolve(references)
    assert resolved["input"] == output and owners == tuple((item["id"], "s") for item in output)


def test_a_stored_responses_output_becomes_a_message_only_when_a_later_request_continues_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``previous_response_id``'s conversation: a stored response keeps its output as the turn gave it, and it is
    made the assistant message once, when a later request continues from it (not on every stored turn's path)."""
    made: list[Any] = []

    def counted(output: AssistantOutput) -> dict[str, Any]:
        made.append(output)
        return output_as_message(output)

    for module in (responses_api, responses_format):
        monkeypatch.setattr(module, "output_as_message", counted, raising=False)
    fmt = ResponsesFormat()
    call = fmt.parse(fmt.load(dumps({"model": "m", "input": "hi", "instructions": "be brief"})))
    identity = Identity(session_id="s", client="c")
    done = _reply()
    fmt.completed(call, identity, ReplyInfo("resp_1", "m", "s"), done)
    assert made == []
    later = fmt.parse(fmt.load(dumps({"model": "m", "input": "and?", "previous_response_id": "resp_1"})))
    for _ in range(2):
        messages = fmt.prepare(later, identity).messages
        assert messages == [{"role": "user", "content": "hi"}, output_as_message(done.output),
                            {"role": "user", "content": "and?"}]
    assert made == [done.output]
