"""RunPod's queue API as a client calls it: POST /run, /status/JOB_ID, POST /cancel/JOB_ID, either on
https://api.runpod.ai/v2/ENDPOINT_ID (with the API key) or on a local `python handler.py --rp_serve_api`.

The runpod SDK's local API server runs a /run job inside the first /status request, which answers only when the
job is over (runpod/serverless/modules/rp_fastapi.py, `_sim_status`). A /status that timed out and was sent again
would run the job a second time. So:
- /status waits as long as the job may run (its read timeout is the job's whole time budget, or none);
- a call is sent again only when it never reached the server (the connection was refused or could not be
  made) or when RunPod answered 429/502/503/504, which it does before touching the job;
- /run is never sent twice once it may have arrived: a second /run would be a second paid job.
RunPod's hosted API answers /status at once, and asking again changes nothing there: with
`status_answers_at_once` (the client sets it for `--endpoint`) /status has a short read timeout and is asked
again after one. Both servers answer /status by POST.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests
from urllib3.util import parse_url

from fluxbooth.client.errors import ClientError, ExitCode

RUNPOD_API_BASE = "https://api.runpod.ai/v2"
CALL_TIMEOUT_SECONDS = 60.0
CONNECT_TIMEOUT_SECONDS = 15.0
RETRIED_STATUSES = frozenset({429, 502, 503, 504})
RETRY_DELAYS_SECONDS = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
# A server on this machine that refuses the connection is not running: a few seconds cover one still starting,
# and the caller hears about it within 15 s rather than after RunPod's minute of retries.
LOOPBACK_RETRY_DELAYS_SECONDS = (0.5, 1.0, 2.0)


def endpoint_url(endpoint_id: str, api_base: str = RUNPOD_API_BASE) -> str:
    return f"{api_base.rstrip('/')}/{endpoint_id}"


def _connection(url: str) -> tuple[str, str] | None:
    """The scheme and host requests connects to for `url` (the host in lower case, an IPv6 address without its
    brackets), read the way requests reads it (its own URL preparation, then urllib3's parser), or None where it
    cannot read one."""
    prepared = requests.PreparedRequest()
    try:
        prepared.prepare_url(url, None)
        parts = parse_url(prepared.url or "")
    except (requests.RequestException, ValueError):  # urllib3's LocationParseError is a ValueError
        return None
    if not parts.scheme or not parts.host:
        return None
    return parts.scheme.lower(), parts.host.strip("[]").lower()


def _split_host(url: str) -> str | None:
    """The host urllib.parse reads in `url`, written as urllib3 writes it, for comparing the two."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return None
    if host and not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            return host
    # RFC 6874 writes an IPv6 zone's "%" as "%25" in a URL; urllib3 reads it back as "%".
    return host.replace("%25", "%") if host else None


def host_problem(url: str) -> str | None:
    """Why `url` has no one host every part of the client reads in it, or None. The client decides where a key may
    go and whether file:// artifacts are read by the host requests connects to; a URL that urllib.parse reads as
    another host (`http://H\\@127.0.0.1/`: urllib.parse reads 127.0.0.1, requests connects to H) is refused."""
    connection, split = _connection(url), _split_host(url)
    if connection is None:
        return "the HTTP library (requests) cannot read a host in it"
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        netloc = ""
    if "\\" in netloc:
        return (
            f"its host part holds a backslash, which URL parsers read differently (requests would connect to "
            f"{connection[1]!r}, urllib.parse reads {split!r}); write the URL without it"
        )
    if split != connection[1]:
        return (
            f"requests would connect to {connection[1]!r} but urllib.parse reads the host as {split!r}; write the "
            "URL so that both read one host"
        )
    return None


def is_loopback(url: str) -> bool:
    """True when the host requests connects to for `url` is this machine: the name `localhost`, or a literal
    address in 127.0.0.0/8 or ::1. No other name counts (`*.localhost` goes to the resolver like any other), nor
    does a URL whose host the parsers do not agree on (host_problem)."""
    connection = _connection(url)
    if connection is None or host_problem(url) is not None:
        return False
    host = connection[1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def retry_delays(url: str) -> tuple[float, ...]:
    """The pauses between attempts at a call that never arrived or met a busy answer: short for this machine."""
    return LOOPBACK_RETRY_DELAYS_SECONDS if is_loopback(url) else RETRY_DELAYS_SECONDS


def key_may_go_to(url: str) -> bool:
    """An API key travels only encrypted (https), or in plain http to this machine, where nothing can listen in."""
    connection = _connection(url)
    if connection is None or host_problem(url) is not None:
        return False
    return connection[0] == "https" or (connection[0] == "http" and is_loopback(url))


def _never_arrived(error: requests.RequestException) -> bool:
    """True for failures before the request was sent: refused or failed connections, never read timeouts."""
    if isinstance(error, requests.ConnectTimeout):
        return True
    if isinstance(error, requests.ConnectionError) and not isinstance(error, requests.ReadTimeout):
        text = str(error)
        return any(
            mark in text
            for mark in (
                "NewConnectionError",
                "Connection refused",
                "Name or service not known",
                "Failed to resolve",
                "nodename nor servname",
            )
        )
    return False


@dataclass
class JobApi:
    """One endpoint's /run, /status and /cancel."""

    base_url: str
    api_key: str | None = None
    # Where the key came from, for the message when the server refuses it.
    key_source: str = "RUNPOD_API_KEY"
    status_timeout_seconds: float | None = None
    status_answers_at_once: bool = False
    call_timeout_seconds: float = CALL_TIMEOUT_SECONDS
    sleep: Callable[[float], None] = time.sleep
    session: requests.Session = field(default_factory=requests.Session)

    def run(self, body: bytes) -> dict[str, Any]:
        """Submit a job; its reply holds the job id."""
        reply = self._call("run", body, read_timeout=self.call_timeout_seconds)
        if not isinstance(reply.get("id"), str):
            raise ClientError(f"{self.base_url}/run answered without a job id: {reply}", ExitCode.API)
        return reply

    def status(self, job_id: str) -> dict[str, Any]:
        if self.status_answers_at_once:
            return self._call(
                f"status/{job_id}", b"", read_timeout=self.call_timeout_seconds, resend_after_timeout=True
            )
        return self._call(f"status/{job_id}", b"", read_timeout=self.status_timeout_seconds)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call(f"cancel/{job_id}", b"", read_timeout=self.call_timeout_seconds, resend_after_timeout=True)

    def __post_init__(self) -> None:
        problem = host_problem(self.base_url)
        if problem is not None:
            raise ClientError(f"{self.base_url}: {problem}", ExitCode.USAGE)
        if self.api_key and not key_may_go_to(self.base_url):
            raise ClientError(
                f"{self.base_url}: an API key is sent only over https, or over http to this machine (localhost); "
                "use an https:// URL",
                ExitCode.USAGE,
            )

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _call(
        self, operation: str, body: bytes, *, read_timeout: float | None, resend_after_timeout: bool = False
    ) -> dict[str, Any]:
        url = f"{self.base_url.rstrip('/')}/{operation}"
        for delay in (*retry_delays(self.base_url), None):
            try:
                response = self.session.post(
                    url,
                    data=body or b"{}",
                    headers=self._headers(),
                    timeout=(CONNECT_TIMEOUT_SECONDS, read_timeout),
                    allow_redirects=False,  # the key goes where it was given, never where an answer points
                )
            except requests.RequestException as error:
                timed_out = resend_after_timeout and isinstance(error, requests.ReadTimeout)
                if delay is not None and (_never_arrived(error) or timed_out):
                    self.sleep(delay)
                    continue
                raise self._unreachable(url, error, read_timeout) from error
            if response.status_code in RETRIED_STATUSES and delay is not None:
                self.sleep(delay)
                continue
            return self._reply(url, response)
        raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover

    def _unreachable(self, url: str, error: requests.RequestException, read_timeout: float | None) -> ClientError:
        if isinstance(error, requests.ReadTimeout):
            return ClientError(f"{url} gave no answer within {read_timeout or 0:g} s", ExitCode.API)
        return ClientError(f"cannot reach {url}: {type(error).__name__}: {error}", ExitCode.API)

    def _reply(self, url: str, response: requests.Response) -> dict[str, Any]:
        if response.status_code in {401, 403} and not self.api_key:
            raise ClientError(
                f"{url} asks for an API key (HTTP {response.status_code}) and none was sent: with --url the client "
                "sends a key only when --url-api-key-env names the variable holding it",
                ExitCode.API,
            )
        if response.status_code in {401, 403}:
            raise ClientError(
                f"{url} refused the API key (HTTP {response.status_code}): set {self.key_source} to a key with "
                "access to this endpoint",
                ExitCode.API,
            )
        if 300 <= response.status_code < 400:
            raise ClientError(
                f"{url} answered HTTP {response.status_code} (a redirect to {response.headers.get('Location', '?')!r}); "
                "the client does not follow it: give the final URL",
                ExitCode.API,
            )
        if response.status_code == 404:
            raise ClientError(
                f"{url} does not exist (HTTP 404): check the endpoint ID (or --url)",
                ExitCode.API,
            )
        if response.status_code >= 400:
            raise ClientError(f"{url} answered HTTP {response.status_code}: {response.text[:500]}", ExitCode.API)
        try:
            reply = response.json()
        except (ValueError, RecursionError):  # not JSON, or nested past what Python's parser recurses through
            reply = None
        if not isinstance(reply, dict):
            raise ClientError(
                f"{url} answered with something other than a JSON object: {response.text[:300]!r}", ExitCode.API
            )
        return reply
