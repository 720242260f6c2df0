"""Rollout code that shapes its replies with vLLM's sampling extensions, unchanged: ``ignore_eos``, ``min_tokens``
and ``stop_token_ids`` through the `openai` SDK's ``extra_body``.

Throughput rollouts fix every reply's length with ``ignore_eos``; others hold off the end of a reply with
``min_tokens``, or end it on ids of their own with ``stop_token_ids``. The proxy passes each to the engine
(SGLang's ``min_new_tokens`` for ``min_tokens``; llama-server has no minimum and answers that with a 400) and
records it in the step's ``sampling``. The script reads the steps back and checks what each field did.

    python examples/sampling_extensions.py                # serves its own proxy (simulated engine)
    python examples/sampling_extensions.py --url http://127.0.0.1:8800   # a running proxy (vLLM or SGLang)
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

import openai
import trio

from actorproxy import ProxyClient, ProxyConfig, open_proxy

QUESTION: list[Any] = [{"role": "user", "content": "Describe the sea in a few words."}]


def ask(base_url: str, **extra: Any) -> tuple[list[int], str, str]:
    """One call (blocking): the sampled ids, the reply's text and why it ended."""
    with openai.OpenAI(base_url=base_url, api_key="unused") as client:
        reply = client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=24, temperature=0.0,
                                               extra_body={"return_token_ids": True, **extra,
                                                           "chat_template_kwargs": {"enable_thinking": False}})
    choice = reply.choices[0]
    return choice.token_ids, choice.message.content or "", choice.finish_reason  # type: ignore[attr-defined]


async def recorded(client: ProxyClient, session: str) -> dict[str, Any]:
    """The session's one step as the trainer reads it."""
    await client.finalize_session(session, reward=0.0)
    payload = await client.read_trajectory(session_id=session, include_steps=True, drain=True)
    [step] = payload["steps"]
    return dict(step)


async def rollout(proxy_url: str) -> None:
    run = uuid.uuid4().hex[:8]
    async with ProxyClient(proxy_url) as client:

        async def call(name: str, **extra: Any) -> tuple[list[int], str, str, dict[str, Any]]:
            session = f"{name}-{run}"
            ids, text, finish = await trio.to_thread.run_sync(lambda: ask(f"{proxy_url}/sess/{session}/v1", **extra))
            step = await recorded(client, session)
            if step["output_ids"] != ids:
                raise SystemExit(f"{name}: the reply's ids are not the step's")
            print(f"{name:>9}: {len(ids):2} ids, finish {finish}, sampling {extra}: {text[:40]!r}")
            return ids, text, finish, step

        plain, _, _, _ = await call("plain")
        # Every reply exactly its budget: the model's end of text does not stop it.
        ids, _, finish, step = await call("fixed", ignore_eos=True)
        if (len(ids), finish, step["sampling"]["ignore_eos"]) != (24, "length", True):
            raise SystemExit("ignore_eos: the reply did not run to its budget")
        # The reply ends on an id of the caller's own: the third one the model sampled above.
        stop = plain[2]
        ids, text, finish, _ = await call("stopped", stop_token_ids=[stop])
        if (ids, finish) != (plain[: plain.index(stop) + 1], "stop"):
            raise SystemExit("stop_token_ids: the reply did not end at the first sampled stop id")
        # ... unless min_tokens holds it off.
        least = plain.index(stop) + 2
        ids, _, _, step = await call("held off", stop_token_ids=[stop], min_tokens=least)
        if stop in ids[:least] or len(ids) < least or step["sampling"]["min_tokens"] != least:
            raise SystemExit("min_tokens: a stop id came before the minimum")
    print("each field shaped the reply as asked, and each step records it")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running proxy (default: serve one in-process)")
    args = parser.parse_args()
    if args.url:
        await rollout(args.url.rstrip("/"))
        return
    async with open_proxy(ProxyConfig.of(port=0)) as running:
        await rollout(running.url)


if __name__ == "__main__":
    trio.run(main)
