"""A loopback HTTP server that speaks enough of the Hugging Face Hub API for huggingface_hub.

It serves `/api/models?search=&filter=gguf` (the listing, most downloaded first),
`/api/models/{repo}[/revision/{rev}]` (siblings with LFS size and sha256) and
`/{repo}/resolve/{rev}/{file}` (HEAD and GET with Range, ETag / X-Repo-Commit / X-Linked-*),
logs every request, and can drop or stall a connection mid-file or lie about a sha256 on demand.
GGUF and safetensors files are LFS files (sha256 in the listing, ETag = sha256) unless named in
`in_git`: those are
served as small files kept in git are, with no LFS entry and the git blob sha1 as ETag.
"""

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    """Repos are {repo_id: {filename: bytes}}; `drop_once` names files to cut mid-body once."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    drop_once: set[str] = field(default_factory=set)
    bad_sha: set[str] = field(default_factory=set)
    stall_once: set[str] = field(default_factory=set)  # send half, then hang until `release`
    in_git: set[str] = field(default_factory=set)  # GGUF files kept in git, not LFS
    release: threading.Event = field(default_factory=threading.Event)
    log: list[tuple[str, str, str | None]] = field(default_factory=list)
    downloads: dict[str, int] = field(default_factory=dict)  # listing popularity per repo
    url: str = ""

    def sha(self, repo: str, name: str) -> str:
        if name in self.bad_sha:
            return "0" * 64
        return hashlib.sha256(self.repos[repo][name]).hexdigest()

    def etag(self, name: str, data: bytes) -> str:
        if name in self.in_git:
            return git_blob_sha1(data)
        return hashlib.sha256(data).hexdigest()

    def info(self, repo: str) -> dict:
        siblings = []
        for name, data in self.repos[repo].items():
            s = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
            if name.endswith((".gguf", ".safetensors")) and name not in self.in_git:
                s["lfs"] = {"size": len(data), "sha256": self.sha(repo, name), "pointerSize": 134}
            siblings.append(s)
        return {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a file: sha1 over `blob <size>\\0` and the bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _listing(hub: "FakeHub", query: str) -> list[dict]:
    params = parse_qs(query)
    search = params.get("search", [""])[0].lower()
    tags = params.get("filter", [])
    limit = int(params.get("limit", ["1000"])[0])
    hits = []
    for repo, files in hub.repos.items():
        repo_tags = ["gguf"] if any(n.endswith(".gguf") for n in files) else []
        if search in repo.lower() and all(t in repo_tags for t in tags):
            n = hub.downloads.get(repo, 0)
            hits.append(
                {
                    "id": repo,
                    "modelId": repo,
                    "downloads": n,
                    "likes": n // 10,
                    "lastModified": "2026-11-01T12:00:00.000Z",
                    "tags": repo_tags,
                }
            )
    hits.sort(key=lambda h: -h["downloads"])
    return hits[:limit]


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _not_found(self, kind: str) -> None:
            body = json.dumps({"error": f"{kind} not found"}).encode()
            self._send(404, body, {"X-Error-Code": kind, "Content-Type": "application/json"})

        def do_GET(self) -> None:
            self._serve()

        def do_HEAD(self) -> None:
            self._serve()

        def _serve(self) -> None:
            path = unquote(urlparse(self.path).path)
            hub.log.append((self.command, path, self.headers.get("Range")))
            if path == "/api/models":
                body = json.dumps(_listing(hub, urlparse(self.path).query)).encode()
                return self._send(200, body, {"Content-Type": "application/json"})
            if m := _API.match(path):
                if m["repo"] not in hub.repos:
                    return self._not_found("RepoNotFound")
                body = json.dumps(hub.info(m["repo"])).encode()
                return self._send(200, body, {"Content-Type": "application/json"})
            if m := _RESOLVE.match(path):
                return self._resolve(m["repo"], m["file"])
            self._not_found("RepoNotFound")

        def _resolve(self, repo: str, name: str) -> None:
            if repo not in hub.repos:
                return self._not_found("RepoNotFound")
            data = hub.repos[repo].get(name)
            if data is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Length", "0")
                return self.end_headers()
            etag = hub.etag(name, data)
            headers = {
                "ETag": f'"{etag}"',
                "X-Repo-Commit": COMMIT,
                "X-Linked-Etag": f'"{etag}"',
                "X-Linked-Size": len(data),
                "Accept-Ranges": "bytes",
            }
            start, code = 0, 200
            rng = self.headers.get("Range")
            if rng and self.command == "GET":
                start = int(re.match(r"bytes=(\d+)-", rng)[1])
                code = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            headers["Content-Length"] = len(body)
            cut = name in hub.drop_once or name in hub.stall_once
            if self.command == "GET" and cut:
                stall = name in hub.stall_once
                hub.drop_once.discard(name)
                hub.stall_once.discard(name)
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, str(v))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                if stall:
                    hub.release.wait(30)
                self.close_connection = True
                return
            self._send(code, body, headers)

    return Handler


def start(hub: FakeHub) -> ThreadingHTTPServer:
    """Serve `hub` on a free loopback port in a daemon thread; sets hub.url."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
