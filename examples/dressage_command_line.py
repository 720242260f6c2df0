"""Dressage's launch command and client code, run unchanged against actorproxy.

    python examples/dressage_command_line.py

It starts ``actorproxy sim`` (a simulated SGLang server) and then
``actorproxy run`` with the Dressage proxy's own example command line (seed
"Starting the Proxy"; only the tokenizer and router paths are filled in, and
the port comes from ``ACTORPROXY_PORT=0`` and the SQLite store goes to a
temporary directory by ``ACTORPROXY_DATA_DIR``, so it runs beside a proxy that
holds ``./actorproxy-data``), drives one session with the same ``ProxyClient``
calls Dressage's documentation shows, and prints the segment. A server that
exits before serving is reported with its exit status and its last lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from actorproxy import ProxyClient
from actorproxy.tokenization.tokenizer import load_tokenizer


@contextmanager
def serve(command: list[str], env: dict[str, str]) -> Iterator[str]:
    """Run ``command`` until it logs the URL it serves on; yield the URL; stop it with SIGTERM."""
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    assert process.stderr is not None
    seen: deque[str] = deque(maxlen=20)
    try:
        for line in process.stderr:
            seen.append(line)
            found = re.search(r"(?:serving on|listening on|Running on) (http://\S+)", line)
            if found:
                yield found.group(1).rstrip("/")
                break
        else:
            raise SystemExit(f"actorproxy {command[3]} exited with {process.wait()} before serving; it said:\n"
                             + "".join(seen))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


async def dressage_client(url: str) -> None:
    client = ProxyClient(proxy_url=url)  # the same calls as Dressage's "Using the Proxy Client"
    response = await client.chat_completions(
        {"model": "proxy-model", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32},
        session_id="sess-001",
        instance_id="inst-001",
        turn_id="turn-001",
    )
    print("reply:", response["choices"][0]["message"]["content"])
    await client.finalize_session("sess-001", instance_id="inst-001")
    payload = await client.read_trajectory(session_id="sess-001", drain=True)
    segments = payload["data"]
    await client.aclose()
    for segment in segments:
        print(
            f"segment {segment['trajectory_id']}: {segment['num_tokens']} tokens, "
            f"{segment['num_trained_tokens']} trained, instance {segment['instance_id']}"
        )
    assert len(segments) == 1 and segments[0]["instance_id"] == "inst-001"


def main() -> None:
    python = [sys.executable, "-m", "actorproxy"]
    with (tempfile.TemporaryDirectory(prefix="Qwen3.5-4B-") as tokenizer_path,
          tempfile.TemporaryDirectory(prefix="actorproxy-data-") as data_dir):
        load_tokenizer().hf.save_pretrained(tokenizer_path)  # stands in for /path/to/Qwen3.5-4B
        with serve([*python, "sim", "--port", "0", "--token-interval", "0.001"], {}) as router:
            dressage = f"""
              --tokenizer-path {tokenizer_path}
              --sglang-router-url {router}
              --trajectory-build-model qwen3_5
              --context-window 32768
              --no-dynamic-max-tokens
              --rollout-temperature 1.0
              --record-token-versions
              --mask-nonlast-version-tokens
              --dressage-partial-rollout
              --tool-call-parse-backend sglang_api
              --reasoning-parse-backend sglang_api
              --model-tool-call-type qwen3_5
              --model-reasoning-type qwen3
            """.split()
            with serve([*python, "run", *dressage], {"ACTORPROXY_PORT": "0", "ACTORPROXY_DATA_DIR": data_dir}) as url:
                print("actorproxy, started with Dressage's command line, serves on", url)
                trio.run(dressage_client, url)


if __name__ == "__main__":
    main()
