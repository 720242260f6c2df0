"""IncrementalDetokenizer: streamed text equals one-shot decode, however ids are chunked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actorproxy.tokenization.detokenize import IncrementalDetokenizer, _Windowed, byte_table
from actorproxy.tokenization.tokenizer import ChatTokenizer

# The ids of "世界龘ꙮ𓀀🫠🧑‍🚀𝔸𝔹\U0001fae8é—∑²": CJK, emoji and rare symbols, many
# split over 2-3 tokens, so these are often lead or continuation bytes.
_SPLIT_IDS = [
    101, 104, 106, 117, 222, 235, 246, 254, 378, 963, 2293, 9284, 29456,
    82912, 99489, 124026, 124373, 125001, 145127, 145836, 148738, 151326,
]  # fmt: skip
_SPECIAL_IDS = [151643, 151644, 151645, 151657, 151658, 151665, 151666, 151667, 151668]

token_ids = st.one_of(
    st.integers(0, 255),  # single bytes, including lone lead/continuation bytes
    st.integers(256, 20_000),  # common (mostly ASCII) tokens
    st.integers(0, 151_642),  # anything in the BPE vocabulary
    st.sampled_from(_SPLIT_IDS),
    st.sampled_from(_SPECIAL_IDS),
)


def _stream(tokenizer: ChatTokenizer, chunks: list[list[int]]) -> str:
    detok = IncrementalDetokenizer(tokenizer)
    return "".join(detok.feed(chunk) for chunk in chunks) + detok.flush()


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(token_ids, max_size=40))
def test_one_at_a_time_matches_decode(tokenizer: ChatTokenizer, ids: list[int]) -> None:
    assert _stream(tokenizer, [[i] for i in ids]) == tokenizer.decode(ids)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(token_ids, max_size=40), data=st.data())
def test_random_chunks_match_decode(
    tokenizer: ChatTokenizer, ids: list[int], data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    bounds = [0, *cuts, len(ids)]
    chunks = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _stream(tokenizer, chunks) == tokenizer.decode(ids)


def test_split_emoji_waits_until_complete(tokenizer: ChatTokenizer) -> None:
    ids = tokenizer.encode("a🫠b").tolist()
    assert len(ids) > 3, "the emoji must span several tokens for this test to mean anything"
    detok = IncrementalDetokenizer(tokenizer)
    outputs = [detok.feed([i]) for i in ids]
    assert outputs[0] == "a"
    assert "".join(outputs) == "a🫠b"
    assert "\ufffd" not in "".join(outputs)
    # Every output is either empty or whole characters; the emoji arrives in one piece.
    assert "🫠" in outputs
    assert detok.flush() == ""


def test_special_tokens_appear_as_text(tokenizer: ChatTokenizer) -> None:
    ids = tokenizer.encode("<think>\nhm\n</think>\n\nok<|im_end|>").tolist()
    detok = IncrementalDetokenizer(tokenizer)
    outputs = [detok.feed([i]) for i in ids]
    assert outputs[0] == "<think>"
    assert outputs[-1] == "<|im_end|>"
    assert "".join(outputs) + detok.flush() == "<think>\nhm\n</think>\n\nok<|im_end|>"


def test_flush_replaces_incomplete_bytes_and_resets(tokenizer: ChatTokenizer) -> None:
    first_half = tokenizer.encode("🫠").tolist()[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.feed(first_half) == ""
    assert detok.flush() == tokenizer.decode(first_half)
    assert detok.flush() == ""
    assert detok.feed(tokenizer.encode("fresh").tolist()) == "fresh"


def test_out_of_vocabulary_ids_decode_to_nothing(tokenizer: ChatTokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.feed([9707, 10**7]) + detok.flush() == tokenizer.decode([9707, 10**7]) == "Hello"


def test_byte_table_is_built_once(tokenizer: ChatTokenizer) -> None:
    table = byte_table(tokenizer)
    assert table is not None and table is byte_table(tokenizer)
    assert table[9707] == b"Hello"
    assert table[151645] == b"<|im_end|>"


# -- the windowed fallback, on a small SentencePiece-style tokenizer ---------


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> ChatTokenizer:
    """A Llama-like tokenizer: BPE with byte fallback, decoded by Replace/ByteFallback/Strip."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁Hello", "▁world", "lo", "▁wor", "ld", "!", "é", "世", "界", "▁a", "b"]:
        vocab[piece] = len(vocab)
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", bos_token="<s>")
    return ChatTokenizer(hf, name="tiny-sp", chat_template="{{ messages[0].content }}")


def test_fallback_is_used_for_non_byte_level(sentencepiece_tokenizer: ChatTokenizer) -> None:
    assert byte_table(sentencepiece_tokenizer) is None


def test_fallback_handles_byte_pieces_and_leading_space(
    sentencepiece_tokenizer: ChatTokenizer,
) -> None:
    tok = sentencepiece_tokenizer
    emoji = [3 + b for b in "🫠".encode()]  # four <0x..> byte pieces
    hello, world = tok.hf.convert_tokens_to_ids(["▁Hello", "▁world"])
    ids = [hello, *emoji, world]
    detok = IncrementalDetokenizer(tok)
    outputs = [detok.feed([i]) for i in ids]
    assert outputs == ["Hello", "", "", "", "🫠", " world"]
    assert "".join(outputs) + detok.flush() == tok.decode(ids) == "Hello🫠 world"


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fallback_matches_decode(
    sentencepiece_tokenizer: ChatTokenizer, data: st.DataObject
) -> None:
    tok = sentencepiece_tokenizer
    byte_pieces = st.integers(3, 3 + 255).map(lambda i: [i])
    # Valid UTF-8 as byte pieces, so every split character is eventually completed.
    char_bytes = st.characters(min_codepoint=0x80, exclude_categories=["Cs"]).map(
        lambda c: [3 + b for b in c.encode()]
    )
    words = st.integers(3 + 256, tok.vocab_size - 1).map(lambda i: [i])
    ids: list[int] = [
        i for group in data.draw(st.lists(st.one_of(char_bytes, words), max_size=30)) for i in group
    ]
    assert _stream(tok, [[i] for i in ids]) == tok.decode(ids)
    # Arbitrary bytes. HF's ByteFallback decoder turns a whole run of byte pieces
    # into U+FFFDs when any of it is invalid, which no bounded window can
    # foresee; so exactness is only promised for valid text. The window stays
    # bounded regardless.
    noisy = [i for [i] in data.draw(st.lists(st.one_of(byte_pieces, words), max_size=30))]
    detok = IncrementalDetokenizer(tok)
    streamed = ""
    for i in noisy:
        streamed += detok.feed([i])
        impl = detok._impl
        assert isinstance(impl, _Windowed)
        assert len(impl._ids) - impl._read <= impl._MAX_PENDING
    streamed += detok.flush()
    if "\ufffd" not in tok.decode(noisy):
        assert streamed == tok.decode(noisy)
