"""The one HTTP server class the stand-ins run (RunPod's queue and API, the hub, the dataset-URL server, the webhook
receiver): on 127.0.0.1, each request in its own thread, and quiet when a client hangs up before its reply is
written.

A client that gives up (a timeout, a refused URL, a cancelled submit) is what several tests make happen; the
standard library's `handle_error` then prints a traceback to stderr from the server's thread, which lands in
whichever test is capturing stderr at that moment. Those hang-ups are counted here instead; any other error in a
handler still prints, as the standard library does.
"""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CLIENT_HANGUPS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class QuietHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.client_hangups = 0
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], CLIENT_HANGUPS):
            self.client_hangups += 1
            return
        super().handle_error(request, client_address)

    def start(self) -> QuietHTTPServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)
