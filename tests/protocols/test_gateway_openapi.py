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
    generate = document["paths"]["/generate"]["post"]
    generated = generate["responses"]["200"]["content"]["application/json"]
    assert generated["schema"] == {"oneOf": [{"$ref": "#/components/schemas/GenerateResult"},
                                             {"$ref": "#/components/schemas/TokenGenerateResult"}]}
    # Claw-R1's shipped token-in body is described beside ours, with its own fields.
    assert generate["requestBody"]["content"]["application/json"]["schema"]["oneOf"][1] == {
        "$ref": "#/components/schemas/TokenGenerateBody"}
    assert set(schemas["TokenGenerateBody"]["required"]) == {"prompt_ids"}
    assert "reward_score" in schemas["TokenRewardResult"]["properties"]
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


def _checker(document: dict[str, Any], schema: dict[str, Any]) -> Any:
    from jsonschema import Draft202012Validator

    return Draft202012Validator({**schema, "components": document["components"]})


_BAD_TURN = {"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 4, "model": "m"}


@pytest.mark.parametrize(("path", "body", "admin"), [
    ("/v1/chat/completions", _BAD_TURN, False),
    ("/sess/s/v1/chat/completions", _BAD_TURN, False),
    ("/v1/messages", _BAD_TURN, False),
    ("/sess/s/v1/messages", _BAD_TURN, False),
    ("/t/p/v1/messages", _BAD_TURN, False),
    ("/v1/messages/count_tokens", _BAD_TURN, False),
    ("/v1/responses", {"input": 5}, False),
    ("/generate", {"input_ids": "x"}, True),
    ("/session/finalize", {"session_id": 5}, True),
    ("/trajectory/read", {"limit": "x"}, True),
])
async def test_an_error_is_what_the_document_says_for_its_route(http: httpx.AsyncClient, path: str,
                                                                 body: dict[str, Any], admin: bool) -> None:
    """Issue 28 §17: the Anthropic routes' errors were documented with OpenAI's ``param``, which they lack."""
    document = (await http.get("/openapi.json")).json()
    response = await http.post(path, json=body, headers={"Authorization": "Bearer s3cret"} if admin else {})
    assert response.status_code == 400, response.text
    template = path if path in document["paths"] else next(
        p for p in document["paths"] if re.fullmatch(re.sub(r"\{[a-z_]+\}", "[^/]+", p), path))
    schema = document["paths"][template]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    errors = [e.message for e in _checker(document, schema).iter_errors(response.json())]
    assert errors == [], (path, response.json())


async def test_options_allows_what_the_document_lists(http: httpx.AsyncClient) -> None:
    """``OPTIONS /session/finalize`` listed the GET of ``/session/<id>`` (which answers it 405)."""
    document = (await http.get("/openapi.json")).json()
    for path, operations in document["paths"].items():
        concrete = re.sub(r"\{[a-z_]+\}", "x1", path)
        response = await http.options(concrete, headers={"Authorization": "Bearer s3cret"})
        allowed = set(response.headers.get("allow", "").replace(" ", "").split(","))
        documented = {m.upper() for m in operations} | {"OPTIONS"} | ({"HEAD"} if "get" in operations else set())
        assert allowed == documented, (path, response.status_code, allowed)


@pytest.mark.parametrize(("function", "where"), [
    ({"name": "", "arguments": "{}"}, "messages[1].tool_calls[0].function.name"),
    ({"name": "f", "arguments": None}, "messages[1].tool_calls[0].function.arguments"),
])
async def test_a_tool_call_the_document_refuses_is_a_400(http: httpx.AsyncClient, function: dict[str, Any],
                                                         where: str) -> None:
    """An assistant tool call with an empty name or null arguments was accepted; the document refuses both."""
    document = (await http.get("/openapi.json")).json()
    call = document["components"]["schemas"]["FunctionCall"]
    assert list(_checker(document, call).iter_errors(function)), function  # the document refuses it
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": function}]},
                {"role": "tool", "tool_call_id": "c1", "content": "r"}]
    response = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4},
                               headers={"X-Session-Id": "calls"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == where
    from actorproxy.errors import BadRequest
    from actorproxy.protocols.openai_chat import parse_chat_body

    with pytest.raises(BadRequest) as refused:  # the typed path (a body given as a value) says the same
        parse_chat_body({"messages": messages})
    assert refused.value.param == where
