"""The tokenizer of a GGUF file (for a :class:`~.tokenizer.ChatTokenizer`), built to encode exactly as llama.cpp does.

``--tokenizer-path model.gguf`` reads the vocabulary, scores or merges, token types, special
token ids and ``tokenizer.chat_template`` from the file's header (:mod:`.gguf_file`) and builds a
``tokenizers`` tokenizer without torch or the original Hugging Face files:

* **SentencePiece-style** (``tokenizer.ggml.model = "llama"``: Llama 2, Gemma 1-3, Mistral v1...).
  llama.cpp escapes spaces as ``▁`` (and prepends one when ``add_space_prefix``), splits the text
  into UTF-8 characters and repeatedly merges the adjacent pair whose concatenation is a vocabulary
  token with the highest score, leftmost first; characters that end up outside the vocabulary become
  ``<0xXX>`` byte tokens. That is a BPE whose merge ranks are the merged tokens' scores: we list, for
  every token, each split into two vocabulary tokens, ranked by the token's score, and give
  ``tokenizers``' BPE ``byte_fallback``.
* **Byte-level BPE** (``"gpt2"``: Llama 3, Qwen, GPT-2, DeepSeek...): the file's merges with the
  pre-tokenizer regexes llama.cpp uses for the file's ``tokenizer.ggml.pre``.

In both, control tokens (``<start_of_turn>``) and user-defined tokens (Gemma's whitespace runs and
HTML tags) are matched in the raw text before anything else, as llama.cpp's ``parse_special``
partition does. ``tests/tokenization/test_gguf_tokenizer.py`` holds our ids to llama.cpp's own test vectors and
``tests/realengine/`` to ``llama-server``'s ``/tokenize`` on thousands of strings.

A GGUF without a chat template (the gemma-3-270m one has none) gets the built-in template of its
architecture when we have one (``gemma3``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .gguf_file import CONTROL, UNKNOWN, USER_DEFINED, GGUFError, GGUFVocab, read_vocab

log = logging.getLogger(__name__)

_TEMPLATES = Path(__file__).parent / "templates"
#: Built-in chat templates for GGUF files that carry none, by ``general.architecture``.
BUILTIN_TEMPLATES = {"gemma3": "gemma3.jinja", "gemma3n": "gemma3.jinja"}

#: Token texts llama.cpp treats as end of generation (llama-vocab.cpp's list), beside eos/eot.
EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>",
)

_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
#: llama.cpp's pre-tokenizer regexes (applied in sequence) by ``tokenizer.ggml.pre``.
BPE_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2", "hunyuan", "megrez"), (_QWEN2,)),
    "qwen35": (_QWEN35,),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), (_GPT2,)),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone"), (r"\p{N}", _GPT2)),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), _DEEPSEEK3),
}
#: Pre-tokenizers for which llama.cpp takes a word that is itself a token whole, without merges.
BPE_IGNORE_MERGES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"))


def _spm_merges(vocab: GGUFVocab, token_to_id: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best score first (llama.cpp's SPM merge order)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for tid, text in enumerate(vocab.tokens):
        if len(text) < 2:
            continue
        score = vocab.scores[tid]
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in token_to_id and right in token_to_id:
                ranked.append((-score, tid, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _token_map(tokens: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for tid, text in enumerate(tokens):
        out[text] = tid  # a duplicate text maps to its last id, as in llama.cpp
    return out


def _added_tokens(vocab: GGUFVocab) -> tuple[list[Any], list[Any]]:
    from tokenizers import AddedToken

    special, plain = [], []
    for tid, kind in enumerate(vocab.types):
        if kind in (CONTROL, UNKNOWN):
            special.append(AddedToken(vocab.tokens[tid], special=True, normalized=False))
        elif kind == USER_DEFINED:
            plain.append(AddedToken(vocab.tokens[tid], special=False, normalized=False))
    return special, plain


def build_spm(vocab: GGUFVocab) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    token_to_id = _token_map(vocab.tokens)
    unk = vocab.special.get("unknown")
    model = models.BPE(
        vocab=token_to_id,
        merges=_spm_merges(vocab, token_to_id),
        unk_token=vocab.tokens[unk] if unk is not None else None,
        byte_fallback=True,
        fuse_unk=False,
    )
    tok = Tokenizer(model)
    steps: list[Any] = [normalizers.Replace(" ", "▁")]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    decode: list[Any] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    return tok


def build_bpe(vocab: GGUFVocab) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    regexes = BPE_PRE_REGEXES.get(vocab.pre)
    if regexes is None:
        known = ", ".join(sorted(BPE_PRE_REGEXES))
        raise GGUFError(f"GGUF pre-tokenizer {vocab.pre!r} is not supported (supported: {known})")
    token_to_id = _token_map(vocab.tokens)
    merges = [(left, right) for left, _, right in (m.partition(" ") for m in vocab.merges)]
    model = models.BPE(vocab=token_to_id, merges=merges, ignore_merges=vocab.pre in BPE_IGNORE_MERGES)
    tok = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(vocab: GGUFVocab) -> Any:
    """The ``tokenizers.Tokenizer`` of ``vocab``, special and user-defined tokens added."""
    if vocab.model == "llama":
        tok = build_spm(vocab)
    elif vocab.model == "gpt2":
        tok = build_bpe(vocab)
    else:
        raise GGUFError(f"GGUF tokenizer model {vocab.model!r} is not supported (supported: llama, gpt2)")
    special, plain = _added_tokens(vocab)
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    return tok


def eog_ids(vocab: GGUFVocab) -> tuple[int, ...]:
    """The ids llama.cpp stops on: eos, eot, eom and the known end-of-turn texts."""
    ids = {vocab.special[k] for k in ("eos", "eot", "eom") if k in vocab.special}
    wanted = set(EOG_TEXTS)
    ids.update(tid for tid, text in enumerate(vocab.tokens) if text in wanted and vocab.types[tid] == CONTROL)
    return tuple(sorted(ids))


def end_of_turn_id(vocab: GGUFVocab) -> int | None:
    """The token that closes an assistant turn: eot if the file names one, else a known text."""
    if "eot" in vocab.special:
        return vocab.special["eot"]
    for text in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>"):
        for tid, token in enumerate(vocab.tokens):
            if token == text and vocab.types[tid] == CONTROL:
                return tid
    return None


def chat_template_of(vocab: GGUFVocab, path: str | Path) -> str:
    if vocab.chat_template:
        return vocab.chat_template
    builtin = BUILTIN_TEMPLATES.get(vocab.architecture)
    if builtin is None:
        raise GGUFError(
            f"{path} has no tokenizer.chat_template and there is no built-in template for "
            f"architecture {vocab.architecture!r}"
        )
    log.info("%s has no chat template; using the built-in %s", path, builtin)
    return (_TEMPLATES / builtin).read_text(encoding="utf-8")


def load_gguf_hf(path: str | Path) -> tuple[Any, GGUFVocab, str]:
    """A transformers fast tokenizer (no torch), the vocabulary and the chat template of ``path``."""
    from transformers import PreTrainedTokenizerFast

    vocab = read_vocab(path)
    template = chat_template_of(vocab, path)
    names = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
    kwargs = {arg: vocab.tokens[vocab.special[key]] for key, arg in names.items() if key in vocab.special}
    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(vocab), **kwargs)
    return hf, vocab, template


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"
