"""`ChatTokenizer`: one tokenizer plus its chat template, as the proxy uses them.

It wraps a Hugging Face fast tokenizer (transformers, no torch). ``load(None)``
gives the built-in ``qwen3`` tokenizer with our Qwen3-compatible template;
``load(path)`` loads any tokenizer directory with its own chat template.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .chat_render import CompiledTemplate, compile_template
from .gguf import end_of_turn_id, eog_ids, is_gguf, load_gguf_hf
from .message_fields import MessageCut, cut_message, template_message_fields
from .prompt_cache import FragmentMemo, PromptCache, prompt_cache
from .qwen3 import qwen3_tokenizer_file
from .template_inputs import wants_object_arguments, with_object_arguments
from .turn_end import learn_turn_end

log = logging.getLogger(__name__)
_TEMPLATES = Path(__file__).parent / "templates"
BUILTIN_NAME = "qwen3"

#: Marker tokens the parsers and the simulated engine look for, when the vocabulary has them.
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class ChatTokenizer:
    """A tokenizer with its chat template; thread-safe for encode/decode/render."""

    def __init__(
        self,
        hf: Any,
        *,
        name: str,
        chat_template: str | None = None,
        eot_token_id: int | None = None,
        stop_token_ids: Sequence[int] = (),
        trusted_template: bool = False,
        model_vocab_size: int | None = None,
    ) -> None:
        self.hf = hf
        self.name = name
        if chat_template is not None:
            hf.chat_template = chat_template
        if not getattr(hf, "chat_template", None):
            raise ValueError(f"tokenizer {name!r} has no chat template")
        self.vocab_size: int = len(hf)
        #: Ids from here up are no token of the model: an engine indexes its embedding and logits with an id, and
        #: one past them is refused by some (vLLM) and kills others (SGLang's scheduler). The larger of the
        #: tokenizer's size and the model's ``vocab_size`` (Qwen3's model has 267 ids more, which a model with
        #: random weights may sample).
        self.id_bound: int = max(self.vocab_size, model_vocab_size or 0)
        self.think_start_id = self._id_of(THINK_START)
        self.think_end_id = self._id_of(THINK_END)
        self.tool_call_start_id = self._id_of(TOOL_CALL_START)
        self.tool_call_end_id = self._id_of(TOOL_CALL_END)
        im_end = self._id_of("<|im_end|>")
        eos = hf.eos_token_id
        #: The token that ends an assistant turn (``<|im_end|>`` for ChatML models).
        explicit_eot = eot_token_id is not None
        if eot_token_id is None:
            eot_token_id = im_end if im_end is not None else int(eos)
        self.eot_token_id: int = eot_token_id
        stops = {self.eot_token_id, *stop_token_ids}
        if eos is not None:
            stops.add(int(eos))
        end_of_text = self._id_of("<|endoftext|>")
        if end_of_text is not None:
            stops.add(end_of_text)
        #: Token ids that end a generation.
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))
        # `all_special_ids` only lists the named ones (eos, pad, ...); added tokens
        # flagged special (Qwen's <|im_start|>) are special to decode too.
        added_special = (i for i, t in hf.added_tokens_decoder.items() if t.special)
        #: Ids that ``skip_special_tokens`` drops.
        self.special_ids: frozenset[int] = frozenset(
            int(i) for i in (*hf.all_special_ids, *added_special)
        )
        # Encoding goes straight to the Rust `tokenizers.Tokenizer` when there is one:
        # transformers' `encode` wraps the same call in `_encode_plus`/batch bookkeeping
        # that costs about as much again for a short fragment (45 vs 30 us), with the same ids.
        backend = getattr(hf, "backend_tokenizer", None)
        self._rust: Any = None if getattr(hf, "split_special_tokens", False) else backend
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we never read: same ids, ~20% less.
        self._encode_batch: Any = None if self._rust is None else getattr(
            self._rust, "encode_batch_fast", self._rust.encode_batch)
        self._token_texts: dict[int, str] = {}
        #: Whole prompts tokenized from the prefix an earlier one had (built on first use; ``None``: not possible).
        self._prompt_cache: PromptCache | None = None
        self._prompt_cache_made = False
        #: Fragment texts tokenized before, with their ids (:meth:`encode_fragment`).
        self.fragments = FragmentMemo(self.encode)
        # Rendering calls the compiled template directly when it renders exactly what transformers does.
        self._compiled: CompiledTemplate | None = compile_template(
            hf.chat_template, hf.special_tokens_map, self._apply_template, trusted=trusted_template)
        self._adopt_template_turn_end(keep_eot=explicit_eot)

    def _adopt_template_turn_end(self, *, keep_eot: bool) -> None:
        """The turn-end token(s) the chat template writes after a reply (:mod:`.turn_end`).

        They end a generation too, and the one before a user turn is the end-of-turn
        token (``<|im_end|>``, Llama 3 ``<|eot_id|>``, Gemma ``<end_of_turn>``) unless
        the caller named one (a GGUF file's ``tokenizer.ggml.eot_token_id``).
        """
        control = frozenset(int(i) for i in (*self.hf.all_special_ids, *self.hf.added_tokens_decoder))
        learned = learn_turn_end(lambda m: self.render(m, add_generation_prompt=False), self.encode, control)
        if learned.eot_token_id is not None and not keep_eot:
            self.eot_token_id = learned.eot_token_id
        #: Tokens the template writes right after a reply (GLM-4.5: ``<|user|>`` and ``<|observation|>``).
        self.turn_end_ids: frozenset[int] = learned.turn_end_ids | {self.eot_token_id}
        self.stop_token_ids = tuple(sorted({*self.stop_token_ids, self.eot_token_id, *self.turn_end_ids}))

    def _id_of(self, token: str) -> int | None:
        tid = self.hf.convert_tokens_to_ids(token)
        if tid is None or tid == self.hf.unk_token_id:
            return None
        return int(tid)

    # -- tokens -------------------------------------------------------------

    def encode(self, text: str) -> array[int]:
        """Token ids of ``text``; special tokens written in the text are recognised, no BOS."""
        if self._encode_batch is not None:
            # encode_batch, not encode: only the batch call releases the GIL while Rust works, so a
            # long prompt tokenized in a worker thread does not freeze the event loop (same ids, same cost).
            return array("i", self._encode_batch([text], add_special_tokens=False)[0].ids)
        return array("i", self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> array[int]:
        """:meth:`encode` for a whole rendered prompt: a prefix an earlier prompt had is not tokenized again.

        The same ids as :meth:`encode` (see :mod:`.prompt_cache`, which checks this tokenizer can be cut).
        """
        if not self._prompt_cache_made:
            self._prompt_cache = self._make_prompt_cache()
            self._prompt_cache_made = True
        cache = self._prompt_cache
        return self.encode(text) if cache is None else cache.encode(text)

    def encode_fragment(self, text: str) -> array[int]:
        """:meth:`encode` for a turn's fragment: a text tokenized before is not tokenized again.

        The same ids as :meth:`encode`, in a new array (see :class:`FragmentMemo`).
        """
        return self.fragments.encode(text)

    def age_prompts(self) -> None:
        """Let the prompt cache and the fragment memo drop what no turn used since the last call
        (:meth:`PromptCache.age`, :meth:`FragmentMemo.age`)."""
        if self._prompt_cache is not None:
            self._prompt_cache.age()
        self.fragments.age()

    def _make_prompt_cache(self) -> PromptCache | None:
        if self._encode_batch is None:
            return None
        sample = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                  {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
        try:
            text = self.render(sample, add_generation_prompt=True)
            return prompt_cache(self.encode, dict(self.hf.added_tokens_decoder), text)
        except Exception:  # a template that cannot render the sample: prompts are tokenized whole
            log.debug("prompts are tokenized whole (the cache could not be set up)", exc_info=True)
            return None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included."""
        return str(self.hf.decode(list(ids), skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id])
        return text

    # -- chat template ------------------------------------------------------

    def cut_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with only the fields the chat template and echo matching read (see ``message_fields``)."""
        fields = template_message_fields(str(self.hf.chat_template))
        return [cut_message(m, fields) for m in messages]

    def message_cut(self) -> MessageCut:
        """``cut_messages`` for one conversation, turn after turn: only what changed is cut again."""
        return MessageCut(template_message_fields(str(self.hf.chat_template)))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat template applied to OpenAI-style ``messages`` (dicts), as text."""
        kwargs: dict[str, Any] = dict(template_kwargs)
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        template = self.hf.chat_template
        objects = wants_object_arguments(str(template))
        compiled = self._compiled
        if compiled is not None and compiled.source == template:  # it copies the messages and tools itself
            chat = [with_object_arguments(m) for m in messages] if objects else messages
            return compiled.render(chat, tools or None, add_generation_prompt, kwargs)
        convert = with_object_arguments if objects else dict
        tool_list = [dict(t) for t in tools] if tools else None
        return self._apply_template([convert(m) for m in messages], tool_list, add_generation_prompt, kwargs)

    def _apply_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> str:
        """The chat template through transformers (the reference for :mod:`.chat_render`)."""
        text = self.hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        return str(text)


def _quiet_transformers() -> None:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None, cache_dir: str | None = None) -> ChatTokenizer:
    """Load a tokenizer once per process.

    ``path=None`` is the built-in ``qwen3`` tokenizer (built and cached on
    first use). A GGUF file gives the tokenizer and chat template stored in it
    (:mod:`.gguf`). Otherwise ``path`` is a Hugging Face tokenizer directory;
    its own chat template is used.
    """
    _quiet_transformers()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if path is None or path == BUILTIN_NAME:
        file = qwen3_tokenizer_file(Path(cache_dir) if cache_dir else None)
        hf: Any = PreTrainedTokenizerFast(
            tokenizer_file=str(file),
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
        )
        template = (_TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
        return ChatTokenizer(hf, name=BUILTIN_NAME, chat_template=template, trusted_template=True)
    if is_gguf(path):
        return load_gguf_chat_tokenizer(path)
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return ChatTokenizer(hf, name=os.path.basename(os.path.normpath(path)), model_vocab_size=model_vocab_size(path))


def model_vocab_size(path: str) -> int | None:
    """The model's ``vocab_size`` from ``config.json`` beside its tokenizer (a multimodal model's text model's);
    ``None`` when the directory holds no readable one."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    size = config.get("vocab_size", text.get("vocab_size") if isinstance(text, dict) else None)
    return size if type(size) is int and size > 0 else None


def load_gguf_chat_tokenizer(path: str | Path) -> ChatTokenizer:
    """The :class:`ChatTokenizer` of a GGUF file: its end of turn and llama.cpp's stop ids."""
    hf, vocab, template = load_gguf_hf(path)
    return ChatTokenizer(
        hf,
        name=Path(path).name,
        chat_template=template,
        eot_token_id=end_of_turn_id(vocab),
        stop_token_ids=eog_ids(vocab),
    )
