"""The built-in qwen3 tokenizer: ids pinned to the real Qwen3 vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from actorproxy.tokenization import qwen3
from actorproxy.tokenization.tokenizer import ChatTokenizer, load_tokenizer

ADDED_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}


def test_plain_text_id(tokenizer: ChatTokenizer) -> None:
    assert tokenizer.encode("Hello").tolist() == [9707]


@pytest.mark.parametrize(("marker", "token_id"), ADDED_IDS.items())
def test_added_token_ids(tokenizer: ChatTokenizer, marker: str, token_id: int) -> None:
    assert tokenizer.encode(marker).tolist() == [token_id]
    assert tokenizer.decode([token_id]) == marker


def test_markers_inside_text_are_single_tokens(tokenizer: ChatTokenizer) -> None:
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tokenizer.encode(text).tolist()
    markers = ("<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>")
    for marker in markers:
        assert ids.count(ADDED_IDS[marker]) == 1
    assert ids[0] == ADDED_IDS["<|im_start|>"]
    assert ids[-1] == ADDED_IDS["<|im_end|>"]
    assert tokenizer.decode(ids) == text


def test_decode_round_trips_mixed_unicode(tokenizer: ChatTokenizer) -> None:
    text = "Grüße, 世界! 🫠🧑‍🚀 𝔸 naïve café — ∑x² \t tabs\n\nand <|im_end|> inside"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_stop_tokens(tokenizer: ChatTokenizer) -> None:
    assert tokenizer.eot_token_id == 151645
    assert {151645, 151643} <= set(tokenizer.stop_token_ids)


def test_marker_ids(tokenizer: ChatTokenizer) -> None:
    assert tokenizer.think_start_id == 151667
    assert tokenizer.think_end_id == 151668
    assert tokenizer.tool_call_start_id == 151657
    assert tokenizer.tool_call_end_id == 151658


def test_only_chatml_tokens_are_special(tokenizer: ChatTokenizer) -> None:
    special = [151643, 151644, 151645]
    kept = [151657, 151658, 151665, 151666, 151667, 151668]
    assert set(special) <= tokenizer.special_ids
    assert not set(kept) & tokenizer.special_ids
    hello = tokenizer.encode("Hello").tolist()
    ids = [*special, *hello, *kept]
    assert tokenizer.hf.decode(ids, skip_special_tokens=True) == (
        "Hello<tool_call></tool_call><tool_response></tool_response><think></think>"
    )


def test_load_is_cached() -> None:
    assert load_tokenizer(None) is load_tokenizer(None)


def test_tokenizer_json_is_built_once_then_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: ChatTokenizer
) -> None:
    built = qwen3.qwen3_tokenizer_file(tmp_path)
    assert built.is_file() and tmp_path in built.parents

    def no_rebuild(ranks: Path) -> str:
        raise AssertionError("tokenizer.json rebuilt although it was cached")

    monkeypatch.setattr(qwen3, "build_qwen3_tokenizer_json", no_rebuild)
    assert qwen3.qwen3_tokenizer_file(tmp_path) == built
    # A distinct cache_dir is a distinct lru_cache key, so this really loads the new file.
    fresh = load_tokenizer(None, str(tmp_path))
    assert fresh is not tokenizer
    sample = "Hello <think>\nx\n</think> 世界 🫠 <|im_end|>"
    assert fresh.encode(sample) == tokenizer.encode(sample)


@pytest.mark.parametrize(("config", "bound"), [
    ({"vocab_size": 151936}, 151936),  # Qwen3's model: 267 rows past the tokenizer's ids
    ({"text_config": {"vocab_size": 152064}}, 152064),  # a multimodal model's text model
    ({"vocab_size": 1000}, 151669),  # never below the tokenizer's own ids
    (None, 151669),  # no config.json: the tokenizer's size
    ({"vocab_size": "big"}, 151669),
])
def test_the_id_bound_is_the_models_vocabulary_when_its_config_says(tmp_path: Path, tokenizer: ChatTokenizer,
                                                                    config: Any, bound: int) -> None:
    tokenizer.hf.save_pretrained(tmp_path)
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert tokenizer.id_bound == tokenizer.vocab_size == 151669
    assert load_tokenizer(str(tmp_path)).id_bound == bound


ENCODE_SAMPLES = [
    "",
    " ",
    "Hello",
    "  leading and trailing spaces  ",
    "<|im_end|>\n<|im_start|>user\nQuestion 3: and 7 times 8?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{\"name\": \"f\"}\n</tool_call><|im_end|>",
    "Grüße, 世界! 🫠🧑‍🚀 𝔸 naïve café — ∑x² \t tabs\n\nand <|im_end|> inside",
    "<|im_end|><|im_end|><|endoftext|>x<think></think>",
    "<|im_end",  # a marker's prefix is plain text
    "line0_of_1 = compute(0) " * 200,
]


@pytest.mark.parametrize("text", ENCODE_SAMPLES)
def test_encode_matches_transformers(tokenizer: ChatTokenizer, text: str) -> None:
    # encode() calls the Rust tokenizer directly: the ids must be transformers' own.
    assert tokenizer.encode(text).tolist() == tokenizer.hf.encode(text, add_special_tokens=False)
