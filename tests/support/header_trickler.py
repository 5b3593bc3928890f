"""A real TCP server that never finishes its headers (`HeaderTrickler`, the `trickler` fixture), and the dataset
limits the tests fetch from it under: private addresses allowed (it listens on 127.0.0.1), a 5 s idle timeout that
a byte a second never trips.

The fixture is registered in tests/conftest.py's `pytest_plugins`.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from fluxbooth.settings import DatasetLimits

LIMITS = DatasetLimits(allow_private_urls=True, download_timeout_seconds=5)
STATUS_LINE = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100_000


class HeaderTrickler:
    """A real TCP server that answers every request with a status line and a header sent one byte a second:
    each read gets a byte well within any idle timeout, and the headers never end."""

    def __init__(self, seconds_per_byte: float = 1.0) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.stopping = threading.Event()
        self.seconds_per_byte = seconds_per_byte
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/data.zip"

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(connection,), daemon=True).start()

    def _trickle(self, connection: socket.socket) -> None:
        with connection:
            try:
                connection.recv(65536)
                for index in range(len(STATUS_LINE)):
                    connection.sendall(STATUS_LINE[index : index + 1])
                    if self.stopping.wait(self.seconds_per_byte):
                        return
            except OSError:
                return  # the worker hung up, which is what the tests want

    def close(self) -> None:
        self.stopping.set()
        self.listener.close()


@pytest.fixture
def trickler() -> Iterator[HeaderTrickler]:
    server = HeaderTrickler()
    yield server
    server.close()
