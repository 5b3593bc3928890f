"""A Hugging Face Hub stand-in over real HTTP, for the real `huggingface_hub` client (`HF_ENDPOINT`).

It speaks the part of the hub's protocol that `snapshot_download` and `hf_hub_download` use (read in
huggingface_hub's hf_api.py, _snapshot_download.py and file_download.py):
- `GET /api/models/{repo}[/revision/{revision}]`: model info (`sha`, `gated`, `siblings`);
- `GET /api/models/{repo}/tree/{revision}[/{path}]?recursive=...`: files with `size`, `oid` and `lfs`;
- `HEAD`/`GET /{repo}/resolve/{revision}/{path}`: `X-Repo-Commit` and `ETag`. LFS files (weights) answer
  `302` to a CDN on another origin with `X-Linked-Etag` and `X-Linked-Size`, as the real hub does, so the
  client reads the metadata from the redirect and downloads from the CDN without the token;
- errors carry `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`, `GatedRepo`): a gated
  repo answers 401 without a token and 403 with a token that was not granted access.

Every request is logged (server, method, path, whether it carried a token) for assertions.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from tests.support.quiet_http import QuietHTTPServer

LFS_SUFFIXES = (".safetensors", ".model", ".bin")
LFS_POINTER_SIZE = 134


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class HubFile:
    """One file of a commit. `claimed_size` without `data` is a file the hub lists but never serves
    (a checkpoint too big for the test machine's disk)."""

    path: str
    data: bytes = b""
    claimed_size: int | None = None

    @property
    def size(self) -> int:
        return self.claimed_size if self.claimed_size is not None else len(self.data)

    @property
    def is_lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @property
    def sha256(self) -> str:
        if self.claimed_size is not None:
            return hashlib.sha256(f"{self.path} {self.claimed_size}".encode()).hexdigest()
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        return git_blob_id(self.data if not self.is_lfs else f"lfs {self.sha256} {self.size}".encode())


@dataclass
class HubRepo:
    repo_id: str
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    granted_tokens: frozenset[str] = frozenset()

    def add_commit(self, files: list[HubFile], *, refs: tuple[str, ...] = ("main",)) -> str:
        listing = json.dumps(sorted((hub_file.path, hub_file.blob_id) for hub_file in files)).encode()
        sha = hashlib.sha1(self.repo_id.encode() + listing).hexdigest()
        self.commits[sha] = {hub_file.path: hub_file for hub_file in files}
        for ref in refs:
            self.refs[ref] = sha
        return sha

    def commit_for(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


def folder_files(folder: Path) -> list[HubFile]:
    """Every file under `folder`, by its path relative to it."""
    return [
        HubFile(path.relative_to(folder).as_posix(), path.read_bytes())
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    ]


@dataclass(frozen=True)
class LoggedRequest:
    server: str
    method: str
    path: str
    with_token: bool


class _Handler(BaseHTTPRequestHandler):
    server: _HubHTTPServer

    def log_message(self, format: str, *args: object) -> None:  # quiet: the log is kept in `requests`
        return

    def do_HEAD(self) -> None:
        self._dispatch(send_body=False)

    def do_GET(self) -> None:
        self._dispatch(send_body=True)

    def _dispatch(self, *, send_body: bool) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        segments = [unquote(segment) for segment in url.path.split("/")[1:]]
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip() or None
        hub.log(LoggedRequest(self.server.name, self.command, "/".join(segments), token is not None))
        if self.server.name == "cdn":
            self._serve_cdn(segments, send_body)
        elif segments[:2] == ["api", "models"]:
            self._serve_api(segments[2:], parse_qs(url.query), send_body)
        elif len(segments) >= 5 and segments[2] == "resolve":
            self._serve_resolve(segments, token, send_body)
        else:
            self._reply(404, b"", {"X-Error-Code": "EntryNotFound"}, send_body)

    def _reply(self, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        if send_body and body:
            self.wfile.write(body)

    def _json(self, payload: object, send_body: bool) -> None:
        self._reply(200, json.dumps(payload).encode(), {"Content-Type": "application/json"}, send_body)

    def _repo_or_error(self, org: str, name: str, send_body: bool) -> HubRepo | None:
        repo = self.server.hub.repos.get(f"{org}/{name}")
        if repo is None:
            self._reply(
                401,
                b'{"error":"Repository not found"}',
                {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
                send_body,
            )
        return repo

    def _commit_or_error(self, repo: HubRepo, revision: str, send_body: bool) -> str | None:
        sha = repo.commit_for(revision)
        if sha is None:
            message = f"Invalid rev id: {revision}"
            self._reply(
                404,
                json.dumps({"error": message}).encode(),
                {"X-Error-Code": "RevisionNotFound", "X-Error-Message": message},
                send_body,
            )
        return sha

    def _serve_api(self, segments: list[str], query: dict[str, list[str]], send_body: bool) -> None:
        if len(segments) < 2 or (repo := self._repo_or_error(segments[0], segments[1], send_body)) is None:
            return
        rest = segments[2:]
        revision = rest[1] if len(rest) >= 2 else "main"
        if (sha := self._commit_or_error(repo, revision, send_body)) is None:
            return
        files = repo.commits[sha]
        if not rest or rest[0] == "revision":
            self._json(
                {
                    "_id": sha[:24],
                    "id": repo.repo_id,
                    "modelId": repo.repo_id,
                    "sha": sha,
                    "private": False,
                    "gated": "manual" if repo.gated else False,
                    "disabled": False,
                    "library_name": "diffusers",
                    "tags": ["diffusers"],
                    "siblings": [{"rfilename": path} for path in sorted(files)],
                },
                send_body,
            )
            return
        prefix = "/".join(rest[2:])
        recursive = (query.get("recursive") or ["false"])[0].lower() in {"true", "1"}
        self._json(_tree_entries(files, prefix, recursive), send_body)

    def _serve_resolve(self, segments: list[str], token: str | None, send_body: bool) -> None:
        if (repo := self._repo_or_error(segments[0], segments[1], send_body)) is None:
            return
        if repo.gated and token not in repo.granted_tokens:
            message = (
                f"Access to model {repo.repo_id} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in."
            )
            self._reply(
                401 if token is None else 403,
                message.encode(),
                {"X-Error-Code": "GatedRepo", "X-Error-Message": message},
                send_body,
            )
            return
        if (sha := self._commit_or_error(repo, segments[3], send_body)) is None:
            return
        hub_file = repo.commits[sha].get("/".join(segments[4:]))
        if hub_file is None:
            self._reply(404, b"Entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, send_body)
            return
        headers = {"X-Repo-Commit": sha, "ETag": f'"{hub_file.blob_id}"', "Accept-Ranges": "bytes"}
        if hub_file.is_lfs:
            self.server.hub.publish_on_cdn(hub_file)
            headers.update(
                {
                    "Location": f"{self.server.hub.cdn_url}/blobs/{hub_file.sha256}",
                    "X-Linked-Etag": f'"{hub_file.sha256}"',
                    "X-Linked-Size": str(hub_file.size),
                }
            )
            self._reply(302, b"", headers, send_body)
            return
        self._reply(200, hub_file.data, headers, send_body)

    def _serve_cdn(self, segments: list[str], send_body: bool) -> None:
        hub_file = self.server.hub.cdn.get(segments[-1])
        if hub_file is None or hub_file.claimed_size is not None:
            self._reply(404, b"", {}, send_body)
            return
        start = 0
        ranged = (self.headers.get("Range") or "").removeprefix("bytes=")
        if ranged.endswith("-") and ranged[:-1].isdigit():
            start = int(ranged[:-1])
        body = hub_file.data[start:]
        time.sleep(self.server.hub.cdn_delay_seconds)  # a slow CDN, so a download can be caught in flight
        headers = {"ETag": f'"{hub_file.sha256}"'}
        if start:
            headers["Content-Range"] = f"bytes {start}-{hub_file.size - 1}/{hub_file.size}"
        self._reply(206 if start else 200, body, headers, send_body)


def _tree_entries(files: dict[str, HubFile], prefix: str, recursive: bool) -> list[dict[str, object]]:
    entries: dict[str, dict[str, object]] = {}
    base = f"{prefix}/" if prefix else ""
    for path, hub_file in sorted(files.items()):
        if not path.startswith(base):
            continue
        parts = path[len(base) :].split("/")
        for depth in range(1, len(parts)):
            folder = base + "/".join(parts[:depth])
            if recursive or depth == 1:
                entries.setdefault(
                    folder, {"type": "directory", "oid": git_blob_id(folder.encode()), "size": 0, "path": folder}
                )
            if not recursive:
                break
        if recursive or len(parts) == 1:
            entry: dict[str, object] = {"type": "file", "oid": hub_file.blob_id, "size": hub_file.size, "path": path}
            if hub_file.is_lfs:
                entry["lfs"] = {"oid": hub_file.sha256, "size": hub_file.size, "pointerSize": LFS_POINTER_SIZE}
            entries[path] = entry
    return list(entries.values())


class _HubHTTPServer(QuietHTTPServer):
    def __init__(self, name: str, hub: HubServer) -> None:
        super().__init__(_Handler)
        self.name = name
        self.hub = hub


class HubServer:
    """The hub and its CDN, two HTTP servers on two ports (two origins), each in its own thread."""

    def __init__(self, cdn_delay_seconds: float = 0.0) -> None:
        self.cdn_delay_seconds = cdn_delay_seconds
        self.repos: dict[str, HubRepo] = {}
        self.cdn: dict[str, HubFile] = {}
        self.requests: list[LoggedRequest] = []
        self._lock = threading.Lock()
        self._servers = [_HubHTTPServer("hub", self), _HubHTTPServer("cdn", self)]

    @property
    def endpoint(self) -> str:
        return self._servers[0].base_url

    @property
    def cdn_url(self) -> str:
        return self._servers[1].base_url

    def add_repo(self, repo: HubRepo) -> HubRepo:
        self.repos[repo.repo_id] = repo
        return repo

    def publish_on_cdn(self, hub_file: HubFile) -> None:
        with self._lock:
            self.cdn[hub_file.sha256] = hub_file

    def log(self, request: LoggedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def downloads(self) -> list[str]:
        """The file paths (hub) and blobs (CDN) whose bytes were sent."""
        return [
            request.path
            for request in self.requests
            if request.method == "GET" and (request.server == "cdn" or "/resolve/" in f"/{request.path}/")
        ]

    def start(self) -> None:
        for server in self._servers:
            server.start()

    def stop(self) -> None:
        for server in self._servers:
            server.stop()


def running_hub() -> Iterator[HubServer]:
    """For a pytest fixture: a started hub, stopped afterwards."""
    hub = HubServer()
    hub.start()
    try:
        yield hub
    finally:
        hub.stop()
