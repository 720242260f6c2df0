"""What several examples share: the fake weather tool, the black-box examples' rollout side, and
``actorproxy run`` started as a process.

Not an example of its own: the scripts beside it import it (run them from the repository root).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from actorproxy import ProxyClient, ProxyConfig, open_proxy

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionFunctionToolParam

#: The tool the agents are offered (OpenAI's function-tool shape).
WEATHER_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather and a short forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["city"],
        },
    },
}


def get_weather(city: str, days: int = 1) -> dict[str, Any]:
    """A stand-in for a real tool: deterministic fake weather."""
    base = sum(map(ord, city)) % 15 + 10
    forecast = [{"day": d + 1, "celsius": base + d, "sky": "sunny"} for d in range(days)]
    return {"city": city, "forecast": forecast}


# -- the black-box examples' rollout side: it knows the proxy, the agent does not ------------------

def summarize(payload: dict[str, Any]) -> None:
    """Print a read's segments and steps."""
    for segment in payload["data"]:
        sampled = sum(segment["loss_mask"])
        print(f"\nsegment {segment['trajectory_id']}  ({segment['start_reason']} -> {segment['boundary_reason']})")
        print(f"  tokens      {len(segment['token_ids'])} ({sampled} sampled, loss_mask=1)")
        print(f"  steps       {segment['step_indices']}   reward {segment['reward']}")
    print("steps:")
    for step in payload.get("steps", []):
        print(f"  #{step['step_index']} {step['status']:<10} prompt {step['prompt_tokens']:<5} "
              f"sampled {step['completion_tokens']:<4} in_segment={step['in_segment']}")


Agent = Callable[[str, int], None]


async def blackbox_rollout(proxy_url: str, agent: Agent, *, name: str, base_path: str, max_turns: int) -> None:
    """Run ``agent(base_url, max_turns)`` on a fresh session's base URL (``/sess/<session><base_path>``);
    then finalize the session with a reward, read it back and print it."""
    session = f"{name}-{uuid.uuid4().hex[:8]}"
    base_url = f"{proxy_url}/sess/{session}{base_path}"
    print(f"agent base URL: {base_url}")
    await trio.to_thread.run_sync(agent, base_url, max_turns)
    async with ProxyClient(proxy_url) as client:
        print(await client.finalize_session(session, reward=1.0))
        payload = await client.read_trajectory(session_id=session, drain=True, include_steps=True)
    summarize(payload)
    segment = payload["data"][-1]
    assert len(segment["token_ids"]) == len(segment["loss_mask"]) == len(segment["logprobs"])


async def blackbox_main(agent: Agent, *, description: str, name: str, base_path: str) -> None:
    """A black-box example's command line: ``--url`` (else a proxy served in-process) and ``--max-turns``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", help="a running proxy (default: serve one in-process)")
    parser.add_argument("--max-turns", type=int, default=6)
    args = parser.parse_args()
    if args.url:
        await blackbox_rollout(args.url.rstrip("/"), agent, name=name, base_path=base_path, max_turns=args.max_turns)
        return
    async with open_proxy(ProxyConfig.of(port=0)) as running:
        print(f"proxy at {running.url}")
        await blackbox_rollout(running.url, agent, name=name, base_path=base_path, max_turns=args.max_turns)


# -- ``actorproxy run`` as a process -------------------------------------------------------------

def start_proxy(flags: list[str], log: Path, *, timeout: float,
                ready: str = r"serving on (http://\S+)") -> tuple[subprocess.Popen[bytes], str]:
    """``actorproxy run --port 0 FLAGS`` with its output in ``log``; its URL once a log line matches ``ready``."""
    out = open(log, "wb")  # noqa: SIM115 (the process writes it until it exits)
    proc = subprocess.Popen([sys.executable, "-m", "actorproxy", "run", "--port", "0", *flags], stdout=out, stderr=out)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(ready, log.read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the proxy did not start:\n{log.read_text()}")
