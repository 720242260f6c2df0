"""Reward functions for ``POST /compute_reward``, and the two that ship.

A reward function takes the trajectory's messages and the dataset row's fields
and returns a number::

    def my_reward(messages: list[dict], dataset_fields: dict) -> float: ...
    async def my_reward(messages: list[dict], dataset_fields: dict) -> float: ...

Name one with ``--reward-fn module:callable`` (or a shipped one by its short
name, ``exact_match`` or ``gsm8k``). A synchronous function runs in a worker
thread, an async one on the proxy's Trio loop; either way a call is bounded by
``--reward-timeout``. The two shipped ones read the final answer from the last
assistant message:

- :func:`exact_match`: the answer (inside ``\\boxed{...}``, after ``Answer:``
  or ``####``, else the whole reply, whitespace collapsed) equals
  ``dataset_fields["ground_truth"]`` (or ``"answer"``, or verl's ``["reward_model"]["ground_truth"]``).
- :func:`gsm8k`: GSM8K-style numbers: the reply's ``#### N``, else its
  ``\\boxed{N}``, else its last number, equals the ground truth's number (after
  ``####`` when it has one), ignoring ``$``, ``,`` and trailing zeros.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

RewardFn = Callable[[list[dict[str, Any]], dict[str, Any]], "float | Awaitable[float]"]


class RewardFunctionError(ValueError):
    """A reward function that cannot be loaded, or whose call failed or returned no number."""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI/Anthropic content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def final_reply(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text of the last assistant message ("" when there is none)."""
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            return _text(message.get("content"))
    return ""


def _ground_truth(fields: Mapping[str, Any]) -> str:
    for key in ("ground_truth", "answer", "solution"):
        if key in fields and fields[key] is not None:
            return str(fields[key])
    nested = fields.get("reward_model")  # verl datasets (Claw-R1): {"reward_model": {"ground_truth": ...}}
    if isinstance(nested, Mapping) and nested.get("ground_truth") is not None:
        return str(nested["ground_truth"])
    raise RewardFunctionError("dataset_fields has no 'ground_truth' (or 'answer', or 'reward_model.ground_truth') "
                              "to compare with")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_answer(text: str) -> str:
    """The final answer a reply states: ``\\boxed{}``, else after ``####`` or ``Answer:``, else all of it."""
    boxed = _boxed(text)
    if boxed is not None:
        return " ".join(boxed.split())
    for marker in ("####", "answer:", "Answer:", "ANSWER:"):
        if marker in text:
            return " ".join(text.rsplit(marker, 1)[1].split())
    return " ".join(text.split())


def exact_match(messages: list[dict[str, Any]], dataset_fields: dict[str, Any]) -> float:
    """1.0 when the reply's final answer equals the ground truth (whitespace collapsed), else 0.0."""
    expected = " ".join(_ground_truth(dataset_fields).split())
    return 1.0 if extract_answer(final_reply(messages)) == expected else 0.0


_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def _number(text: str) -> Decimal | None:
    cleaned = text.replace("$", "").replace(",", "").strip().rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def gsm8k_answer(text: str) -> Decimal | None:
    """The number a GSM8K-style reply gives: after ``####``, else in ``\\boxed{}``, else the last one."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        if found:
            return _number(found[0])
    boxed = _boxed(text)
    if boxed is not None:
        found = _NUMBER.findall(boxed)
        if found:
            return _number(found[-1])
    found = _NUMBER.findall(text)
    return _number(found[-1]) if found else None


def gsm8k(messages: list[dict[str, Any]], dataset_fields: dict[str, Any]) -> float:
    """1.0 when the reply's number equals the ground truth's number, else 0.0."""
    expected = gsm8k_answer(_ground_truth(dataset_fields))
    if expected is None:
        raise RewardFunctionError("the ground truth holds no number")
    got = gsm8k_answer(final_reply(messages))
    return 1.0 if got is not None and got == expected else 0.0


SHIPPED: dict[str, RewardFn] = {"exact_match": exact_match, "gsm8k": gsm8k}


def load_reward_fn(spec: str) -> tuple[str, RewardFn]:
    """``module:callable`` (or a shipped short name) -> (its name, the function)."""
    if spec in SHIPPED:
        return f"actorproxy.rewards:{spec}", SHIPPED[spec]
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise RewardFunctionError(
            f"--reward-fn {spec!r}: expected 'module:callable' or one of {', '.join(SHIPPED)}"
        )
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise RewardFunctionError(f"--reward-fn {spec!r}: cannot load it ({type(exc).__name__}: {exc})") from None
    if not callable(target):
        raise RewardFunctionError(f"--reward-fn {spec!r} is not callable")
    return spec, target


def is_async(fn: Any) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)


def as_reward(name: str, value: Any) -> float:
    """The call's result as a finite float, or an error naming the function."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardFunctionError(f"reward function {name} returned {type(value).__name__}, not a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise RewardFunctionError(f"reward function {name} returned {reward}, not a finite number")
    return reward
