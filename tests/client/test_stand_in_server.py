"""The stand-in servers the client tests talk to stay quiet when a client hangs up: the standard library would
print the handler's broken pipe from the server's thread into whichever test then captures stderr, and that test
fails on an error that is not its own (it did, once, in CI: a client test's exact stderr held another test's
traceback)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from tests.support.quiet_http import QuietHTTPServer


def test_a_client_hanging_up_before_its_reply_is_counted_and_prints_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    client_gone = threading.Event()
    replied = threading.Event()

    class SlowReply(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            client_gone.wait(timeout=5)
            try:
                for _ in range(64):  # writes until the reset from the closed socket arrives
                    self.wfile.write(b"x" * 65536)
                    time.sleep(0.01)
            finally:
                replied.set()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
            return

    server = QuietHTTPServer(SlowReply).start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1])) as client:
            client.sendall(b"POST /run HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n")
            # SO_LINGER 0: close with a reset, as a client killed mid-request does.
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client_gone.set()
        assert replied.wait(timeout=10)
        deadline = time.monotonic() + 5
        while server.client_hangups == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        server.stop()
    assert server.client_hangups == 1
    assert capsys.readouterr().err == ""
