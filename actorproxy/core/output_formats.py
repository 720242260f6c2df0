"""The output formats a model may write: reasoning formats, its template's tool-call format, tool schemas."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

from .tool_parsers import ToolCallFormat

ReasoningFormat = Literal["qwen3", "glm45", "deepseek_v31", "kimi_k2", "deepseek_r1", "gpt_oss", "none"]
REASONING_FORMATS: tuple[ReasoningFormat, ...] = get_args(ReasoningFormat)


#: A marker only one family's chat template writes, and that family's tool-call format (first match wins).
_TEMPLATE_MARKERS: tuple[tuple[tuple[str, ...], ToolCallFormat], ...] = (
    (("<|channel|>",), "gpt_oss"),
    (("<arg_key>",), "glm45"),
    (("<｜tool▁calls▁begin｜>",), "deepseek_v31"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (("<|python_tag|>", "<|start_header_id|>"), "llama3"),
    (("<function=", "<parameter="), "qwen3_coder"),
)


def default_tool_call_format(tokenizer: Any) -> ToolCallFormat:
    """The format the chat template writes its calls in (by a marker only it has), else ``qwen3``."""
    template = getattr(getattr(tokenizer, "hf", tokenizer), "chat_template", None)
    texts = [t for t in (template.values() if isinstance(template, Mapping) else (template,)) if isinstance(t, str)]
    for markers, name in _TEMPLATE_MARKERS:
        if any(marker in text for marker in markers for text in texts):
            return name
    return "qwen3"


def tool_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Tool name → the JSON schemas of its parameters (``parameters.properties``)."""
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters") or function.get("input_schema")
        props = params.get("properties") if isinstance(params, Mapping) else None
        schemas[function["name"]] = props if isinstance(props, Mapping) else {}
    return schemas
