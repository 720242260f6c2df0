"""GET /openapi.json (a valid OpenAPI 3.1 document of every route) and GET /docs (local assets only)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from actorproxy import ProxyConfig, open_proxy
from actorproxy.serve import RunningProxy
from actorproxy.server.app import create_app
from actorproxy.server.openapi import OPERATIONS, operation_for, served_routes


@pytest.fixture
async def proxy(tokenizer: Any) -> AsyncIterator[RunningProxy]:
    async with open_proxy(ProxyConfig.of(port=0, admin_token="s3cret"), tokenizer=tokenizer) as running:
        yield running


@pytest.fixture
async def http(proxy: RunningProxy) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as client:
        yield client


async def test_openapi_is_a_valid_3_1_document_of_every_route(http: httpx.AsyncClient, proxy: RunningProxy) -> None:
    from openapi_spec_validator import validate
    from openapi_spec_validator.validation import OpenAPIV31SpecValidator

    response = await http.get("/openapi.json")  # public, like /health: it holds no data
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.1")
    validate(document, cls=OpenAPIV31SpecValidator)
    listed = {(path, method.upper()) for path, ops in document["paths"].items() for method in ops}
    served = served_routes(create_app(proxy.runtime))  # the same registration the served app went through
    assert served, "the app serves routes"
    for rule, method in served:
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule)
        assert (path, method) in listed, f"{method} {rule} is served but not in /openapi.json"
        # A new route needs a description in actorproxy/server/openapi.py, not the "(undocumented)" fallback.
        assert operation_for(rule, method) is not None, f"{method} {rule} has no entry in OPERATIONS"
    assert len(listed) == len(served)


async def test_openapi_schemas_come_from_the_models_the_routes_validate_with(http: httpx.AsyncClient) -> None:
    document = (await http.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    submit = document["paths"]["/submit_steps"]["post"]
    assert submit["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SubmitStepsBody"}
    assert "409" in submit["responses"]
    step = schemas["StepBody"]
    assert step["additionalProperties"] is False  # ours: unknown fields are refused, and the schema says so
    assert set(step["required"]) == {"trajectory_uid", "prompt_uid", "prompt_ids", "response_ids", "step_index"}
    assert step["properties"]["prompt_ids"] == {"type": "array", "items": {"type": "integer"}}
    generated = document["paths"]["/generate"]["post"]["responses"]["200"]["content"]["application/json"]
    assert generated["schema"] == {"$ref": "#/components/schemas/GenerateResult"}
    # The per-session mounts share their route's description.
    mounted = document["paths"]["/{url_session}/{url_instance}/v1/chat/completions"]["post"]
    assert mounted["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionBody")
    assert all(key in OPERATIONS for key in [("/generate", "POST"), ("/submit_steps", "POST")])


async def test_docs_page_uses_local_assets_only(http: httpx.AsyncClient) -> None:
    page = await http.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    references = re.findall(r'(?:src|href)="([^"]+)"', html) + re.findall(r'url:\s*"([^"]+)"', html)
    assert references, html
    assert not re.search(r"https?://|//[a-z]", html), "the page must not reach the internet"
    for ref in references:
        assert ref.startswith("/"), ref
        asset = await http.get(ref)
        assert asset.status_code == 200, ref
        assert len(asset.content) > 0
    bundle = await http.get("/docs/assets/swagger-ui-bundle.js")
    assert b"SwaggerUIBundle" in bundle.content and b'"5.' in bundle.content  # Swagger UI 5 reads OpenAPI 3.1
    assert (await http.get("/docs/assets/secrets.txt")).status_code == 404
    assert (await http.get("/docs/assets/..%2Fcore.py")).status_code == 404


@pytest.mark.parametrize(("method", "path"), [("POST", "/openapi.json"), ("DELETE", "/docs"),
                                              ("POST", "/docs/assets/swagger-ui.css")])
async def test_wrong_methods_are_a_405_in_openai_format(http: httpx.AsyncClient, method: str, path: str) -> None:
    response = await http.request(method, path, headers={"Authorization": "Bearer s3cret"})
    assert response.status_code == 405
    assert set(response.json()["error"]) >= {"message", "type", "code"}
