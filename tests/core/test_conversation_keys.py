"""A conversation's key is hashable and stable whatever shape its messages take (issue 28 §7).

A session tells its conversations apart by the keys of their system prompt and
first message (:func:`actorproxy.core.lanes.conversation_key`), and the
append-only check compares context messages by :func:`message_key`. Clients
send tool-call ``arguments`` as a JSON string or as an object, ids and names of
odd types: every message the edge accepts must key without an error (a key
that cannot be hashed failed the whole session), and the two spellings of the
same call must key the same.
"""

from __future__ import annotations

import json
from typing import Any

from _util import WEATHER_TOOL, run_turn
from hypothesis import given, settings
from hypothesis import strategies as st

from actorproxy.config import ProxyConfig
from actorproxy.core.lanes import Conversations, conversation_key
from actorproxy.core.messages import AssistantOutput, ToolCall, echo_tolerance, message_key
from actorproxy.errors import BadRequest
from actorproxy.protocols.openai_chat import parse_chat_body
from actorproxy.runtime.runtime import open_runtime
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.tokenization.message_fields import FrozenMessage

JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8) | st.floats(
    allow_nan=False, allow_infinity=False
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)
ODD = JSON | st.just("") | st.just("{") | st.just("[" * 3000 + "]" * 3000) | st.just("\ud800")


def _call(arguments: Any, name: Any = "get_weather", call_id: Any = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "developer"]), "content": st.text(max_size=8)},
                          optional={"name": ODD, "tool_call_id": ODD}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none() | st.text(max_size=8)},
                          optional={"tool_calls": st.lists(st.builds(_call, ODD, st.text(max_size=5), ODD),
                                                           max_size=2),
                                    "name": ODD}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": st.text(max_size=8),
                           "tool_call_id": st.text(max_size=5)}, optional={"name": ODD}),
    st.fixed_dictionaries({"role": st.just("user"),
                           "content": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                      "text": st.text(max_size=5)}), max_size=2)}),
)


def _accepted(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the chat edge hands them to a session (raises its 400 where it refuses them)."""
    return parse_chat_body({"model": "m", "messages": messages}).request.messages


@settings(max_examples=300, deadline=None)
@given(st.lists(MESSAGE, min_size=1, max_size=4), st.lists(MESSAGE, min_size=1, max_size=4))
def test_any_accepted_messages_key_and_route(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    """Whatever the edge accepts keys without an error, hashes, and routes (main conversation settled or not)."""
    try:
        first, second = _accepted(first), _accepted(second)
    except BadRequest:  # refused at the edge with a 400: never reaches a session
        return
    ours = AssistantOutput("x", "", (ToolCall("call_1", "get_weather", '{"city": "Oslo"}'),),
                           schemas={"get_weather": {"city": {"type": "string"}, "days": {"default": 1}}})
    for message in (*first, *second):
        hash(message_key(message))
        assert message_key(message) == message_key(message)
        echo_tolerance(message, ours)  # an echo or not, never an error
    talks = Conversations("s", side_calls=True, sub_agents=True)
    talks.route(first)
    talks.continued(talks.active)  # the main conversation is known: another one goes to a child session
    talks.route(second)
    talks.route(first)
    assert talks.active is talks.settled
    hash(conversation_key(second))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=5), JSON, max_size=4))
def test_arguments_as_object_key_as_their_json_text(arguments: Any) -> None:
    """A call's arguments sent as an object key as the same arguments sent as JSON text (the echo still matches)."""
    as_object = {"role": "assistant", "content": None, "tool_calls": [_call(arguments)]}
    as_text = {"role": "assistant", "content": None, "tool_calls": [_call(json.dumps(arguments, indent=1))]}
    assert message_key(as_object) == message_key(as_text)
    hash(message_key(as_object))
    ours = AssistantOutput("", "", (ToolCall("call_1", "get_weather", json.dumps(arguments)),))
    assert echo_tolerance(as_object, ours) is not None


async def test_a_second_conversation_with_object_arguments_does_not_fail_the_session(tokenizer: Any) -> None:
    """Once the main conversation went on, another one opening with a tool call whose arguments are an
    object is served (it failed the session actor: ``unhashable type: 'dict'``)."""
    engine = SimEngine(tokenizer, SimConfig(seed=3, token_interval=0.0))
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        main = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "hi"}]
        reply = await run_turn(runtime, "s", main)
        reply = await run_turn(runtime, "s", [*main, reply.message, {"role": "user", "content": "more"}])
        assert reply.error is None
        other = [{"role": "system", "content": "Another agent."},
                 {"role": "assistant", "content": None, "tool_calls": [_call({"city": "Oslo"})]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        for _ in range(2):  # the conversation is opened, then found again
            reply = await run_turn(runtime, "s", other, tools=[WEATHER_TOOL])
            assert reply.error is None, reply.error
        reply = await run_turn(runtime, "s", [*main, reply.message, {"role": "user", "content": "again"}])
        assert reply.error is None


_ROLE = st.sampled_from(["system", "user", "assistant"])
_POOL = st.lists(st.tuples(_ROLE, st.sampled_from(["a", "b"])), min_size=1, max_size=5)
#: One turn: its messages (an index into the pool, and whether the frozen one or the caller's own dict),
#: then a dict of the caller's edited in place before the next turn (its index and new role).
_TURNS = st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=4),
                            st.integers(0, 4), _ROLE), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(_POOL, _TURNS)
def test_the_key_of_repeated_frozen_messages_is_the_key_read_again(
    pool: list[tuple[str, str]], turns: list[tuple[list[tuple[int, bool]], int, str]]
) -> None:
    """``Conversations.key`` (last turn's key when a turn opens with its very frozen messages) equals
    :func:`conversation_key` read again, turn after turn, whatever the messages: the same frozen objects,
    equal plain copies, the caller's own dicts edited in place between turns, a system prompt added or
    dropped, several system prompts, none but system prompts."""
    frozen = [FrozenMessage(role=role, content=text) for role, text in pool]
    own = [{"role": role, "content": text} for role, text in pool]
    talks = Conversations("s", side_calls=True, sub_agents=True)
    for picked, edited, role in turns:
        messages = [(frozen if is_frozen else own)[i % len(pool)] for i, is_frozen in picked]
        assert talks.key(messages) == conversation_key(messages)
        own[edited % len(pool)]["role"] = role
