"""A fault-injecting reverse proxy in front of moto's S3 server, for the store's unclear outcomes.

Clients (s3fs in the test process or in a worker subprocess) point their endpoint at `proxy.url`;
every request is forwarded to moto unchanged unless a rule matches it. A rule matches by method,
a substring of the request path (bucket/key), optionally whether the request carries
`If-None-Match`, and the occurrence number among the requests it matches (1-based; None: all):

    drop_reply   forward the request (it lands in moto) and close the connection unanswered,
                 as when a reply is lost on the way back
    strip_inm    forward it without If-None-Match, as a store that ignores the header would
    412/409/500  answer with that status and an S3 error body, without forwarding

Localhost only; one thread per connection, each request bounded by the client's own timeouts.
`proxy.log` records (method, path, had If-None-Match, action) for the test's assertions.
"""

from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional, Union
from urllib.parse import urlsplit

_ERROR_CODES = {412: "PreconditionFailed", 409: "ConditionalRequestConflict", 500: "InternalError"}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


@dataclass
class Rule:
    method: str
    key: str  # a substring of the request path
    action: Union[str, int]  # "drop_reply", "strip_inm", or an HTTP status to answer
    if_none_match: Optional[bool] = None  # None: either way
    nth: Optional[tuple[int, ...]] = None  # occurrences (1-based) of matching requests; None: every one
    message: str = "injected by the test proxy"  # the error body's Message
    seen: int = field(default=0, init=False)


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, bool, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect

            def log_message(self, *args) -> None:  # quiet
                pass

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="s3-fault-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def add(self, *rules: Rule) -> None:
        with self._lock:
            self.rules.extend(rules)

    def actions(self, key: str, method: Optional[str] = None) -> list[str]:
        """The actions taken on (`method`) requests whose path holds `key`, in order ("forward":
        passed through as it came)."""
        with self._lock:
            return [action for m, path, _, action in self.log if key in path and method in (None, m)]

    def _match(self, method: str, path: str, has_inm: bool) -> Optional[Rule]:
        with self._lock:
            for rule in self.rules:
                if rule.method != method or rule.key not in path:
                    continue
                if rule.if_none_match is not None and rule.if_none_match != has_inm:
                    continue
                rule.seen += 1
                if rule.nth is None or rule.seen in rule.nth:
                    return rule
            return None

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        method, path = handler.command, handler.path
        body = _read_body(handler)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
        has_inm = any(k.lower() == "if-none-match" for k in headers)
        rule = self._match(method, path, has_inm)
        action = "forward" if rule is None else str(rule.action)
        with self._lock:
            self.log.append((method, path, has_inm, action))
        if rule is not None and isinstance(rule.action, int):
            code = _ERROR_CODES.get(rule.action, "InternalError")
            _answer(handler, rule.action, {"Content-Type": "application/xml"}, _error_body(code, rule.message))
            return
        if rule is not None and rule.action == "strip_inm":
            headers = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
        status, reply_headers, reply = self._forward(method, path, headers, body)
        if rule is not None and rule.action == "drop_reply":
            handler.close_connection = True  # it landed; the client never hears so
            return
        _answer(handler, status, reply_headers, reply, head=method == "HEAD")

    def _forward(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            conn.request(method, path, body=body if body or method in ("PUT", "POST") else None, headers=headers)
            response = conn.getresponse()
            reply = response.read()
            reply_headers = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP}
            return response.status, reply_headers, reply
        finally:
            conn.close()


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


def _answer(handler: BaseHTTPRequestHandler, status: int, headers: dict, body: bytes, head: bool = False) -> None:
    handler.send_response(status)
    for k, v in headers.items():
        if k.lower() != "content-length":
            handler.send_header(k, v)
    upstream_length = next((v for k, v in headers.items() if k.lower() == "content-length"), "0")
    handler.send_header("Content-Length", upstream_length if head else str(len(body)))
    handler.end_headers()
    if not head:
        handler.wfile.write(body)


def _error_body(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        "<RequestId>proxy</RequestId></Error>"
    ).encode()
