"""The torch half of examples/train_on_cpu.py: a policy-gradient trainer for a tiny Qwen3 on the CPU.

It runs in a Python with torch and transformers (the vLLM venv of scripts/vllm/install.sh has
both) and needs nothing of actorproxy: ``train_on_cpu.py`` starts it as a child process and
speaks to it in JSON lines on stdin/stdout, one request and one answer a line::

    {"batch": "b.npz", "out": "weights-3", "lr": 0.01, "steps": 2, "temperature": 0.8}

``b.npz`` holds the arrays of ``actorproxy.training.build_batch``. The trainer answers with
the file of its own logprobs of every token at the weights that sampled it (``current``: the
weights it holds; ``previous``: the ones before its last update, kept for the tokens sampled
under them), then takes ``steps`` optimizer steps and writes the new weights into ``out``, a
directory laid out like the model (``config.json`` and ``model.safetensors``), for vLLM's
``reload_weights``. With ``"steps": 0`` it answers with the logprobs only (a batch checked, not
trained on; ``out`` may be null). Everything runs in float32, as vLLM does on the CPU.
``temperature`` (default 1) is the one the batch's tokens were drawn at (``TrainingBatch.temperature()``): the
trainer's logprobs are of the model's distribution at it, as the engine's recorded ones are when vLLM runs with
``--logprobs-mode processed_logprobs``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Qwen3ForCausalLM
from transformers.utils import logging as transformers_logging

#: Rows per forward pass: the logits of every sampled token of 8 rows fit in a few hundred MB.
ROWS_PER_PASS = 8
#: Truncated importance sampling (verl's TIS): a token's weight exp(new - recorded) is capped here.
TIS_CAP = 2.0


def sampled_logprobs(model: Any, arrays: dict[str, torch.Tensor], rows: slice, temperature: float) -> torch.Tensor:
    """The logprob of each sampled token of ``rows`` (a flat tensor, in row-major token order) under the model's
    distribution at ``temperature`` (the one the tokens were drawn from; a temperature of 0 is greedy, and its
    logprobs are the model's own).

    The logits are computed only where a sampled token is predicted (position t - 1 of a
    token at t): the vocabulary is 151,936 wide.
    """
    ids = arrays["input_ids"][rows]
    hidden = model.model(
        input_ids=ids, attention_mask=arrays["attention_mask"][rows], position_ids=arrays["position_ids"][rows]
    ).last_hidden_state
    mask = arrays["loss_mask"][rows].bool()
    mask[:, 0] = False  # the first token of a row has no prediction
    at = mask.nonzero(as_tuple=True)
    logits = model.lm_head(hidden[at[0], at[1] - 1]).float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, ids[at].unsqueeze(1)).squeeze(1)


def all_logprobs(model: Any, arrays: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    rows = arrays["input_ids"].shape[0]
    with torch.no_grad():
        parts = [sampled_logprobs(model, arrays, slice(i, i + ROWS_PER_PASS), temperature)
                 for i in range(0, rows, ROWS_PER_PASS)]
    return torch.cat(parts) if parts else torch.zeros(0)


class Trainer:
    def __init__(self, model_dir: str) -> None:
        torch.manual_seed(0)
        self.model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        self.model.train(False)  # no dropout: the forward pass is the one vLLM runs
        self.previous = copy.deepcopy(self.model)
        # The input embedding stays as it is: vLLM 0.32's CPU backend, reloading a changed embedding in
        # place, does not compute with it (docs/rl_loop.md), so the trainer's weights and the engine's would
        # part. The model's own output layer (lm_head, untied) and every other weight are trained.
        self.model.model.embed_tokens.weight.requires_grad_(False)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(trained, lr=1e-2)

    def step(self, request: dict[str, Any]) -> dict[str, Any]:
        loaded = np.load(request["batch"])
        arrays = {name: torch.from_numpy(loaded[name]) for name in loaded.files}
        temperature = float(request.get("temperature", 1.0))
        current = all_logprobs(self.model, arrays, temperature)
        previous = all_logprobs(self.previous, arrays, temperature)
        np.savez(request["logprobs"], current=current.numpy(), previous=previous.numpy())
        if not int(request["steps"]):
            return {"losses": [], "tokens": int(arrays["loss_mask"].sum()), "weights": None}

        self.previous.load_state_dict(self.model.state_dict())
        for group in self.optimizer.param_groups:
            group["lr"] = float(request["lr"])
        mask = arrays["loss_mask"].bool().clone()
        mask[:, 0] = False
        recorded = arrays["old_logprobs"][mask]
        advantages = (arrays["advantages"][:, None] * torch.ones_like(arrays["old_logprobs"]))[mask]
        tokens = max(int(mask.sum()), 1)
        losses = []
        for _ in range(int(request["steps"])):
            self.optimizer.zero_grad()
            total = 0.0
            start = 0
            for i in range(0, mask.shape[0], ROWS_PER_PASS):
                logprobs = sampled_logprobs(self.model, arrays, slice(i, i + ROWS_PER_PASS), temperature)
                end = start + logprobs.shape[0]
                weight = torch.exp(logprobs.detach() - recorded[start:end]).clamp(max=TIS_CAP)
                loss = -(weight * advantages[start:end] * logprobs).sum() / tokens
                loss.backward()
                total += float(loss.detach())
                start = end
            self.optimizer.step()
            losses.append(total)
        out = Path(request["out"])
        self.model.save_pretrained(out, safe_serialization=True)
        return {"losses": losses, "tokens": tokens, "weights": str(out)}


def main() -> None:
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # loading and writing weights every iteration: no bars
    trainer = Trainer(sys.argv[1])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(trainer.step(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
