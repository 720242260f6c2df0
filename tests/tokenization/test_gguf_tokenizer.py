"""Tokenizers read from GGUF files encode as llama.cpp does (offline tier).

GGUF files are written here with the ``gguf`` package's writer: a small SentencePiece-style
vocabulary checked against a plain Python statement of llama.cpp's SPM algorithm, and the built-in
qwen3 vocabulary as a byte-level BPE GGUF checked against the built-in tokenizer. The real-engine
tier (tests/realengine/) checks a real model's GGUF against llama-server's /tokenize.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actorproxy.tokenization.gguf import BPE_PRE_REGEXES, build_tokenizer
from actorproxy.tokenization.gguf_file import (
    BYTE,
    CONTROL,
    NORMAL,
    USER_DEFINED,
    GGUFError,
    read_vocab,
)
from actorproxy.tokenization.tokenizer import ChatTokenizer, load_gguf_chat_tokenizer, load_tokenizer

gguf = pytest.importorskip("gguf")

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def write_gguf(
    path: Path,
    *,
    model: str,
    tokens: list[str],
    types: list[int],
    scores: list[float] | None = None,
    merges: list[str] | None = None,
    pre: str = "default",
    special: dict[str, int] | None = None,
    template: str | None = TEMPLATE,
    arch: str = "llama",
    add_space_prefix: bool = False,
) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for key, value in (special or {}).items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    w.add_add_space_prefix(add_space_prefix)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- SentencePiece-style ------------------------------------------------------------------------

# A vocabulary with single characters, merged pieces of distinct scores, a control token, two
# user-defined tokens (a raw double space and a tag) and byte tokens; "é" and "z" are not in it.
SPM_PIECES = ["a", "b", "c", "▁", "\n", "<", ">", "x", "ab", "bc", "abc", "▁a", "▁ab", "ca", "cab", "aa",
              "<x", "x>", "<x>", "▁▁", "\n\n", "b▁", "bb", "bbb", "c▁a"]
SPM_CONTROL = ["<ctl>", "<end>"]
SPM_USER = ["  ", "<u>"]


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    tokens = ["<unk>", "<s>", "</s>", *SPM_CONTROL, *SPM_USER]
    types = [CONTROL, CONTROL, CONTROL] + [CONTROL] * len(SPM_CONTROL) + [USER_DEFINED] * len(SPM_USER)
    scores = [0.0] * len(tokens)
    for i, piece in enumerate(SPM_PIECES):
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(-float((i * 7919) % 101) - i / 1000)  # distinct, not in length order
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(BYTE)
        scores.append(0.0)
    return tokens, types, scores


def reference_spm(text: str, tokens: list[str], types: list[int], scores: list[float]) -> list[int]:
    """llama.cpp's SPM tokenize, stated plainly: specials first, then best-score pair merging."""
    ids = {t: i for i, t in enumerate(tokens)}
    specials = sorted((i for i, k in enumerate(types) if k in (CONTROL, USER_DEFINED)), key=lambda i: -len(tokens[i]))
    fragments: list[str | int] = [text] if text else []
    for sid in specials:  # longest first, every occurrence in every raw fragment
        out: list[str | int] = []
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                continue
            parts = frag.split(tokens[sid])
            for k, part in enumerate(parts):
                if k:
                    out.append(sid)
                if part:
                    out.append(part)
        fragments = out
    result: list[int] = []
    for frag in fragments:
        if isinstance(frag, int):
            result.append(frag)
            continue
        symbols = list(frag.replace(" ", "▁"))
        while True:
            best = None
            for j in range(len(symbols) - 1):
                merged = symbols[j] + symbols[j + 1]
                if merged in ids and (best is None or scores[ids[merged]] > best[0]):
                    best = (scores[ids[merged]], j)
            if best is None:
                break
            j = best[1]
            symbols[j : j + 2] = [symbols[j] + symbols[j + 1]]
        for sym in symbols:
            if sym in ids:
                result.append(ids[sym])
            else:
                result.extend(ids[f"<0x{b:02X}>"] for b in sym.encode("utf-8"))
    return result


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokens, types, scores = spm_vocab()
    path = tmp_path_factory.mktemp("gguf") / "spm.gguf"
    special = {"bos": 1, "eos": 2, "unknown": 0, "eot": tokens.index("<end>")}
    return write_gguf(path, model="llama", tokens=tokens, types=types, scores=scores, special=special)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from([*"abc x<>\né", "<ctl>", "<u>", "  ", "z"]), max_size=30).map("".join))
def test_spm_encodes_as_llama_cpp(spm_file: Path, text: str) -> None:
    vocab = read_vocab(spm_file)
    tok = _spm_tokenizer(spm_file)
    assert tok.encode(text, add_special_tokens=False).ids == reference_spm(
        text, vocab.tokens, vocab.types, vocab.scores
    )


_CACHE: dict[Path, object] = {}


def _spm_tokenizer(path: Path):  # type: ignore[no-untyped-def]
    if path not in _CACHE:
        _CACHE[path] = build_tokenizer(read_vocab(path))
    return _CACHE[path]


def test_spm_details(spm_file: Path) -> None:
    tok = _spm_tokenizer(spm_file)
    vocab = read_vocab(spm_file)
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    # the best-scored merge wins, not the longest piece; a raw double space is its own token
    assert tok.encode("abc", add_special_tokens=False).ids == reference_spm("abc", vocab.tokens, vocab.types,
                                                                            vocab.scores)
    assert tok.encode("a  b", add_special_tokens=False).ids == [ids["a"], ids["  "], ids["b"]]
    # a character outside the vocabulary becomes its UTF-8 bytes
    assert tok.encode("é", add_special_tokens=False).ids == [ids["<0xC3>"], ids["<0xA9>"]]
    assert tok.decode(tok.encode("ab é<ctl>c", add_special_tokens=False).ids, skip_special_tokens=False) == (
        "ab é<ctl>c"
    )


def test_spm_chat_tokenizer(spm_file: Path) -> None:
    chat = load_tokenizer(str(spm_file))
    assert isinstance(chat, ChatTokenizer)
    assert chat.vocab_size == len(read_vocab(spm_file).tokens)
    assert chat.eot_token_id == read_vocab(spm_file).tokens.index("<end>")
    assert set(chat.stop_token_ids) == {2, chat.eot_token_id}
    rendered = chat.render([{"role": "user", "content": "ab"}])
    assert rendered == "<s>user: ab</s>"
    assert chat.decode(chat.encode(rendered)) == rendered


def test_space_prefix(tmp_path: Path) -> None:
    tokens, types, scores = spm_vocab()
    path = write_gguf(tmp_path / "p.gguf", model="llama", tokens=tokens, types=types, scores=scores,
                      add_space_prefix=True)
    tok = build_tokenizer(read_vocab(path))
    ids = {t: i for i, t in enumerate(tokens)}
    # llama.cpp prepends a space to the text and after each special token
    assert tok.encode("ab<ctl>ab", add_special_tokens=False).ids == [ids["▁ab"], ids["<ctl>"], ids["▁ab"]]
    assert tok.decode([ids["▁ab"]]) == "ab"


# -- byte-level BPE: the built-in qwen3 vocabulary as a GGUF ----------------------------------

@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory: pytest.TempPathFactory, tokenizer: ChatTokenizer) -> Path:
    doc = json.loads(tokenizer.hf.backend_tokenizer.to_str())
    vocab: dict[str, int] = doc["model"]["vocab"]
    added = {t["id"]: t for t in doc["added_tokens"]}
    size = max(max(vocab.values()), max(added)) + 1
    tokens = [""] * size
    types = [NORMAL] * size
    for text, tid in vocab.items():
        tokens[tid] = text
    for tid, t in added.items():
        tokens[tid] = t["content"]
        types[tid] = CONTROL if t["special"] else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    path = tmp_path_factory.mktemp("gguf") / "qwen.gguf"
    special = {"eos": tokens.index("<|im_end|>"), "padding": tokens.index("<|endoftext|>")}
    return write_gguf(path, model="gpt2", tokens=tokens, types=types, merges=merges, pre="qwen2",
                      special=special, template=tokenizer.hf.chat_template, arch="qwen3")


QWEN_SAMPLES = [
    "Hello world", "  leading spaces and trailing   ", "don't I'LL we've", "numbers 1234567 and 3.14159",
    "日本語のテキストと中文", "emoji 🦙🚀 and ZWJ 👩‍👩‍👧", "tabs\tand\nnewlines\r\n\n\n",
    "code: def f(x):\n    return x**2",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n</think>", "<tool_call>{\"a\": 1}</tool_call>", "ÄÖÜ äöü ß", "",
]


def test_bpe_matches_builtin(qwen_gguf: Path, tokenizer: ChatTokenizer) -> None:
    ours = load_tokenizer(str(qwen_gguf))
    assert ours.vocab_size == tokenizer.vocab_size
    assert ours.eot_token_id == tokenizer.eot_token_id
    for text in QWEN_SAMPLES:
        assert list(ours.encode(text)) == list(tokenizer.encode(text)), text
        assert ours.decode(ours.encode(text)) == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_bpe_matches_builtin_generated(qwen_gguf: Path, tokenizer: ChatTokenizer, text: str) -> None:
    # The Hugging Face Qwen tokenizer NFC-normalizes, llama.cpp does not: compare on NFC text.
    text = unicodedata.normalize("NFC", text)
    ours = load_tokenizer(str(qwen_gguf))
    assert list(ours.encode(text)) == list(tokenizer.encode(text))


# -- what is refused ---------------------------------------------------------------------------

def test_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 4)
    with pytest.raises(GGUFError, match="truncated"):
        read_vocab(bad)
    other = tmp_path / "y.bin"
    other.write_bytes(b"not a gguf file")
    with pytest.raises(GGUFError, match="not a GGUF"):
        read_vocab(other)


def test_unsupported_pre_and_missing_template(tmp_path: Path) -> None:
    tokens, types, scores = spm_vocab()
    path = write_gguf(tmp_path / "a.gguf", model="gpt2", tokens=tokens, types=types, merges=[], pre="weird")
    with pytest.raises(GGUFError, match="pre-tokenizer 'weird' is not supported"):
        build_tokenizer(read_vocab(path))
    assert "qwen2" in BPE_PRE_REGEXES
    path = write_gguf(tmp_path / "b.gguf", model="llama", tokens=tokens, types=types, scores=scores,
                      template=None, arch="mystery")
    with pytest.raises(GGUFError, match="no tokenizer.chat_template"):
        load_gguf_chat_tokenizer(path)
