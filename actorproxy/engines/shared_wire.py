"""Wire types more than one engine speaks (and the simulator serves): the model list, weight versions.

``GET /v1/models`` (:class:`ModelList`): the clients read the first card's ``id`` and
``max_model_len`` (llama.cpp: ``meta.n_ctx_train``). ``POST /update_weight_version``
(:class:`UpdateWeightVersionReqInput`) and the current version (:class:`WeightVersionOutput`:
SGLang's ``/get_weight_version``, vLLM's ``/weight_info``) are the same on SGLang and vLLM.
Unknown fields are tolerated.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class ModelCard:
    __wire_omit_if_default__ = ("meta",)

    id: str | None = None
    object: str = "model"
    created: int = 0
    owned_by: str | None = None
    root: str | None = None
    parent: str | None = None
    #: The context length (vLLM, SGLang).
    max_model_len: int | None = None
    permission: list[Any] = attrs.field(factory=list)
    #: llama.cpp: the model's metadata (``n_ctx_train``).
    meta: dict[str, Any] | None = None


@attrs.frozen
class ModelList:
    data: list[ModelCard] = attrs.field(factory=list)
    object: str = "list"


@attrs.frozen
class UpdateWeightVersionReqInput:
    """``POST /update_weight_version``: label the tokens sampled from now on ``new_version``."""

    new_version: str
    abort_all_requests: bool = False


@attrs.frozen
class WeightVersionOutput:
    weight_version: str | int | None = None
