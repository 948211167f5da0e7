"""The HTTP surface around the API: several API keys, several model names, CORS, request ids and
the access log, a chat template of the operator's, over real HTTP on loopback."""
import json
import os
import re

import openai
import pytest

from gateway import cli
from gateway.config import GatewayConfig
from tests.gateway import http_util as http

MSG = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def keyed(tiny_servers, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# the team's keys\nfile-key-1\n\n  file-key-2  \n")
    return tiny_servers.live.add_app(GatewayConfig(api_key=["flag-key-1", "flag-key-2"],
                                                   api_key_file=str(keys), served_model_name="tiny"))


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


SECURITY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "SECURITY.md")


def _documented_open_routes() -> set[tuple[str, str]]:
    """The routes SECURITY.md lists as answering without a key: `METHOD /path` in the bullets under
    the sentence that says `--api-key` guards every route but these."""
    text = open(SECURITY, encoding="utf-8").read()
    start = text.index("`--api-key` guards every route but these")
    block = text[start:].split("\n\n", 2)[1]   # the list, the paragraph after the sentence
    assert block.startswith("- "), block
    return set(re.findall(r"`(GET|POST|PUT|DELETE|PATCH) (/[^`]*)`", block))


def test_the_open_routes_are_exactly_those_security_md_lists(tiny_servers):
    """Every route of a real keyed app, asked without a key over HTTP: those that do not answer
    401 are the open ones, and SECURITY.md must name exactly them."""
    base = tiny_servers.live.add_app(GatewayConfig(api_key="k", served_model_name="tiny"))
    app = tiny_servers.live.runners[-1].app
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert len(routes) > 20 and ("POST", "/v1/chat/completions") in routes
    open_routes = set()
    for method, path in sorted(routes):
        url = base + re.sub(r"\{[^}]*\}", "tiny", path)
        conn, resp = http.open_request(method, url, content=b"" if method == "POST" else None)
        try:
            if resp.status != 401:
                open_routes.add((method, path))
        finally:
            conn.close()   # an endless stream, were one open, is not read
    assert ("GET", "/health") in open_routes and ("GET", "/v1/models") not in open_routes
    assert open_routes == _documented_open_routes()


def test_every_key_from_flags_and_file_is_accepted_and_no_other(keyed):
    for key in ("flag-key-1", "flag-key-2", "file-key-1", "file-key-2"):
        assert http.get(keyed + "/v1/models", headers=_auth(key)).status_code == 200, key
    for headers in ({}, _auth("file-key-3"), _auth("# the team's keys"), _auth("")):
        r = http.get(keyed + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert http.get(keyed + "/health").status_code == 200


def test_the_key_may_come_as_x_api_key_as_anthropics_sdk_sends_it(keyed):
    for key in ("flag-key-1", "file-key-2"):
        assert http.get(keyed + "/v1/models", headers={"x-api-key": key}).status_code == 200, key
    for headers in ({"x-api-key": "file-key-3"}, {"x-api-key": ""}, {"X-Api-Key": "flag-key-"}):
        r = http.get(keyed + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # A bearer token, when there is one, is the key: a right x-api-key does not rescue a wrong one.
    r = http.get(keyed + "/v1/models", headers={**_auth("wrong"), "x-api-key": "flag-key-1"})
    assert r.status_code == 401


def test_an_x_api_key_is_the_same_tenant_as_its_bearer_token(tiny_servers):
    base = tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny"))
    prompt = "tenant by x-api-key " * 10   # several full blocks

    def cached(headers) -> int:
        r = http.post(base + "/v1/completions", headers=headers,
                      json_body={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(_auth("tenant-a"))
    assert cached({"x-api-key": "tenant-a"}) > 0
    assert cached({"x-api-key": "tenant-b"}) == 0


def test_key_flags_repeat_and_the_environment_gives_the_default(tmp_path):
    a = cli.build_parser({}).parse_args(["serve", "--api-key", "a", "--api-key", "b", "c"])
    assert a.api_key == ["a", "b", "c"]
    parser = cli.build_parser({"MATINEE_API_KEY": "env-key"})
    assert parser.parse_args(["serve"]).api_key == ["env-key"]
    assert parser.parse_args(["serve", "--api-key", "cli-key"]).api_key == ["cli-key"]
    empty = tmp_path / "empty.txt"
    empty.write_text("# no keys yet\n")
    for kwargs, says in ((dict(api_key_file=str(empty)), "holds no key"),
                         (dict(api_key_file=str(tmp_path / "missing")), "cannot read"),
                         (dict(api_key=[""]), "must not be empty")):
        with pytest.raises(ValueError, match=says):
            GatewayConfig(**kwargs)
    assert GatewayConfig(api_key="one").api_keys == ("one",)   # a single key, as before


def test_several_served_model_names(tiny_servers):
    base = tiny_servers.live.add_app(GatewayConfig(served_model_name=["first", "second"]))
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in c.models.list().data] == ["first", "second"]
    assert c.models.retrieve("second").id == "second"
    for name in ("first", "second"):
        r = c.chat.completions.create(model=name, messages=MSG, max_tokens=2)
        assert r.model == "first"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
    a = cli.build_parser({}).parse_args(["serve", "--served-model-name", "x", "y"])
    assert a.served_model_name == ["x", "y"]


def test_cors_allows_any_origin_by_default(tiny_servers):
    base = tiny_servers.live.add_app(GatewayConfig())
    r = http.request("OPTIONS", base + "/v1/chat/completions",
                     headers={"Origin": "http://page.example", "Access-Control-Request-Method": "POST",
                              "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    r = http.post(base + "/v1/chat/completions", headers={"Origin": "http://page.example"},
                  json_body={"messages": MSG, "max_tokens": 1})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    assert "access-control-allow-origin" not in http.get(base + "/v1/models").headers   # no Origin


def test_cors_with_named_origins_and_a_key(tiny_servers):
    base = tiny_servers.live.add_app(GatewayConfig(allowed_origins=["http://ok.example"], api_key="k"))
    preflight = {"Access-Control-Request-Method": "POST"}
    r = http.request("OPTIONS", base + "/v1/completions", headers={"Origin": "http://ok.example", **preflight})
    assert r.status_code == 200   # before the key check: a browser sends no credentials with it
    assert r.headers["access-control-allow-origin"] == "http://ok.example" and r.headers["vary"] == "Origin"
    r = http.request("OPTIONS", base + "/v1/completions", headers={"Origin": "http://evil.example", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = http.get(base + "/v1/models", headers={"Origin": "http://ok.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://ok.example"
    r = http.get(base + "/v1/models", headers={"Origin": "http://evil.example", **_auth("k")})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def _log_lines(text: str, request_id: str) -> list[dict]:
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [d for d in lines if d.get("request_id") == request_id]


def test_request_ids_on_every_response_and_in_the_access_log(tiny_servers, capsys):
    base = tiny_servers.live.add_app(GatewayConfig(api_key="k"))
    chosen = "client-chosen-id-1"
    r = http.post(base + "/v1/completions", headers={**_auth("k"), "X-Request-Id": chosen},
                  json_body={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-request-id"] == chosen
    made = []
    for reply in (http.post(base + "/v1/completions", headers=_auth("k"),   # streamed
                            json_body={"prompt": "Hello", "max_tokens": 2, "stream": True}),
                  http.get(base + "/v1/models"),                              # 401
                  http.get(base + "/no/such/route", headers=_auth("k")),     # 404
                  http.post(base + "/v1/completions", headers={**_auth("k"), "X-Request-Id": "has space"},
                            json_body={"prompt": "x", "max_tokens": 1})):    # unusable: a new one
        made.append(reply.headers["x-request-id"])
        assert re.fullmatch(r"[0-9a-f]{32}", made[-1]), reply.headers
    assert len(set(made)) == len(made)
    logged = capsys.readouterr().err
    for rid, method, path, status in ((chosen, "POST", "/v1/completions", 200),
                                      (made[0], "POST", "/v1/completions", 200),
                                      (made[1], "GET", "/v1/models", 401),
                                      (made[2], "GET", "/no/such/route", 404)):
        access = [d for d in _log_lines(logged, rid) if d["event"] == "http request"]
        assert len(access) == 1, (rid, logged[-2000:])
        line = access[0]
        assert (line["method"], line["path"], line["status"]) == (method, path, status)
        assert line["duration_ms"] >= 0


def test_the_access_log_can_be_switched_off(tiny_servers, capsys):
    base = tiny_servers.live.add_app(GatewayConfig(disable_access_log=True))
    r = http.get(base + "/v1/models")
    assert r.status_code == 200
    assert _log_lines(capsys.readouterr().err, r.headers["x-request-id"]) == []


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"


@pytest.mark.parametrize("as_file", [False, True])
def test_chat_template_overrides_the_models(tiny_servers, tmp_path, as_file):
    value = TEMPLATE
    if as_file:
        (tmp_path / "chat.jinja").write_text(TEMPLATE)
        value = str(tmp_path / "chat.jinja")
    base = tiny_servers.live.add_app(GatewayConfig(chat_template=value, served_model_name="tiny"))
    tok = tiny_servers.tokenizer
    ours = http.post(base + "/tokenize", json_body={"messages": MSG}).json()["tokens"]
    assert ours == tok.encode("[user]Hello world![assistant]", add_special_tokens=False)
    plain = tiny_servers.live.add_app(GatewayConfig())   # the engine's tokenizer keeps the model's
    assert http.post(plain + "/tokenize", json_body={"messages": MSG}).json()["tokens"] != ours
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(messages=MSG, model="tiny", max_tokens=1)
    assert r.usage.prompt_tokens == len(ours)   # generation renders the same way


def test_a_bad_chat_template_fails_at_start(tmp_path):
    with pytest.raises(ValueError, match="does not parse"):
        GatewayConfig(chat_template="{% for m in messages %}no end")
    with pytest.raises(ValueError, match="neither a file nor"):
        GatewayConfig(chat_template=str(tmp_path / "missing.jinja"))
