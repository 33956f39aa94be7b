"""Serve the lab on a local web page: the seed's pipeline bench driven by fourd's own schedules and
simulator, the cluster row of one Llama 3 replica coloured by a layout's groups, a planner panel,
and a measured trace beside the simulated one.

Everything the page needs ships inside the package: it works offline. The server answers GET and
HEAD only, binds to 127.0.0.1 unless told otherwise, and serves no file outside its static folder.

examples:
  fourd lab                      # then open http://127.0.0.1:8000/
  fourd lab --port 0             # any free port; the URL is printed
  fourd lab --trace-dir runs     # traces under runs/ can be opened by path
  # shareable links to a setting of the bench:
  #   http://127.0.0.1:8000/?p=16&m=16&schedule=gpipe
  #   http://127.0.0.1:8000/?p=8&m=32&schedule=interleaved&v=2
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from fourd.errors import FourdError
from fourd.lab import api

STATIC_DIR = Path(__file__).with_name("static")
# Fixed here rather than guessed from the system's MIME table, which differs between machines.
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


def add_arguments(p):
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: only this machine can connect)"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--trace-dir",
        default=".",
        help="folder whose Chrome trace files the page may open by path (default: the current folder)",
    )


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise FourdError(f"--port {args.port}: a TCP port is 0 to 65535 (0 picks a free one)")
    trace_dir = Path(args.trace_dir)
    if not trace_dir.is_dir():
        raise FourdError(f"--trace-dir {args.trace_dir}: no such folder; name an existing one")
    server = make_server(args.host, args.port, trace_dir=trace_dir)
    print(f"fourd lab: serving {server.url} (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


class LabServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, static_dir: Path, trace_dir: Path):
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.static = load_static(static_dir)
        self.trace_dir = trace_dir.resolve()
        self.loopback_only = _is_loopback(host)
        try:
            super().__init__((host, port), _Handler)
        except OSError as e:
            raise FourdError(
                f"cannot listen on {host}:{port} ({e.strerror}); choose another --port, or --port 0"
            ) from e

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return  # the browser closed a connection it no longer needed; nothing went wrong here
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), self.server_address[1]
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def make_server(
    host: str = "127.0.0.1", port: int = 0, *, static_dir: Path = STATIC_DIR, trace_dir: Path = Path(".")
) -> LabServer:
    return LabServer(host, port, static_dir, trace_dir)


def serve_in_thread(server: LabServer) -> threading.Thread:
    """Start serving in a daemon thread (tests and benchmarks); `server.shutdown()` stops it."""
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    return t


def load_static(folder: Path) -> dict[str, tuple[bytes, str]]:
    """The files the server may send, read once: regular files of known types directly inside `folder`.

    Requests are answered from this table by exact name, so no request path ever reaches the file
    system: `..`, encoded slashes and absolute paths cannot name anything outside it, and a
    symbolic link placed in the folder is never followed.
    """
    files = {}
    with os.scandir(folder) as it:
        for entry in it:
            ctype = CONTENT_TYPES.get(Path(entry.name).suffix)
            if ctype and entry.is_file(follow_symlinks=False):
                files[entry.name] = (Path(entry.path).read_bytes(), ctype)
    return files


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Content-Security-Policy keeps the page from loading anything that is not served here (no CDN).
_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
    "script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}


class _Handler(BaseHTTPRequestHandler):
    server: LabServer
    server_version = "fourd-lab"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self._answer(body=True)

    def do_HEAD(self):
        self._answer(body=False)

    def __getattr__(self, name):
        # The base class looks up do_<METHOD> for each request: every method but GET and HEAD lands here.
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self):
        self.close_connection = True  # the request may carry a body we do not read
        self._send(
            HTTPStatus.METHOD_NOT_ALLOWED,
            _json({"error": f"method {self.command} not allowed: the lab answers GET and HEAD only"}),
            "application/json",
            extra={"Allow": "GET, HEAD", "Connection": "close"},
        )

    def _answer(self, body: bool):
        if self.server.loopback_only and not self._host_is_loopback():
            # A page elsewhere could point a name at 127.0.0.1 (DNS rebinding); it would send its own Host.
            return self._error(HTTPStatus.FORBIDDEN, "this lab answers requests for localhost only", body)
        target = urlsplit(self.path)
        path = target.path
        if path.startswith("/api/"):
            return self._api(path[len("/api/") :], target.query, body)
        name = "index.html" if path == "/" else path[1:]
        entry = self.server.static.get(name)
        if entry is None:
            return self._error(HTTPStatus.NOT_FOUND, "not found", body)
        data, ctype = entry
        self._send(HTTPStatus.OK, data, ctype, body=body)

    def _api(self, endpoint: str, query: str, body: bool):
        handler = api.ENDPOINTS.get(endpoint)
        if handler is None:
            return self._error(
                HTTPStatus.NOT_FOUND, f"no API endpoint {endpoint!r}; known: {', '.join(sorted(api.ENDPOINTS))}", body
            )
        try:
            params = api.single_values(
                parse_qsl(query, keep_blank_values=True, strict_parsing=False, max_num_fields=64)
            )
            result = handler(params, trace_dir=self.server.trace_dir)
        except (FourdError, ValueError) as e:
            return self._error(HTTPStatus.BAD_REQUEST, str(e), body)
        except Exception as e:  # a bug, not bad input: say so instead of dropping the connection
            print(f"fourd lab: internal error on {self.path}: {type(e).__name__}: {e}", file=sys.stderr)
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(e).__name__}: {e}", body)
        self._send(HTTPStatus.OK, _json(result), "application/json", body=body)

    def _host_is_loopback(self) -> bool:
        host = self.headers.get("Host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name.lower() in _LOOPBACK_NAMES or _is_loopback(name.strip("[]"))

    def _error(self, status: HTTPStatus, message: str, body: bool = True):
        self._send(status, _json({"error": message}), "application/json", body=body)

    def _send(self, status, data: bytes, ctype: str, body: bool = True, extra: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        for k, v in {**_HEADERS, **(extra or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format, *args):
        pass  # one line per request would drown the URL the user needs to read


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
