"""The controller holds the wake-ups of tasks whose generations a pause ended until the pause is answered.

A pause's streams end in the relay hub's task as it reads their finishes
(``TurnGeneration._ended``); each stream's own task still has a step to run. Those steps
wait with the controller (``GenerationController.wake_later``) and come after the pause's
answer, ``RELEASE_SLICE`` a scheduler round (``release_held``), so that the pause's own
task is not queued behind a thousand of them.
"""

from __future__ import annotations

from functools import partial

import trio
import trio.testing

from actorproxy.runtime.controller import RELEASE_SLICE, GenerationController, GenerationHandle, PauseAck


async def test_wake_ups_held_in_a_pause_come_after_its_answer_a_slice_a_round() -> None:
    controller = GenerationController()
    handles = [GenerationHandle(f"s{i}") for i in range(2 * RELEASE_SLICE + 1)]
    for handle in handles:
        controller.request(handle)
    woken: list[int] = []
    woken_when_answered: list[int] = []
    acks: list[PauseAck] = []

    async def pause() -> None:
        acks.append(await controller.pause("abort"))
        woken_when_answered.append(len(woken))

    async with trio.open_nursery() as nursery:
        assert controller.wake_later() is None  # nothing releases held wake-ups yet
        nursery.start_soon(controller.release_held)
        await trio.testing.wait_all_tasks_blocked()
        assert controller.wake_later() is None  # no pause pending
        nursery.start_soon(pause)
        await trio.testing.wait_all_tasks_blocked()
        for i, handle in enumerate(handles):
            controller.end(handle, aborted=True)
            later = controller.wake_later()
            if i < len(handles) - 1:
                assert later is not None
                later(partial(woken.append, i))
            else:  # the last end answered the pause: nothing is held any more
                assert later is None
        assert woken == []  # nothing woken in the step that answered the pause
        await trio.testing.wait_all_tasks_blocked()
        assert [ack.aborted for ack in acks] == [len(handles)]
        assert woken == list(range(len(handles) - 1))  # every one, in the order held
        # The pause's task ran before the second slice was woken (at most the first ahead of it).
        assert woken_when_answered[0] <= RELEASE_SLICE
        nursery.cancel_scope.cancel()


async def test_wake_ups_still_held_when_the_runtime_stops_are_woken() -> None:
    controller = GenerationController()
    handles = [GenerationHandle("a"), GenerationHandle("b")]
    for handle in handles:
        controller.request(handle)
    woken: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(controller.release_held)
        nursery.start_soon(controller.pause, "abort")
        await trio.testing.wait_all_tasks_blocked()
        controller.end(handles[0], aborted=True)
        later = controller.wake_later()
        assert later is not None
        later(partial(woken.append, "a"))
        await trio.testing.wait_all_tasks_blocked()
        assert woken == []  # held: "b" has not ended, the pause is not answered
        nursery.cancel_scope.cancel()
    assert woken == ["a"]
