"""A fake HuggingFace hub on 127.0.0.1: the HTTP boundary of huggingface_hub, and nothing else.

It speaks the endpoints `create_repo`, `repo_info`, `create_branch`, `upload_folder` use (validate-yaml,
preupload, the git-LFS batch protocol, ndjson commits, tree listing), checks the bearer token, and keeps
every repo's files per branch, so a test can read back exactly what a push published. Large files
(*.safetensors) go through LFS as on the real hub; hf_xet's own CAS protocol is not spoken here, so
tests turn Xet off and huggingface_hub uses plain HTTP LFS.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

# Anonymous endpoints huggingface_hub calls on its own (agent detection), not part of a push.
PUBLIC = {"/api/agent-harnesses": []}


@dataclass
class Repo:
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: list[dict] = field(default_factory=list)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class FakeHub:
    def __init__(self, token: str, user: str = "alice"):
        self.token = token
        self.user = user
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.lfs: dict[str, bytes] = {}
        self.forbidden_namespaces: set[str] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        return self.repos[repo_id].branches[branch]

    # ------------------------------------------------------------------------------------------
    def _handler_class(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _send(self, status: int, payload=None, headers: dict | None = None) -> None:
                data = json.dumps(payload if payload is not None else {}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                body = self._body()
                hub.requests.append(Request(method, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                url = urlparse(self.path)
                path = unquote(url.path)
                if path.startswith("/lfs-upload/"):  # pre-signed storage URL: no hub token, as on S3
                    hub.lfs[path.rsplit("/", 1)[1]] = body
                    return self._send(200)
                if path in PUBLIC:
                    return self._send(200, PUBLIC[path])
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                try:
                    status, payload = hub._route(method, path, parse_qs(url.query), body)
                except KeyError as missing:
                    status, payload = 404, {"error": f"Repository not found: {missing}"}
                self._send(status, payload, {"X-Error-Message": payload.get("error", "")} if status >= 400 else None)

            def do_HEAD(
                self,
            ):  # a reachability check (attnres' hub_reachable): the hub's root answers, as huggingface.co does
                hub.requests.append(Request("HEAD", self.path, {k.lower(): v for k, v in self.headers.items()}, b""))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_PUT(self):
                self._handle("PUT")

        return Handler

    def _route(self, method: str, path: str, query: dict, body: bytes) -> tuple[int, dict | list]:
        parts = path.strip("/").split("/")
        if path == "/api/whoami-v2":
            return 200, {"name": self.user, "type": "user"}
        if path == "/api/validate-yaml":
            return 200, {"errors": [], "warnings": []}
        if path == "/api/repos/create":
            data = json.loads(body)
            repo_id = f"{data.get('organization') or self.user}/{data['name']}"
            if repo_id.split("/")[0] in self.forbidden_namespaces:
                return 403, {"error": "You don't have the rights to create a model under this namespace"}
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"}
            self.repos[repo_id] = Repo(private=data.get("visibility") == "private" or bool(data.get("private")))
            return 200, {"url": f"{self.endpoint}/{repo_id}"}
        if path.endswith(".git/info/lfs/objects/batch"):
            objects = json.loads(body)["objects"]
            actions = [
                {
                    "oid": o["oid"],
                    "size": o["size"],
                    "actions": {"upload": {"href": f"{self.endpoint}/lfs-upload/{o['oid']}"}},
                }
                for o in objects
            ]
            return 200, {"transfer": "basic", "objects": actions}
        if parts[:2] == ["api", "models"]:
            repo_id = "/".join(parts[2:4])
            repo = self.repos[repo_id]
            action, rest = (parts[4], parts[5:]) if len(parts) > 4 else ("info", [])
            if action in ("info", "revision"):
                return 200, {"id": repo_id, "private": repo.private, "sha": "0" * 40, "siblings": []}
            if action == "branch":
                branch = "/".join(rest)
                if branch in repo.branches:
                    return 409, {"error": "Reference already exists"}
                repo.branches[branch] = dict(repo.branches["main"])
                return 200, {}
            if action == "tree":
                files = repo.branches[rest[0]]
                return 200, [
                    {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in sorted(files.items())
                ]
            if action == "preupload":
                files = json.loads(body)["files"]
                return 200, {
                    "files": [
                        {
                            "path": f["path"],
                            "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                            "shouldIgnore": False,
                        }
                        for f in files
                    ]
                }
            if action == "commit":
                return self._commit(repo_id, unquote("/".join(rest)), body)
        return 404, {"error": f"fake hub: no route for {method} {path}"}

    def _commit(self, repo_id: str, branch: str, body: bytes) -> tuple[int, dict]:
        files = self.repos[repo_id].branches[branch]
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                data = self.lfs[value["oid"]]
                assert hashlib.sha256(data).hexdigest() == value["oid"], "LFS object does not match its oid"
                files[value["path"]] = data
            elif line["key"] == "deletedFile":
                files.pop(value["path"], None)
        self.repos[repo_id].commits.append({"branch": branch, "header": lines[0]["value"]})
        return 200, {
            "commitUrl": f"{self.endpoint}/{repo_id}/commit/{'a' * 40}",
            "commitOid": "a" * 40,
            "success": True,
        }
