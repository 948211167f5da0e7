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


def upload(url: str, data: bytes, purpose: str = "batch", headers: dict | None = None) -> Reply:
    """POST a file as multipart/form-data, as OpenAI's files.create sends it."""
    boundary = "matinee-test-boundary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            f'Content-Type: application/jsonl\r\n\r\n').encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return post(url, content=body, headers={**(headers or {}),
                                            "Content-Type": f"multipart/form-data; boundary={boundary}"})
