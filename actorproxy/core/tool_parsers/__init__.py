"""Tool-call formats: where a model's calls begin and end, and how the text inside is read (sans-IO).

:class:`~actorproxy.core.parser.OutputParser` finds a format's blocks by their
marker tokens (single tokens in the family's vocabulary, so a marker can never
be split across stream chunks); a block parser reads the text between them as
it arrives, in fragments of any size, and reports :class:`CallPiece`\\ s to
stream as soon as they are certain enough to send. One module per format:

* ``qwen3`` (:mod:`.hermes`; Hermes JSON; Qwen2.5, Qwen3) in ``<tool_call>``;
* ``qwen3_coder`` (:mod:`.qwen3_coder`; Qwen3-Coder, Qwen3.5 XML) in ``<tool_call>``;
* ``glm45`` (:mod:`.glm45`; GLM-4.5/4.6 XML with ``<arg_key>``/``<arg_value>``) in ``<tool_call>``;
* ``deepseek_v31`` (:mod:`.deepseek`; DeepSeek-V3.1) in ``<｜tool▁calls▁begin｜>``;
* ``kimi_k2`` (:mod:`.kimi_k2`; Kimi-K2) in ``<|tool_calls_section_begin|>``;
* ``llama3`` (:mod:`.llama3`; Llama 3.1-3.3 JSON): after ``<|python_tag|>`` or when the
  reply opens with ``{``, to the end of the generation;
* ``gpt_oss`` (:mod:`.harmony`; GPT-OSS harmony channels): not block-based, the
  whole generation is read by :class:`~.harmony.HarmonyParser`;
* ``none``: no tool parsing; a call the model writes stays in the content as text
  (what the Claw-R1 gateway returns, whose agents parse ``<tool_call>`` text themselves).

A block either parses as a whole (:meth:`BlockParser.close` returns the calls)
or not at all (``None``): the caller then returns its raw text as content.
Pieces of a call that later fails may already have been streamed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs

from .base import BlockParser, BlockResult, CallPiece, ParsedCall, token_id
from .deepseek import DeepSeekBlockParser
from .glm45 import Glm45BlockParser
from .hermes import HermesBlockParser
from .kimi_k2 import KimiK2BlockParser
from .llama3 import Llama3BlockParser
from .qwen3_coder import XmlBlockParser, convert_parameter

__all__ = [
    "TOOL_CALL_FORMATS",
    "BlockParser",
    "BlockResult",
    "CallPiece",
    "FormatSpec",
    "HermesBlockParser",
    "ParsedCall",
    "ToolCallFormat",
    "XmlBlockParser",
    "convert_parameter",
    "format_spec",
    "token_id",
]

ToolCallFormat = Literal["qwen3", "qwen3_coder", "glm45", "deepseek_v31", "kimi_k2", "llama3", "gpt_oss", "none"]
TOOL_CALL_FORMATS: tuple[ToolCallFormat, ...] = (
    "qwen3", "qwen3_coder", "glm45", "deepseek_v31", "kimi_k2", "llama3", "gpt_oss", "none",
)  # fmt: skip

Schemas = Mapping[str, Mapping[str, Any]]


@attrs.frozen
class FormatSpec:
    """Where a format's tool-call blocks are and who reads them."""

    name: ToolCallFormat
    #: The token that opens a block.
    start: str
    #: The token that closes it (``None``: the block runs to the end of the generation).
    end: str | None
    #: A block parser for one block, given the request's parameter schemas.
    make: Callable[[Schemas], BlockParser]
    #: Special tokens inside a block are part of its text (DeepSeek's ``<｜tool▁sep｜>``, GLM's ``<arg_key>``).
    keep_special: bool = True
    #: A reply whose content opens with this text is a block too (Llama 3 JSON without ``<|python_tag|>``).
    bare_start: str | None = None


_SPECS: dict[str, FormatSpec] = {
    spec.name: spec
    for spec in (
        FormatSpec("qwen3", "<tool_call>", "</tool_call>", lambda _: HermesBlockParser(), keep_special=False),
        FormatSpec("qwen3_coder", "<tool_call>", "</tool_call>", XmlBlockParser, keep_special=False),
        FormatSpec("glm45", "<tool_call>", "</tool_call>", Glm45BlockParser),
        FormatSpec("deepseek_v31", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", lambda _: DeepSeekBlockParser()),
        FormatSpec(
            "kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", lambda _: KimiK2BlockParser()
        ),
        FormatSpec("llama3", "<|python_tag|>", None, lambda _: Llama3BlockParser(), bare_start="{"),
    )
}


def format_spec(name: str) -> FormatSpec | None:
    """The block format ``name`` (``None`` for ``gpt_oss``, which is not block-based, and ``none``)."""
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool_call_format {name!r}")
    return _SPECS.get(name)
