"""Raw HTTP for the gateway tests (stdlib http.client): status, headers, partial streams, hang-ups."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit


class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code, self.headers, self.content = status, headers, body

    def json(self):
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode()


def open_request(method: str, url: str, *, json_body=None, content: bytes | None = None,
                 headers: dict | None = None, timeout: float = 60):
    """Send a request; returns (connection, response) with the body unread."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    hdrs = dict(headers or {})
    if json_body is not None:
        content = json.dumps(json_body).encode()
        hdrs["Content-Type"] = "application/json"
    conn.request(method, u.path, body=content, headers=hdrs)
    return conn, conn.getresponse()


def request(method: str, url: str, **kw) -> Reply:
    conn, resp = open_request(method, url, **kw)
    try:
        body = resp.read()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body)
    finally:
        conn.close()


def get(url: str, **kw) -> Reply:
    return request("GET", url, **kw)


def post(url: str, **kw) -> Reply:
    return request("POST", url, **kw)
