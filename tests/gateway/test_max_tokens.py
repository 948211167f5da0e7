"""--max-tokens-default and --max-tokens-limit, over real HTTP on loopback: what a request that asks
for nothing gets, and a 400 naming the limit for one that asks for more."""
import pytest

from gateway.config import GatewayConfig
from tests.gateway import http_util as http

MSG = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def capped(tiny_servers):
    return tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny", max_tokens_default=3,
                                                   max_tokens_limit=5))


@pytest.fixture(scope="module")
def limit_only(tiny_servers):
    return tiny_servers.live.add_app(GatewayConfig(served_model_name="tiny", max_tokens_limit=4))


def _generated(base: str, route: str, **body) -> int:
    payload = {"model": "tiny", "ignore_eos": True, **body}
    payload |= {"messages": MSG} if route == "chat/completions" else {"prompt": "Hello"}
    r = http.post(f"{base}/v1/{route}", json_body=payload)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_a_request_without_max_tokens_gets_the_servers_default(capped, route):
    assert _generated(capped, route) == 3
    assert _generated(capped, route, max_tokens=5) == 5   # the limit itself is allowed


def test_the_default_without_the_flag_is_vllms(tiny_servers, limit_only):
    assert _generated(tiny_servers.limits, "completions") == 16
    # Chat's default is the rest of the context, which the limit then caps.
    assert _generated(limit_only, "chat/completions") == 4
    assert _generated(limit_only, "completions") == 4


@pytest.mark.parametrize("route,param", [("chat/completions", "max_tokens"),
                                         ("chat/completions", "max_completion_tokens"),
                                         ("completions", "max_tokens")])
def test_asking_for_more_than_the_limit_is_a_400_naming_it(capped, route, param):
    body = {"model": "tiny", param: 6}
    body |= {"messages": MSG} if route == "chat/completions" else {"prompt": "Hello"}
    r = http.post(f"{capped}/v1/{route}", json_body=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "max_tokens_over_limit"
    assert error["type"] == "invalid_request_error" and "at most 5" in error["message"]


def test_the_limits_are_checked_at_start():
    for kwargs, says in ((dict(max_tokens_default=0), "max_tokens_default must be at least 1"),
                         (dict(max_tokens_limit=0), "max_tokens_limit must be at least 1"),
                         (dict(max_tokens_default=9, max_tokens_limit=8), "must be at most")):
        with pytest.raises(ValueError, match=says):
            GatewayConfig(**kwargs)
