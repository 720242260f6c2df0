"""No request holds the event loop (issue 11 #4, issue 10 §1).

One session renders and tokenizes a 100k-token prompt (about a second of CPU,
refused afterwards as ``context_overflow``). The test holds that work in the
middle (its tokenization waits on a gate, in its worker thread) while another
session's turn and ``GET /health`` answer; only then does it let the work
finish. So "the others answered while the huge prompt was in progress" is
established by construction, not by a race against the clock, and "none of it
ran on the Trio thread" by the thread each step ran on. A ticker also measures
how long the loop was held between two of its wake-ups while the huge prompt
was rendered (real clock: the work runs in worker threads).
"""

from __future__ import annotations

import threading
from typing import Any

import trio
from _asgi import open_client
from _util import run_turn

from actorproxy.config import ProxyConfig
from actorproxy.runtime.runtime import open_runtime
from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.tokenization.tokenizer import ChatTokenizer

HUGE = 400_000  # characters: only the huge prompt is this long

#: Loop time the ticker may see held. Rendering the huge prompt takes a few hundred ms;
#: held on the loop it would show as one lag that long. Measured: a few ms. Generous,
#: for a shared machine: the deterministic checks are the threads and the gate.
BOUND = 0.25


async def test_a_huge_prompt_does_not_hold_the_loop(tokenizer: ChatTokenizer) -> None:
    trio_thread = threading.current_thread()
    token = trio.lowlevel.current_trio_token()
    started = trio.Event()  # the huge prompt's tokenization has begun (and waits on the gate)
    gate = threading.Event()  # the test lets it go on once the others have answered
    huge_work_threads: list[threading.Thread] = []

    def huge_step_begins() -> None:
        """Called from the huge prompt's render and encode: on which thread, and hold the encode."""
        huge_work_threads.append(threading.current_thread())

    class Watched(ChatTokenizer):
        def render(self, messages: Any, **kwargs: Any) -> str:
            if any(len(str(m.get("content"))) > HUGE for m in messages):
                huge_step_begins()
            return super().render(messages, **kwargs)

        def encode(self, text: str) -> Any:
            if len(text) > HUGE:
                huge_step_begins()
                if threading.current_thread() is not trio_thread:
                    trio.from_thread.run_sync(started.set, trio_token=token)
                    gate.wait(timeout=120)  # a bound for a test that fails elsewhere; released at once normally
            return super().encode(text)

    tok = Watched(tokenizer.hf, name=tokenizer.name)
    engine = SimEngine(tok, SimConfig(seed=1, token_interval=0.0))
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tok) as runtime, \
            open_client(create_app(runtime)) as http:
        assert (await run_turn(runtime, "small", [{"role": "user", "content": "hi"}], max_tokens=4)).done
        lags: list[float] = []
        big_done = trio.Event()

        async def ticker() -> None:
            while not started.is_set() and not big_done.is_set():
                before = trio.current_time()
                await trio.lowlevel.checkpoint()
                lags.append(trio.current_time() - before)

        async def big() -> None:
            try:
                huge = [{"role": "user", "content": "word " * 100_000}]
                refused = await run_turn(runtime, "big", huge)
                assert refused.error is not None and refused.error.code == "context_overflow"
            finally:
                big_done.set()
                started.set()  # never reached the gate (tokenized on the loop?): the checks below say so

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ticker)
                nursery.start_soon(big)
                await started.wait()
                in_progress = not big_done.is_set()
                turn = await run_turn(runtime, "small", [{"role": "user", "content": "hi"}, {"role": "assistant",
                                      "content": "x"}, {"role": "user", "content": "more"}], max_tokens=4)
                health = await http.get("/health")
                answered_while_held = not big_done.is_set()
                gate.set()
        finally:
            gate.set()
    assert huge_work_threads, "the huge prompt was never rendered nor tokenized"
    assert trio_thread not in huge_work_threads, "the huge prompt was rendered or tokenized on the Trio thread"
    assert in_progress and answered_while_held, "the other turn and /health waited until the huge prompt was done"
    assert turn.done is not None and health.status_code == 200
    assert lags and max(lags) < BOUND, f"the loop was held for {max(lags):.3f} s"
