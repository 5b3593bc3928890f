"""A tiny real HTTP server on 127.0.0.1 for dataset_url tests (stdlib http.server in a thread).

    def test_x(http_server):  # the fixture: tests/conftest.py lists this module in its pytest_plugins
        http_server.add("/data.zip", body=zip_bytes)
        url = http_server.url("/data.zip")

Routes can answer with any status, redirect, stall before answering, trickle the body, omit or lie
about Content-Length: the faults a real slow or broken server produces. A route with `ranges=True` serves
`Range: bytes=a-b` and `bytes=-n` as 206 Partial Content, as S3 and most file servers do; without it the
Range header is ignored (200, the whole body), as some servers do. `bytes_sent` counts the body bytes written.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

import pytest

from tests.support.quiet_http import QuietHTTPServer


@dataclass(frozen=True)
class Route:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    redirect_to: str | None = None
    delay_seconds: float = 0.0  # before the status line
    trickle_seconds: float = 0.0  # pause between body bytes
    content_length: int | None | bool = True  # True: the real length; None: omit; int: claim this
    ranges: bool = False  # serve Range requests (206) instead of ignoring them


def _partial(route: Route, header: str) -> Route:
    """The route's answer to one `bytes=a-b` or `bytes=-n` range: 206 with those bytes and their Content-Range."""
    first_text, _, last_text = header.removeprefix("bytes=").partition("-")
    size = len(route.body)
    first = int(first_text) if first_text else max(size - int(last_text), 0)
    last = min(int(last_text), size - 1) if first_text and last_text else size - 1
    return replace(
        route,
        status=206,
        body=route.body[first : last + 1],
        headers={**route.headers, "Content-Range": f"bytes {first}-{last}/{size}"},
    )


class LocalHTTPServer:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.requests: list[str] = []
        self.range_headers: list[str | None] = []  # each request's Range header, in order
        self.bytes_sent = 0
        self.stopping = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                server.requests.append(self.path)
                server.range_headers.append(self.headers.get("Range"))
                route = server.routes.get(urlsplit(self.path).path, Route(status=404, body=b"not found"))
                if route.ranges and self.headers.get("Range"):
                    route = _partial(route, self.headers["Range"])
                if route.delay_seconds and server.stopping.wait(route.delay_seconds):
                    return
                self.send_response(route.status)
                if route.redirect_to is not None:
                    self.send_header("Location", route.redirect_to)
                length = route.content_length
                if length is True:
                    self.send_header("Content-Length", str(len(route.body)))
                elif isinstance(length, int) and not isinstance(length, bool):
                    self.send_header("Content-Length", str(length))
                for name, value in route.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                try:
                    if route.trickle_seconds:
                        for index in range(len(route.body)):
                            self.wfile.write(route.body[index : index + 1])
                            self.wfile.flush()
                            if server.stopping.wait(route.trickle_seconds):
                                return
                    else:
                        self.wfile.write(route.body)
                    server.bytes_sent += len(route.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up, which is what several tests want

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self.server = QuietHTTPServer(Handler)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def url(self, path: str) -> str:
        return f"{self.server.base_url}{path}"

    def add(self, path: str, **route: object) -> str:
        """Serve `path` as described by Route's fields; returns its URL."""
        self.routes[path] = Route(**route)  # type: ignore[arg-type]
        return self.url(path)

    def start(self) -> LocalHTTPServer:
        self.server.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.server.stop()

    def __enter__(self) -> LocalHTTPServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@pytest.fixture
def http_server() -> Iterator[LocalHTTPServer]:
    with LocalHTTPServer() as server:
        yield server
