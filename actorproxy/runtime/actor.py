"""The small vocabulary every actor here shares: mailboxes and one-shot replies.

An actor is a Trio task that owns its state and reads ``@attrs.frozen``
messages from a memory channel. A question carries its own one-shot reply
channel; :func:`ask` sends the question and waits for the answer, which
travels as an ``outcome`` so an actor can answer with an exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")
#: An actor's message type (each actor's mailbox carries the union of its messages).
M = TypeVar("M")

Reply = trio.MemorySendChannel[outcome.Outcome[Any]]


class ActorGone(Exception):
    """The actor stopped before it answered."""


async def ask(mailbox: trio.MemorySendChannel[M], build: Callable[[Reply], M]) -> Any:
    """Send ``build(reply)`` to ``mailbox`` and return the actor's answer (or raise its error)."""
    reply_send, reply_recv = trio.open_memory_channel[outcome.Outcome[Any]](1)
    async with reply_recv:
        try:
            await mailbox.send(build(reply_send))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            reply_send.close()
            raise ActorGone("the actor's mailbox is closed") from exc
        try:
            result = await reply_recv.receive()
        except trio.EndOfChannel:
            raise ActorGone("the actor dropped the question unanswered") from None
    try:
        return result.unwrap()
    finally:  # (an error raised here has this frame in its traceback: kept in it, a reference cycle)
        del result


def answer(reply: Reply, value: Any) -> None:
    """Answer a question (never blocks: reply channels hold one item)."""
    with reply:
        try:
            reply.send_nowait(outcome.Value(value))
        except (trio.BrokenResourceError, trio.WouldBlock):
            pass  # the asker went away (its task was cancelled): nobody to tell


def answer_error(reply: Reply, error: BaseException) -> None:
    with reply:
        try:
            reply.send_nowait(outcome.Error(error))
        except (trio.BrokenResourceError, trio.WouldBlock):
            pass
