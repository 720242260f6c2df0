"""The connection state machine (``actorproxy.http.state``): every transition, legal and illegal, from a table."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from actorproxy.http.errors import ProtocolError
from actorproxy.http.state import (
    CLIENT,
    CLOSED,
    DONE,
    ERROR,
    IDLE,
    MUST_CLOSE,
    SEND_BODY,
    SEND_RESPONSE,
    SERVER,
    ConnectionState,
)

Step = Callable[[ConnectionState], None]

STEPS: dict[str, Step] = {
    "request": lambda s: s.request(True, False),
    "request, no body": lambda s: s.request(True, True),
    "request, close": lambda s: s.request(False, False),
    "request, close, no body": lambda s: s.request(False, True),
    "request, expect": lambda s: s.request(True, False, True),
    "request end": lambda s: s.request_end(),
    "response": lambda s: s.response(True),
    "response, close": lambda s: s.response(False),
    "response, whole": lambda s: s.response(True, True),
    "response end": lambda s: s.response_end(),
    "close after": lambda s: s.close_after(),
    "client fails": lambda s: s.fail(CLIENT),
    "server fails": lambda s: s.fail(SERVER),
    "client closes": lambda s: s.closed(CLIENT),
    "server closes": lambda s: s.closed(SERVER),
    "next cycle": lambda s: _next_cycle(s),
}


def _next_cycle(state: ConnectionState) -> None:
    assert state.next_cycle()

#: (steps from a new connection, client state, server state, keep-alive, reusable)
LEGAL = [
    ([], IDLE, IDLE, True, False),
    (["request"], SEND_BODY, SEND_RESPONSE, True, False),
    (["request, no body"], DONE, SEND_RESPONSE, True, False),
    (["request", "request end"], DONE, SEND_RESPONSE, True, False),
    (["request", "response"], SEND_BODY, SEND_BODY, True, False),  # answered before the body came
    (["request", "response", "response end"], SEND_BODY, DONE, True, False),
    (["request", "response", "response end", "request end"], DONE, DONE, True, True),
    (["request, no body", "response", "response end"], DONE, DONE, True, True),
    (["request, no body", "response, whole"], DONE, DONE, True, True),
    (["request, no body", "response, whole", "next cycle"], IDLE, IDLE, True, False),
    (["request, no body", "response, whole", "next cycle", "request, no body", "response, whole"],
     DONE, DONE, True, True),
    # keep-alive ends: from the request's head, the response's, or later
    (["request, close, no body"], MUST_CLOSE, SEND_RESPONSE, False, False),
    (["request, close", "request end"], MUST_CLOSE, SEND_RESPONSE, False, False),
    (["request, close, no body", "response, whole"], MUST_CLOSE, MUST_CLOSE, False, False),
    (["request, no body", "response, close"], MUST_CLOSE, SEND_BODY, False, False),
    (["request, no body", "response, close", "response end"], MUST_CLOSE, MUST_CLOSE, False, False),
    (["request, no body", "response, whole", "close after"], MUST_CLOSE, MUST_CLOSE, False, False),
    (["request", "close after"], SEND_BODY, SEND_RESPONSE, False, False),
    # a message that broke
    (["request", "client fails"], ERROR, SEND_RESPONSE, False, False),
    (["request", "client fails", "response, whole"], ERROR, MUST_CLOSE, False, False),  # the 400 goes out
    (["request, no body", "response", "server fails"], MUST_CLOSE, ERROR, False, False),  # a reply cut short
    # closing between messages
    (["client closes"], CLOSED, IDLE, False, False),
    (["request, no body", "client closes"], CLOSED, SEND_RESPONSE, False, False),  # a half-close: still answered
    (["request, no body", "client closes", "response, whole"], CLOSED, MUST_CLOSE, False, False),
    (["request, no body", "response, whole", "server closes"], MUST_CLOSE, CLOSED, False, False),
    (["request, no body", "response, whole", "client closes"], CLOSED, MUST_CLOSE, False, False),
]

#: (steps that are legal, then the one that is not)
ILLEGAL = [
    ([], "request end"),
    ([], "response"),
    ([], "response end"),
    (["request"], "request"),  # a second head before the first exchange ended
    (["request, no body"], "request end"),  # a bodiless request has no end to come
    (["request", "request end"], "request end"),
    (["request, no body"], "response end"),  # no response head yet
    (["request, no body", "response"], "response"),
    (["request, no body", "response, whole"], "response end"),
    (["request, no body", "response, whole"], "request"),  # pipelined: only after the next cycle
    (["request", "client fails"], "request end"),
    (["request, no body", "response", "server fails"], "response end"),
    (["client closes"], "request"),
]

#: Steps after which the connection carries no next exchange (``next_cycle`` refuses, and nothing moves).
NO_NEXT_CYCLE = [
    [],
    ["request, no body"],
    ["request, no body", "response"],
    ["request", "response, whole"],  # the request's body has not ended
    ["request, close, no body", "response, whole"],  # must close
    ["request", "client fails", "response, whole"],
    ["request, no body", "response, whole", "server closes"],
    ["request, no body", "response, whole", "next cycle"],  # (already begun)
]


def run(steps: list[str]) -> ConnectionState:
    state = ConnectionState()
    for step in steps:
        STEPS[step](state)
    return state


@pytest.mark.parametrize(("steps", "client", "server", "keep_alive", "reusable"), LEGAL,
                         ids=[" / ".join(row[0]) or "new" for row in LEGAL])
def test_legal_transitions(steps: list[str], client: str, server: str, keep_alive: bool, reusable: bool) -> None:
    state = run(steps)
    assert (state.client, state.server, state.keep_alive, state.reusable) == (client, server, keep_alive, reusable)


@pytest.mark.parametrize(("steps", "step"), ILLEGAL, ids=[" / ".join([*row[0], "!" + row[1]]) for row in ILLEGAL])
def test_illegal_transitions_raise_the_codecs_protocol_error(steps: list[str], step: str) -> None:
    state = run(steps)
    before = (state.client, state.server)
    with pytest.raises(ProtocolError):
        STEPS[step](state)
    assert (state.client, state.server) == before  # nothing moved


@pytest.mark.parametrize("steps", NO_NEXT_CYCLE, ids=[" / ".join(steps) or "new" for steps in NO_NEXT_CYCLE])
def test_no_next_exchange_unless_both_messages_are_whole_and_kept_alive(steps: list[str]) -> None:
    state = run(steps)
    before = (state.client, state.server, state.keep_alive)
    assert not state.reusable and not state.next_cycle()
    assert (state.client, state.server, state.keep_alive) == before


@pytest.mark.parametrize("role", [CLIENT, SERVER])
def test_closing_in_the_middle_of_a_message_breaks_it(role: str) -> None:
    state = run(["request", "response"])  # both sides are sending bodies
    with pytest.raises(ProtocolError, match="middle of its message"):
        state.closed(role)
    assert (state.client if role == CLIENT else state.server) == ERROR and not state.keep_alive


def test_the_answers() -> None:
    state = run(["request, expect"])
    assert state.expect_continue and not state.response_started and state.request_unread
    state.response(True)
    assert not state.expect_continue and state.response_started  # no 100 Continue once a response started
    assert not run(["request, no body"]).request_unread
    assert run(["request", "client fails"]).request_unread  # a broken body: the client may still be sending
    assert not run(["request", "request end", "response, whole"]).request_unread
    assert not ConnectionState().response_started
    assert not run(["request, no body"]).expect_continue  # a bodiless request waits for nothing
