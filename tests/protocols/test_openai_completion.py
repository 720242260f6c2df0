"""The non-streamed chat completion: its bytes, written directly, are the ``chat.completion`` object's JSON."""

from __future__ import annotations

from array import array
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from actorproxy.core.messages import AssistantOutput, ToolCall
from actorproxy.core.turn_events import TurnDone, TurnIds
from actorproxy.protocols.format import ReplyInfo
from actorproxy.protocols.openai_chat import OpenAIChatFormat, parse_chat_body
from actorproxy.schema.jsonio import dumps, loads


def _expected(done: TurnDone, reply: ReplyInfo, created: int, logprobs: Any) -> bytes:
    """The reply's JSON value, field by field in OpenAI's order (how the reply was written before)."""
    output = done.output
    message: dict[str, Any] = {"role": "assistant",
                               "content": output.content if (output.content or not output.tool_calls) else None}
    if output.reasoning:
        message["reasoning_content"] = output.reasoning
    if output.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                               "arguments": c.arguments}}
                                 for c in output.tool_calls]
    return dumps({
        "id": reply.id, "object": "chat.completion", "created": created, "model": reply.model,
        "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason, "logprobs": logprobs}],
        "usage": {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                  "total_tokens": done.prompt_tokens + done.completion_tokens},
        "actorproxy": {"session_id": done.session_id or reply.session_id, "step_index": done.step_index,
                       "tool_call_parse_error": done.tool_call_parse_error},
    })


class _Tokenizer:
    """Each id is its own one-character piece (not byte-level: decoded alone)."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["\u2581" + chr(0x4E00 + i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


texts = st.text()
calls = st.lists(st.builds(ToolCall, id=texts, name=texts, arguments=texts), max_size=3).map(tuple)


@given(content=texts, reasoning=texts, tool_calls=calls, model=texts, reply_id=texts,
       session=st.none() | texts, finish=st.sampled_from(["stop", "length", "tool_calls"]),
       parse_error=st.booleans(), logprobs=st.booleans(), counts=st.tuples(*[st.integers(0, 10**6)] * 3))
def test_a_completions_bytes_are_its_objects_json(
    content: str, reasoning: str, tool_calls: tuple[ToolCall, ...], model: str, reply_id: str,
    session: str | None, finish: str, parse_error: bool, logprobs: bool, counts: tuple[int, int, int],
) -> None:
    prompt, completion, step = counts
    ids = TurnIds(array("i", [1]), array("i", [3, 4]), array("f", [-0.5, -1.25]), array("i", [0, 0]))
    done = TurnDone(step_index=step, output=AssistantOutput(content, reasoning, tool_calls), finish_reason=finish,
                    prompt_tokens=prompt, completion_tokens=completion, tool_call_parse_error=parse_error,
                    session_id=session, ids=ids)
    fmt = OpenAIChatFormat(_Tokenizer())
    call = parse_chat_body({"messages": [{"role": "user", "content": "hi"}], "logprobs": logprobs})
    reply = ReplyInfo(reply_id, model, "asked")
    body = fmt.render(call, reply, done)
    assert isinstance(body, bytes)
    expected_logprobs = None if not logprobs else {"content": [
        {"token": chr(0x4E00 + i), "logprob": lp, "bytes": list(chr(0x4E00 + i).encode()),
         "top_logprobs": []} for i, lp in ((3, -0.5), (4, -1.25))], "refusal": None}
    assert body == _expected(done, reply, loads(body)["created"], expected_logprobs)
