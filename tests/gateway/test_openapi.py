"""/openapi.json: a valid OpenAPI 3 document listing every route the gateway serves, each of which
answers; schemathesis then sends generated requests to every operation: never a 5xx, and every
response matches the documented schema."""
import json

import openapi_spec_validator
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import content_type_conformance, not_a_server_error, response_schema_conformance

from gateway.config import GatewayConfig
from gateway.routes import ENDPOINTS
from tests.gateway import http_util as http

KEY = "openapi-key"
# Off unless the server starts with --enable-lora-runtime-updates (then tests/gateway/test_live_lora.py).
LORA_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def short_server(tiny_model_folder):
    """A tiny engine with a 96-token context, so no generated request runs long."""
    from actors.config import EngineConfig
    from tests.gateway.live import LiveServer

    live = LiveServer(EngineConfig(model=tiny_model_folder, dtype="float32", num_blocks=128, block_size=16,
                                   max_num_seqs=32, max_num_batched_tokens=256, max_model_len=96,
                                   num_threads=1))
    live.start()
    try:
        yield live.add_app(GatewayConfig(api_key=KEY, served_model_name="tiny", max_body_bytes=64 << 10,
                                         disable_access_log=True))
    finally:
        live.stop()


@pytest.fixture(scope="module")
def document(short_server):
    r = http.get(short_server + "/openapi.json")   # no key needed
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    return r.json()


def test_the_document_is_valid_openapi_3(document):
    openapi_spec_validator.validate(document)
    assert document["openapi"].startswith("3.1")
    schemas = document["components"]["schemas"]
    assert {"ChatRequest", "CompletionRequest", "ChatCompletion", "Completion", "ErrorResponse",
            "ResponsesRequest", "ResponseObject", "ResponseDeleted"} <= set(schemas)
    assert "input" in schemas["ResponsesRequest"]["required"]
    assert "messages" in schemas["ChatRequest"]["required"]
    assert document["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}, {"apiKey": []}]
    assert "security" not in document["paths"]["/health"]["get"]


def test_every_route_is_documented_and_every_documented_route_answers(short_server, document):
    from gateway.routes import ROUTES

    served = {(r.method, r.path) for r in ROUTES}
    assert served == {(e.method, e.path) for e in ENDPOINTS}
    documented = {(m.upper(), p): op for p, ops in document["paths"].items() for m, op in ops.items()}
    assert set(documented) == {(e.method, e.openapi_path) for e in ENDPOINTS}
    endless = {e.openapi_path for e in ENDPOINTS if e.endless}
    for (method, path), op in sorted(documented.items()):
        url = short_server + path.replace("{model}", "tiny")
        if "{response_id}" in path:   # a response stored for this call (DELETE forgets it)
            made = http.post(short_server + "/v1/responses", headers=AUTH, json_body={"input": "Hi", "max_output_tokens": 2})
            url = url.replace("{response_id}", made.json()["id"])
        if path in LORA_ROUTES:
            r = http.request(method, url, headers=AUTH, json_body={"lora_name": "a", "lora_path": "/a"})
            assert r.status_code == 404 and "--enable-lora-runtime-updates" in r.text, path
            continue
        body = op["requestBody"]["content"]["application/json"]["example"] if "requestBody" in op else None
        if "/v1/files" in path or "/v1/batches" in path:   # on a file (and a batch) made for this call
            url, body = _on_a_batch(short_server, method, url, body)
            if url is None:
                continue
        if path in endless:   # its headers say it answers; its body never ends
            conn, resp = http.open_request(method, url, headers=AUTH)
            conn.close()
            assert resp.status == 200, path
            continue
        r = http.request(method, url, headers=AUTH, json_body=body)   # the documented example works
        assert r.status_code == 200, (method, path, r.status_code, r.text[:300])


BATCH_LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}


def _on_a_batch(server: str, method: str, url: str, body: dict | None):
    """The url and body of a Files or Batches route on things that exist; (None, None) when the
    route itself was called here (an upload is multipart, not the JSON the others take)."""
    made = http.upload(server + "/v1/files", json.dumps(BATCH_LINE).encode(), headers=AUTH)
    assert made.status_code == 200, made.text
    file_id = made.json()["id"]
    if method == "POST" and url.endswith("/v1/files"):
        return None, None
    if body is not None:   # POST /v1/batches: its example, on this file
        body = {**body, "input_file_id": file_id}
    if "{batch_id}" in url:
        batch = http.post(server + "/v1/batches", headers=AUTH,
                          json_body={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}).json()
        url = url.replace("{batch_id}", batch["id"])
    return url.replace("{file_id}", file_id), body


@pytest.fixture(scope="module")
def api_schema(document):
    return schemathesis.openapi.from_dict(document)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", [e for e in ENDPOINTS if not e.endless],
                         ids=lambda e: f"{e.method} {e.openapi_path}")
def test_generated_requests_never_get_a_5xx_and_match_the_schema(short_server, api_schema, endpoint):
    """40 requests the schema allows (most fail the range checks: 400s), and for a body 20 it does
    not (wrong types, missing fields, a wrong key: 4xx) and the documented example."""
    operation = api_schema[endpoint.openapi_path][endpoint.method]
    strategies = [(operation.as_strategy(GenerationMode.POSITIVE), 40)]
    if endpoint.request is not None:   # a body to get wrong, and a documented example
        strategies.append((operation.as_strategy(GenerationMode.NEGATIVE), 20))
        strategies += [(s, 1) for s in operation.get_strategies_from_examples()]
    statuses = []
    for strategy, examples in strategies:
        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def generated(case):
            r = case.call_and_validate(base_url=short_server, headers=AUTH,
                                       checks=[not_a_server_error, content_type_conformance,
                                               response_schema_conformance])
            statuses.append(r.status_code)

        generated()
    assert statuses
    if endpoint.request is not None and endpoint.openapi_path not in LORA_ROUTES:   # and the engine was reached
        assert 400 in statuses
        assert 200 in statuses or endpoint.path == "/v1/batches"   # a batch needs a file uploaded first
