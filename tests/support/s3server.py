"""A real S3 server over HTTP for tests: moto's server mode, plus a proxy that injects faults.

Use it from a test module with `pytest_plugins = ["tests.support.s3server"]`, or import the fixtures.

- `moto_server_url` (session): moto's ThreadedMotoServer on 127.0.0.1, a real HTTP endpoint that
  subprocesses (`python handler.py`, the runpod API server) reach as well.
- `s3_bucket_env` (function): the `BUCKET_*` environment for a fresh, empty bucket on that server.
  Pass it to `WorkerSettings.from_environ(...)` or merge it into a subprocess environment. Host
  `AWS_*`/`BUCKET_*` variables are removed from `os.environ` for the test's duration.
- `s3_client` (function): a plain boto3 client on the same server and bucket, for assertions.
- `s3_fault_proxy` (function): an HTTP proxy in front of the moto server that records every request
  (method, path, headers) and can answer chosen requests with an error instead of forwarding them:
  moto cannot produce transient 5xx responses on demand.
- `s3_auth_server` (session, started on first use): a second moto server, in a subprocess, that
  checks signatures and IAM policies, for wrong-credential and access-denied tests.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import boto3
import pytest
from botocore.client import BaseClient
from botocore.config import Config
from moto.server import ThreadedMotoServer

TEST_REGION = "us-east-1"
TEST_PREFIX = "fluxbooth-test"
SERVER_START_TIMEOUT_SECONDS = 30.0
HOP_BY_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)
# The proxy already answered "100 Continue" to the client; the upstream gets the whole body at once.
NOT_FORWARDED_HEADERS = HOP_BY_HOP_HEADERS | {"content-length", "expect"}


# --- plain S3 helpers -------------------------------------------------------------------------


def make_s3_client(
    endpoint_url: str, access_key_id: str, secret_access_key: str, *, config: Config | None = None
) -> BaseClient:
    """A boto3 S3 client that ignores host AWS profiles and talks path-style to `endpoint_url`."""
    session = boto3.session.Session(
        aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key, region_name=TEST_REGION
    )
    base = Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "total_max_attempts": 2})
    return session.client("s3", endpoint_url=endpoint_url, config=base.merge(config) if config else base)


def client_for_env(env: Mapping[str, str], *, config: Config | None = None) -> BaseClient:
    return make_s3_client(
        env["BUCKET_ENDPOINT_URL"], env["BUCKET_ACCESS_KEY_ID"], env["BUCKET_SECRET_ACCESS_KEY"], config=config
    )


def empty_and_delete_bucket(client: BaseClient, bucket: str) -> None:
    """Free the server's memory after a test; a bucket a test already removed is fine."""
    try:
        for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=item["Key"])
        client.delete_bucket(Bucket=bucket)
    except client.exceptions.NoSuchBucket:
        pass


def free_tcp_port() -> int:
    """A port nothing listens on right now. Racy: another process may take it before it is used. A server
    started for a test gets `listening_socket()` instead; an 'endpoint down' test, `refusing_port()`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def listening_socket() -> socket.socket:
    """A TCP socket on 127.0.0.1, bound to a free port and listening before anything is told its number: a
    subprocess server inherits it (pass_fds), so no other process can take the port in between, and clients
    that connect before the server runs wait in its backlog."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    return listener


@contextmanager
def refusing_port() -> Iterator[int]:
    """A port that refuses connections for as long as the block runs: bound (so no other process can listen on
    it) but not listening, so a connection attempt is refused at once (an 'endpoint down' test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield int(held.getsockname()[1])


def _unique_bucket_name() -> str:
    return f"fluxbooth-test-{uuid.uuid4().hex[:16]}"


# --- fixtures: moto server and a fresh bucket -------------------------------------------------


@pytest.fixture(scope="session")
def moto_server_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def isolated_aws_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep the host's AWS configuration out of the test and of any subprocess it starts."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "BUCKET_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3_bucket_env(moto_server_url: str, isolated_aws_environment: None) -> Iterator[dict[str, str]]:
    """`BUCKET_*` variables for a fresh bucket. Credentials are unique per test, usable as leak canaries."""
    token = uuid.uuid4().hex
    env = {
        "BUCKET_ENDPOINT_URL": moto_server_url,
        "BUCKET_ACCESS_KEY_ID": f"FBTESTKEY{token[:11].upper()}",
        "BUCKET_SECRET_ACCESS_KEY": f"fbtest-secret-{token}",
        "BUCKET_NAME": _unique_bucket_name(),
        "BUCKET_REGION": TEST_REGION,
        "BUCKET_PREFIX": TEST_PREFIX,
    }
    admin = client_for_env(env)
    admin.create_bucket(Bucket=env["BUCKET_NAME"])
    yield env
    empty_and_delete_bucket(admin, env["BUCKET_NAME"])


@pytest.fixture
def s3_client(s3_bucket_env: dict[str, str]) -> BaseClient:
    return client_for_env(s3_bucket_env)


# --- a recording, fault-injecting proxy -------------------------------------------------------


@dataclass(frozen=True)
class RecordedRequest:
    """One request as it arrived on the wire."""

    method: str
    target: str  # path and query, as sent
    headers: dict[str, str]  # names lower-cased

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.target).query, keep_blank_values=True)

    @property
    def operation(self) -> str:
        """The S3 operation, for the path-style requests boto3 sends to a custom endpoint."""
        query = self.query
        path_segments = [segment for segment in urlsplit(self.target).path.split("/") if segment]
        on_object = len(path_segments) > 1
        if self.method == "POST" and "uploads" in query:
            return "CreateMultipartUpload"
        if self.method == "PUT" and "partNumber" in query:
            return "UploadPart"
        if self.method == "POST" and "uploadId" in query:
            return "CompleteMultipartUpload"
        if self.method == "DELETE" and "uploadId" in query:
            return "AbortMultipartUpload"
        if self.method == "GET" and "uploads" in query:
            return "ListMultipartUploads"
        if self.method == "PUT":
            return "PutObject" if on_object else "CreateBucket"
        if self.method == "HEAD":
            return "HeadObject" if on_object else "HeadBucket"
        if self.method == "GET":
            return "GetObject" if on_object else "ListObjects"
        if self.method == "DELETE":
            return "DeleteObject" if on_object else "DeleteBucket"
        return f"{self.method} {self.target}"


@dataclass(frozen=True)
class InjectedFault:
    status: int = 503
    code: str = "ServiceUnavailable"
    # Close the connection without answering, as a crashed endpoint or a broken network path does.
    drop_connection: bool = False


FaultRule = Callable[[RecordedRequest], InjectedFault | None]


@dataclass
class S3FaultProxy:
    """Forwards to `upstream_url` and records requests; `rule` may answer a request with an error instead."""

    upstream_url: str
    requests: list[RecordedRequest] = field(default_factory=list)
    faults_answered: list[RecordedRequest] = field(default_factory=list)
    rule: FaultRule | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the proxy first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> S3FaultProxy:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class_for(self))
        self._server.daemon_threads = True
        # A short poll interval keeps stop() from adding half a second to every test.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="s3-fault-proxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def fail_first(
        self,
        count: int,
        fault: InjectedFault | None = None,
        matching: Callable[[RecordedRequest], bool] = lambda request: True,
    ) -> None:
        """Answer the first `count` matching requests with `fault` (503 by default), then forward them."""
        remaining = [count]
        chosen = fault or InjectedFault()

        def rule(request: RecordedRequest) -> InjectedFault | None:
            if matching(request) and remaining[0] > 0:
                remaining[0] -= 1
                return chosen
            return None

        self.rule = rule

    def fail_always(self, matching: Callable[[RecordedRequest], bool], fault: InjectedFault | None = None) -> None:
        chosen = fault or InjectedFault()
        self.rule = lambda request: chosen if matching(request) else None

    def operations(self) -> list[str]:
        with self._lock:
            return [request.operation for request in self.requests]

    def _record(self, request: RecordedRequest) -> InjectedFault | None:
        with self._lock:
            self.requests.append(request)
            fault = self.rule(request) if self.rule else None
            if fault is not None:
                self.faults_answered.append(request)
            return fault


def _handler_class_for(proxy: S3FaultProxy) -> type[BaseHTTPRequestHandler]:
    upstream = urlsplit(proxy.upstream_url)

    class ProxyHandler(BaseHTTPRequestHandler):
        # HTTP/1.1 keeps botocore's pooled connections alive, as a real endpoint would.
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._handle()

        do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
            pass

        def _handle(self) -> None:
            body = self._read_body()
            recorded = RecordedRequest(
                method=self.command,
                target=self.path,
                headers={name.lower(): value for name, value in self.headers.items()},
            )
            fault = proxy._record(recorded)
            if fault is not None:
                self._answer_fault(fault)
            else:
                self._forward(body)

        def _read_body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _answer_fault(self, fault: InjectedFault) -> None:
            if fault.drop_connection:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{fault.code}</Code><Message>injected by the test proxy</Message>"
                "<RequestId>fault-proxy</RequestId></Error>"
            ).encode()
            self.send_response(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _forward(self, body: bytes) -> None:
            headers = {name: value for name, value in self.headers.items() if name.lower() not in NOT_FORWARDED_HEADERS}
            if body or self.command in {"PUT", "POST"}:
                headers["Content-Length"] = str(len(body))
            connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=120)
            try:
                connection.request(self.command, self.path, body=body, headers=headers)
                response = connection.getresponse()
                payload = response.read()
                self.send_response_only(response.status, response.reason)
                for name, value in response.getheaders():
                    lowered = name.lower()
                    if lowered in HOP_BY_HOP_HEADERS or (lowered == "content-length" and self.command != "HEAD"):
                        continue
                    self.send_header(name, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)
            finally:
                connection.close()

    return ProxyHandler


@pytest.fixture
def s3_fault_proxy(moto_server_url: str) -> Iterator[S3FaultProxy]:
    """A started proxy in front of the moto server; point BUCKET_ENDPOINT_URL at `proxy.url`."""
    proxy = S3FaultProxy(upstream_url=moto_server_url).start()
    yield proxy
    proxy.stop()


# --- a moto server that checks credentials ----------------------------------------------------


@dataclass(frozen=True)
class AuthenticatingS3Server:
    """A moto server with IAM checks on, a bucket, one key allowed s3:* and one key allowed nothing."""

    url: str
    bucket: str
    allowed_key: tuple[str, str]
    powerless_key: tuple[str, str]

    def env(self, access_key_id: str, secret_access_key: str) -> dict[str, str]:
        return {
            "BUCKET_ENDPOINT_URL": self.url,
            "BUCKET_ACCESS_KEY_ID": access_key_id,
            "BUCKET_SECRET_ACCESS_KEY": secret_access_key,
            "BUCKET_NAME": self.bucket,
            "BUCKET_REGION": TEST_REGION,
            "BUCKET_PREFIX": TEST_PREFIX,
        }


def _wait_until_serving(url: str, process: subprocess.Popen[bytes]) -> None:
    """One request: it waits in the inherited socket's backlog until the server accepts it (no polling)."""
    try:
        with urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=SERVER_START_TIMEOUT_SECONDS):
            return
    except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
        status = process.poll()
        state = "is still starting" if status is None else f"exited with status {status}"
        raise RuntimeError(
            f"moto server at {url} did not answer within {SERVER_START_TIMEOUT_SECONDS} s and {state}: {error}"
        ) from error


def serve_moto_on(fd: int) -> None:
    """moto's server (as `python -m moto.server` runs it) on an inherited listening socket."""
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    application = DomainDispatcherApplication(create_backend_app)
    port = int(os.environ["MOTO_PORT"])
    make_server(
        "127.0.0.1", port, application, threaded=True, request_handler=MotoRequestHandler, fd=fd
    ).serve_forever()


def _create_iam_key(url: str, user_name: str, policy: dict[str, object] | None) -> tuple[str, str]:
    session = boto3.session.Session(aws_access_key_id="setup", aws_secret_access_key="setup", region_name=TEST_REGION)
    iam = session.client("iam", endpoint_url=url)
    iam.create_user(UserName=user_name)
    if policy is not None:
        iam.put_user_policy(UserName=user_name, PolicyName="fluxbooth-test", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user_name)["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


@pytest.fixture(scope="session")
def s3_auth_server() -> Iterator[AuthenticatingS3Server]:
    # A separate process: moto's auth switch is process-wide and would also lock the shared server.
    with listening_socket() as listener:
        port = int(listener.getsockname()[1])
        environment = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
        process = subprocess.Popen(
            [sys.executable, __file__, "--serve-moto-on-fd", str(listener.fileno())],
            env={**environment, "MOTO_PORT": str(port)},
            pass_fds=(listener.fileno(),),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(url, process)
        allowed_key = _create_iam_key(
            url,
            "fluxbooth-uploader",
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]},
        )
        powerless_key = _create_iam_key(url, "fluxbooth-powerless", None)
        bucket = _unique_bucket_name()
        make_s3_client(url, "setup", "setup").create_bucket(Bucket=bucket)
        switch_on = urllib.request.Request(
            f"{url}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(switch_on, timeout=10):
            pass
        yield AuthenticatingS3Server(url=url, bucket=bucket, allowed_key=allowed_key, powerless_key=powerless_key)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


if __name__ == "__main__" and sys.argv[1:2] == ["--serve-moto-on-fd"]:
    serve_moto_on(int(sys.argv[2]))
