"""Capture what a caller sees from the runpod SDK's local API server, for the README's RunPod section.

    .venv/bin/python bench/runpod_api_capture.py > capture.txt

Starts a real S3 server (moto), a webhook receiver and `python handler.py --rp_serve_api`, then sends:
an invalid job to /runsync; the demo job (test_input.json) to /run with a webhook, then /status for it
(the SDK's development server runs a /run job when its /status is asked for). Prints each request and
the exact reply, and the webhook's body. The bucket is named the RunPod way, inside BUCKET_ENDPOINT_URL.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
from moto.server import ThreadedMotoServer

REPO_ROOT = Path(__file__).resolve().parent.parent
BUCKET = "fluxbooth-demo"
ACCESS_KEY_ID = "FBDEMOKEYID0000000001"
SECRET_ACCESS_KEY = "fbdemo-secret-not-a-real-one"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def post(url: str, body: dict[str, Any] | None = None, timeout: float = 1800) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, json.loads(response.read())


def start_webhook_receiver(received: list[Any]) -> ThreadingHTTPServer:
    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            received.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("the API server exited early")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise SystemExit(f"nothing listened on port {port}")


def show(label: str, status: int, reply: Any) -> None:
    print(f"### {label} -> HTTP {status}")
    print(json.dumps(reply, indent=2))
    print(flush=True)


def main() -> None:
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    moto_url = "http://{}:{}".format(*moto.get_host_and_port())
    boto3.client(
        "s3",
        endpoint_url=moto_url,
        aws_access_key_id=ACCESS_KEY_ID,
        aws_secret_access_key=SECRET_ACCESS_KEY,
        region_name="us-east-1",
    ).create_bucket(Bucket=BUCKET)
    received: list[Any] = []
    webhook = start_webhook_receiver(received)
    webhook_url = f"http://127.0.0.1:{webhook.server_address[1]}/fluxbooth-done"
    work = Path(tempfile.mkdtemp(prefix="fluxbooth-capture-"))
    port = free_port()
    env = {
        **os.environ,
        "BUCKET_ENDPOINT_URL": f"{moto_url}/{BUCKET}",
        "BUCKET_ACCESS_KEY_ID": ACCESS_KEY_ID,
        "BUCKET_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
        "FLUXBOOTH_WORK_DIR": str(work / "work"),
        "FLUXBOOTH_OUTPUT_DIR": str(work / "outputs"),
        "RUNPOD_LOG_LEVEL": "INFO",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]),
    }
    log = (work / "api.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "handler.py", "--rp_serve_api", "--rp_api_host", "127.0.0.1", "--rp_api_port", str(port)],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_port(port, server)
        invalid = {"input": {"model_name": "sks-dog", "instance_prompt": "a photo of sks dog", "steps": "many"}}
        print("### request: POST /runsync", json.dumps(invalid))
        show("POST /runsync (invalid job)", *post(f"{base}/runsync", invalid))
        demo = json.loads((REPO_ROOT / "test_input.json").read_text())["input"]
        print(f'### request: POST /run with the demo job (test_input.json) and "webhook": "{webhook_url}"')
        status, queued = post(f"{base}/run", {"input": demo, "webhook": webhook_url})
        show("POST /run", status, queued)
        started = time.monotonic()
        status, reply = post(f"{base}/status/{queued['id']}")
        show(f"POST /status/{queued['id']} (answered after {time.monotonic() - started:.0f} s)", status, reply)
        deadline = time.monotonic() + 30
        while not received and time.monotonic() < deadline:
            time.sleep(0.2)
        print("### webhook body received")
        print(json.dumps(received[0] if received else None, indent=2))
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()
        webhook.shutdown()
        moto.stop()


if __name__ == "__main__":
    main()
