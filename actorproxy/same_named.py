"""One attrs class built from another object's attributes of the same names."""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
from attrs import AttrsInstance

T = TypeVar("T", bound=AttrsInstance)

#: (source class, target class) -> the target's field names the source has too; one entry a pair of
#: classes the code names, so it stays small.
_SHARED: dict[tuple[type, type], tuple[str, ...]] = {}


def build_from(target: type[T], source: AttrsInstance, /, **overrides: Any) -> T:
    """A ``target`` whose fields ``source`` has too take ``source``'s values; ``overrides`` set the others.

    ``target`` and ``source``'s class are attrs classes. An override replaces a same-named
    value (a field named alike but typed or meant otherwise); a field neither sets keeps its default.
    """
    key = (type(source), target)
    names = _SHARED.get(key)
    if names is None:
        theirs = attrs.fields_dict(type(source))
        names = _SHARED[key] = tuple(name for name in attrs.fields_dict(target) if name in theirs)
    return target(**{name: getattr(source, name) for name in names if name not in overrides}, **overrides)
