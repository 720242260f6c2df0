"""The one cattrs converter for every body we accept and every record we send.

Built by :func:`make_converter` (never cattrs' global converter):

- primitives are strict: a ``str`` field takes only a JSON string (cattrs would
  call ``str({})``), an ``int`` only an integer (not ``true``), a ``float`` any
  finite number, a ``bool`` only ``true``/``false``;
- attrs classes marked :func:`ours` (our trainer protocol) forbid unknown keys,
  so a typo fails loudly; others' protocols (OpenAI, Anthropic) tolerate them,
  as their clients send fields we do not know;
- a class may rename fields on the wire with ``__wire_renames__``, name in
  ``__wire_omit_if_default__`` the fields it leaves out of its JSON while they hold
  their default (an optional field some servers do not know), and give a field a
  structure function of its own in ``__wire_hooks__`` (a check that must come first,
  with words of its own);
- a base class naming in ``__wire_tags__`` its subclasses by the value of their
  ``type`` field (content blocks) structures an object into the subclass its
  ``type`` names, or into the base class itself for a type it does not name
  (``__wire_untagged__``: the tag of an object without a ``type``);
- a field typed ``str | list[X]`` (or ``| None``), ``X`` an attrs class, takes a string or an array of ``X``;
- ``array`` values unstructure to lists, except :data:`TokenIds`: a JSON array of
  integers structured into an ``array('i')`` and unstructured as that array itself
  (the engine clients' JSON writer serializes it whole, without a Python int per token).
- the records we emit (steps, segments, verify reports) unstructure by the hooks of
  :mod:`actorproxy.schema.records`.

:func:`structure` turns cattrs' validation errors into our :class:`BadRequest`
naming the first bad field's path (``messages[1].name``). It structures with a
twin converter built by the same rules without cattrs' detailed validation (no
error collected per field and per item: an accepted body costs less), and only a
body that twin refuses is structured again by :data:`CONVERTER`, whose error tree
names the culprit: what is accepted, and every error's words, are the detailed
converter's.
"""

from __future__ import annotations

import math
import operator
import types
import typing
from array import array
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NewType, TypeVar

import attrs
import cattrs
from cattrs.cols import is_mutable_sequence, list_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from ..errors import BadRequest, release
from .records import register_record_hooks

T = TypeVar("T")

if TYPE_CHECKING:
    TokenIds = NewType("TokenIds", array[int])
else:
    TokenIds = NewType("TokenIds", array)

_OURS_MARK = "__wire_forbid_extra__"


def ours(cls: type[T]) -> type[T]:
    """Mark an attrs class as a body of our own protocol: unknown keys are refused."""
    setattr(cls, _OURS_MARK, True)
    return cls


def is_ours(cls: type) -> bool:
    """Whether ``cls`` is a body of our own protocol (marked by :func:`ours`)."""
    return bool(getattr(cls, _OURS_MARK, False))


class FieldError(ValueError):
    """A value not acceptable (raised by structure hooks, and by validators naming their ``field``)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def at_least(bound: float) -> Any:
    """An attrs validator: the value (unless ``None``) is at least ``bound`` (else a :class:`FieldError`)."""
    return _bounded(bound, operator.ge, ">=")


def at_most(bound: float) -> Any:
    """An attrs validator: the value (unless ``None``) is at most ``bound`` (else a :class:`FieldError`)."""
    return _bounded(bound, operator.le, "<=")


def _bounded(bound: float, within: Callable[[Any, float], bool], word: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not within(value, bound):
            raise FieldError(f"must be {word} {bound}, got {value}", field=attribute.name)

    return check


def _type_error(value: Any, expected: str) -> FieldError:
    kind = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
    return FieldError(f"must be {expected}, got {kind}")


def _str(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise _type_error(value, "a string")
    return value


def _int(value: Any, _: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(value, "an integer")
    return value


def _float(value: Any, _: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(value, "a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise FieldError("must be a finite number")
    return number


def _bool(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(value, "a boolean")
    return value


def _label(value: Any, _: Any) -> str | int | None:
    if value is None or isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _type_error(value, "a string or an integer")


def _str_or_object(value: Any, _: Any) -> Any:
    if value is None or isinstance(value, str | dict):
        return value
    raise _type_error(value, "a string or an object")


def _strings(value: Any, _: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise _type_error(value, "a string or an array of strings")


def _token_ids(value: Any, _: Any) -> TokenIds:
    # One pass in C for the common case; the check only names the culprit.
    if isinstance(value, list) and all(type(i) is int for i in value):
        try:
            return TokenIds(array("i", value))
        except OverflowError:
            raise FieldError("holds a token id out of range") from None
    raise FieldError("must be a list of token ids (integers)")


def _token_ids_or_text(value: Any, _: Any) -> TokenIds | str:
    return value if isinstance(value, str) else _token_ids(value, _)


def _object(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _type_error(value, "an object")
    return value


def make_converter(*, detailed: bool = True) -> cattrs.Converter:
    """A converter with the edge's rules (see the module docstring).

    ``detailed=False``: without cattrs' detailed validation (an error is the first one raised, with no path).
    """
    converter = cattrs.Converter(forbid_extra_keys=False, detailed_validation=detailed)
    converter.register_structure_hook(str, _str)
    converter.register_structure_hook(int, _int)
    converter.register_structure_hook(float, _float)
    converter.register_structure_hook(bool, _bool)
    converter.register_structure_hook_func(lambda t: t == dict[str, Any], _object)
    converter.register_structure_hook(Any, lambda value, _: value)
    converter.register_structure_hook_func(lambda t: t == str | int | None, _label)
    converter.register_structure_hook_func(lambda t: t == str | dict[str, Any], _str_or_object)
    converter.register_structure_hook_func(lambda t: t == str | dict[str, Any] | None, _str_or_object)
    converter.register_structure_hook_func(lambda t: t == str | list[str] | None, _strings)
    converter.register_structure_hook(TokenIds, _token_ids)
    converter.register_structure_hook_func(lambda t: t == TokenIds | str, _token_ids_or_text)

    def fields_fn(cls: type) -> Any:
        renames = getattr(cls, "__wire_renames__", {})
        overrides = {name: override(rename=key) for name, key in renames.items()}
        for name, hook in getattr(cls, "__wire_hooks__", {}).items():
            overrides[name] = override(rename=renames.get(name), struct_hook=hook)
        forbid = is_ours(cls)
        return make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=forbid, **overrides)  # type: ignore[arg-type]

    def attrs_hook(cls: type) -> Any:
        tags: dict[str, type] | None = cls.__dict__.get("__wire_tags__")
        if tags is not None:
            by_tag = {tag: fields_fn(sub) for tag, sub in tags.items()}
            return _tagged(cls, by_tag, fields_fn(cls), cls.__dict__.get("__wire_untagged__"))
        fields = fields_fn(cls)

        def structure_object(value: Any, type_: Any) -> Any:
            if not isinstance(value, dict):  # cattrs would fail on it with a message about something else
                raise _type_error(value, "an object")
            return fields(value, type_)

        return structure_object

    converter.register_structure_hook_factory(attrs.has, attrs_hook)

    def omitting_hook(cls: type) -> Any:
        names: tuple[str, ...] = getattr(cls, "__wire_omit_if_default__", ())
        omitted = {name: override(omit_if_default=True) for name in names}
        return make_dict_unstructure_fn(cls, converter, **omitted)  # type: ignore[arg-type]

    converter.register_unstructure_hook_factory(
        lambda t: attrs.has(t) and hasattr(t, "__wire_omit_if_default__"), omitting_hook
    )

    def list_hook(cls: type) -> Any:
        items = list_structure_factory(cls, converter)

        def structure_list(value: Any, type_: Any) -> Any:
            if not isinstance(value, list):  # cattrs would iterate a string or an object's keys
                raise _type_error(value, "an array")
            return items(value, type_)

        return structure_list

    converter.register_structure_hook_factory(is_mutable_sequence, list_hook)
    converter.register_structure_hook_factory(_is_text_or_list, lambda t: _text_or_list(converter, t))
    converter.register_unstructure_hook(array, lambda values: values.tolist())
    converter.register_unstructure_hook(TokenIds, lambda values: values)
    converter.register_unstructure_hook_func(lambda t: t == TokenIds | str, lambda value: value)
    register_record_hooks(converter)
    return converter


def _tagged(base: type, by_tag: dict[str, Any], other: Any, absent: str | None) -> Any:
    """Structure an object into the class its ``type`` names (``other``, the base's, for a type not named).

    ``absent``: the tag of an object without a ``type`` (``None``: it must have one).
    """

    def structure_tagged(value: Any, type_: Any) -> Any:
        tag = value.get("type", absent) if isinstance(value, dict) else None
        if not isinstance(tag, str):
            raise FieldError("must be an object with a 'type'")
        hook = by_tag.get(tag)
        return other(value, base) if hook is None else hook(value, None)

    return structure_tagged


def _is_text_or_list(type_: Any) -> bool:
    """``str | list[X]`` or ``str | list[X] | None``, ``X`` an attrs class."""
    args = set(typing.get_args(type_)) if typing.get_origin(type_) in (typing.Union, types.UnionType) else set()
    args.discard(type(None))
    lists = [a for a in args if typing.get_origin(a) is list and attrs.has(typing.get_args(a)[0])]
    return len(args) == 2 and str in args and len(lists) == 1


def _text_or_list(converter: cattrs.Converter, type_: Any) -> Any:
    (items,) = [a for a in typing.get_args(type_) if typing.get_origin(a) is list]
    optional = type(None) in typing.get_args(type_)
    expected = "a string or an array of objects"

    hook: Any = None  # the list's own hook, looked up once (at first use: the item class may be this one's)

    def structure_text_or_list(value: Any, _: Any) -> Any:
        nonlocal hook
        if isinstance(value, str) or (value is None and optional):
            return value
        if not isinstance(value, list):
            raise _type_error(value, expected)
        if hook is None:
            hook = converter.get_structure_hook(items)
        return hook(value, items)

    return structure_text_or_list


#: The converter of the edge.
CONVERTER = make_converter()
#: The same rules without detailed validation: what :func:`structure` tries first.
_QUICK = make_converter(detailed=False)


def structure(value: Any, cls: type[T], *, where: str = "") -> T:
    """``value`` as ``cls``; :class:`BadRequest` naming the first bad field (prefixed by ``where``).

    Structured without detailed validation first; a refused value again with it, to name the culprit.
    """
    if attrs.has(cls) and not isinstance(value, dict):
        raise BadRequest(f"{where or 'the request body'} must be a JSON object", param=where or None)
    try:
        return _QUICK.structure(value, cls)
    except Exception as quick:  # whatever it refuses, the detailed run decides and words
        release(quick)  # its traceback holds the value
    try:
        return CONVERTER.structure(value, cls)
    except (cattrs.BaseValidationError, FieldError, TypeError, ValueError, KeyError) as exc:
        path, message = _first_error(exc, where)
        raise BadRequest(message, param=path or None) from None


def prepare(*, read: Iterable[type]) -> None:
    """Make now the hooks that :func:`structure` reads ``read`` with.

    cattrs writes and compiles each class's hook on its first use (0.3-0.8 ms a class here):
    made at start-up, not in the first call that needs it. (A hook to write with is better
    kept, ``CONVERTER.get_unstructure_hook``: :data:`CONVERTER` forgets the hooks it made each
    time one is registered, as the first use of a list type does.)
    """
    for cls in read:
        _QUICK.get_structure_hook(cls)


def named(instance: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    """An attrs validator: a string (unless ``None``) is not empty (else a :class:`FieldError`)."""
    if value is not None and not value:
        raise FieldError("must be a non-empty string", field=attribute.name)


def int64(instance: Any, attribute: attrs.Attribute[Any], value: int | None) -> None:
    """An attrs validator: the value (unless ``None``) fits a signed 64-bit integer, as engines store a seed."""
    if value is not None and not -(2**63) <= value < 2**63:
        raise FieldError(f"must be a 64-bit integer (from -2**63 to 2**63 - 1), got {value}", field=attribute.name)


def between(low: float, high: float) -> Any:
    """An attrs validator: the value (unless ``None``) is in ``[low, high]`` (else a :class:`FieldError`)."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not low <= value <= high:
            raise FieldError(f"must be between {low:g} and {high:g}, got {value}", field=attribute.name)

    return check


def number_in_range(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    """``body[name]`` as a float in ``[low, high]`` (absent or null: ``None``); else :class:`BadRequest`."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a number", param=name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low:g} and {high:g}, got {value}", param=name)
    return float(value)


def _first_error(exc: BaseException, path: str) -> tuple[str, str]:
    """The path of the first leaf error in a cattrs error tree, and a message naming it."""
    while isinstance(exc, ClassValidationError | IterableValidationError):
        errors, others = exc.group_exceptions()
        if not errors:
            exc = others[0] if others else exc
            break
        inner, note = errors[0]
        if isinstance(note, AttributeValidationNote):
            renames = getattr(note.type, "__wire_renames__", {}) if isinstance(note.type, type) else {}
            name = renames.get(note.name, note.name)
            path = f"{path}.{name}" if path else name
        elif isinstance(note, IterableValidationNote):
            path = f"{path}[{note.index}]"
        exc = inner
    shown = path or "the request body"
    if isinstance(exc, ForbiddenExtraKeysError):
        extra = sorted(exc.extra_fields)
        field = f"{path}.{extra[0]}" if path else extra[0]
        return field, f"unknown field(s) {extra} in {shown}"
    if isinstance(exc, KeyError):
        return path, f"'{shown}' is required"
    if isinstance(exc, FieldError):
        if exc.field is not None:
            path = f"{path}.{exc.field}" if path else exc.field
        return path, f"'{path}' {exc}"
    text = str(exc)
    if " not in literal " in text:
        allowed = text.split(" not in literal ", 1)[1].removeprefix("typing.Literal")
        return path, f"'{shown}' must be one of {allowed}"
    if "is not iterable" in text:
        return path, f"'{shown}' must be an array"
    return path, f"'{shown}' is invalid: {exc}"
