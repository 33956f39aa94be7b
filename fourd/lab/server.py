"""Serve the lab, a local web page: a pipeline bench drawn from fourd's schedules and simulator, the cluster row
of one Llama 3 replica coloured by a layout's groups, a planner panel, and a measured trace beside the simulated
one. Offline; it listens on 127.0.0.1 unless told otherwise and answers GET and HEAD addressed to itself only.

examples:
  fourd lab                      # then open http://127.0.0.1:8000/
  fourd lab --port 0             # any free port; the URL is printed
  fourd lab --trace-dir runs     # traces under runs/ can be opened by path
  # a link to a setting of the bench: http://127.0.0.1:8000/?p=8&m=32&schedule=interleaved&v=2
"""

from __future__ import annotations

import contextlib
import http.client
import io
import os
import selectors
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from fourd.errors import FourdError
from fourd.lab import api
from fourd.lab.forker import Forker, TooLong, json_bytes

STATIC_DIR = Path(__file__).with_name("static")
# Fixed here rather than guessed from the system's MIME table, which differs between machines.
CONTENT_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
}  # all sent as UTF-8
JSON = "application/json"
TIMEOUT_S = 5.0  # to send the request line and headers, and again to take the answer
WORKERS = 8  # threads that answer complete requests; clients still sending hold no thread
MAX_WAITING = 512  # connections still sending their request; beyond it the oldest is closed
MAX_QUEUED = 64  # complete requests waiting for a worker; beyond it the answer is 503
MAX_HEAD = 16 << 10
# Every answer within 2 s on this project's 2-core machine: an API answer is computed in a child
# process that is ended when it runs longer than this (reading and sending take the rest).
COMPUTE_LIMIT_S = 1.5
# Endpoints computed in the worker thread: their work is bounded by their parameters' ranges (the
# bench's at most 16 x 64 x 8 stage-microbatches) and the bench's answers are cached in this
# process.
IN_THREAD = {"options", "schedule"}
TOO_LONG = (
    "this request takes more than {limit:g} s to compute, the lab's bound on one request: give "
    "more of the settings (layout, schedule, microbatches), open a smaller trace, or run "
    "`fourd plan` or `fourd sim step`, which have no such bound"
)
# Content-Security-Policy keeps the page from loading anything that is not served here (no CDN).
_CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"
_HEADERS = {"Cache-Control": "no-store", "Connection": "close", "X-Content-Type-Options": "nosniff"}
_HEADERS |= {
    "Content-Security-Policy": _CSP + "; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}


def add_arguments(p):
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only)",
    )
    p.add_argument(
        "--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)"
    )
    p.add_argument(
        "--trace-dir",
        default=".",
        help="folder whose trace files the page may open (default: here)",
    )


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise FourdError(f"--port {args.port}: a TCP port is 0 to 65535 (0 picks a free one)")
    trace_dir = Path(args.trace_dir)
    if not trace_dir.is_dir():
        raise FourdError(f"--trace-dir {args.trace_dir}: no such folder; name an existing one")
    server = LabServer(args.host, args.port, trace_dir=trace_dir)
    print(f"fourd lab: serving {server.url} (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


class LabServer:
    """One thread reads every connection's request, WORKERS threads answer complete ones: a client
    that sends slowly costs a socket for `timeout` seconds, never a thread (docs/lab.md). One
    request per connection; an API answer is computed within `compute_limit_s`."""

    def __init__(
        self,
        host="127.0.0.1",
        port=0,
        *,
        static_dir=STATIC_DIR,
        trace_dir=Path("."),
        timeout=TIMEOUT_S,
        compute_limit_s=COMPUTE_LIMIT_S,
    ):
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
            self.socket.listen(128)
        except OSError as e:
            self.socket.close()
            raise FourdError(
                f"cannot listen on {host}:{port} ({e.strerror}); choose another --port, or --port 0"
            ) from e
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        name, port = str(self.server_address[0]), self.server_address[1]
        self.url = f"http://[{name}]:{port}/" if ":" in name else f"http://{name}:{port}/"
        self.static = load_static(static_dir)
        self.trace_dir = trace_dir.resolve()
        self.timeout = timeout
        self.compute_limit_s = compute_limit_s
        # on every interface other machines may connect, under whatever name they use
        self.any_name = host in ("0.0.0.0", "::", "")
        names = ["127.0.0.1", "localhost"]
        if ":" in host and not self.any_name:  # an IPv6 address is written in brackets
            names.append(f"[{host}]")
        elif not self.any_name:
            names.append(host.lower())
        self.hosts = [f"{known}:{port}" for known in dict.fromkeys(names)]  # first: suggested
        if port == 80:  # the port may be left out
            self.hosts += names
        self._forker = Forker()  # the processes that compute the answers (fourd.lab.forker)
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="fourd-lab")
        self._slots = threading.BoundedSemaphore(WORKERS + MAX_QUEUED)
        self._stop, self._stopped = threading.Event(), threading.Event()
        self._stopped.set()

    def serve_forever(self) -> None:
        """Accept and read until shutdown(); a connection still sending has (deadline, bytes so far)
        as its data."""
        self._stopped.clear()
        sel = self._sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.2):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.fileobj, key.data[1])  # type: ignore[arg-type]
                now = time.monotonic()
                for key in [k for k in sel.get_map().values() if k.data and k.data[0] < now]:
                    late = _error(
                        408,
                        f"the request did not arrive within {self.timeout:g} s: send it at once",
                    )
                    self._drop(key.fileobj, late if key.data[1] else b"")  # type: ignore[arg-type]
        finally:
            for key in [k for k in sel.get_map().values() if k.data]:
                key.fileobj.close()  # type: ignore[union-attr]
            sel.close()
            self._stop.clear()
            self._stopped.set()

    def serve_in_thread(self) -> None:  # for tests and benchmarks; shutdown() stops it
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def shutdown(self) -> None:
        self._stop.set()
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
        self._pool.shutdown(wait=False)
        self._forker.close()

    def _compute(self, endpoint: str, query: dict[str, str]) -> bytes:
        """API `endpoint`'s answer, computed in a process of its own that is ended after
        compute_limit_s (fourd.lab.forker)."""
        try:
            return self._forker.compute(endpoint, query, self.trace_dir, self.compute_limit_s)
        except TooLong:
            raise FourdError(TOO_LONG.format(limit=self.compute_limit_s)) from None

    def _accept(self) -> None:
        try:
            conn, _ = self.socket.accept()
        except OSError:  # gone before we took it, or out of descriptors: the next round tries again
            return
        waiting = [k.fileobj for k in self._sel.get_map().values() if k.data]
        if len(waiting) >= MAX_WAITING:
            self._drop(waiting[0])  # type: ignore[arg-type]
        conn.setblocking(False)
        self._sel.register(
            conn, selectors.EVENT_READ, (time.monotonic() + self.timeout, bytearray())
        )

    def _read(self, conn: socket.socket, head: bytearray) -> None:
        try:
            chunk = conn.recv(MAX_HEAD)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        head += chunk
        if b"\n" in head:  # a malformed request line is answered at once, not at the deadline
            try:
                _parse_request_line(bytes(head.partition(b"\n")[0]))
            except FourdError as e:
                return self._drop(conn, _error(400, str(e)))
        if chunk and len(head) <= MAX_HEAD and b"\r\n\r\n" not in head and b"\n\n" not in head:
            return  # more to come
        if not chunk or len(head) > MAX_HEAD:
            return self._drop(
                conn,
                _error(431, f"the request head is over {MAX_HEAD >> 10} KiB") if chunk else b"",
            )
        self._sel.unregister(conn)
        if self._slots.acquire(blocking=False):
            self._pool.submit(self._answer, conn, bytes(head))
        else:
            _close(
                conn, _error(503, "the lab is busy answering other requests: try again in a moment")
            )

    def _drop(self, conn: socket.socket, answer: bytes = b"") -> None:
        self._sel.unregister(conn)
        _close(conn, answer)

    def _answer(self, conn: socket.socket, head: bytes) -> None:
        try:
            conn.settimeout(self.timeout)
            _close(conn, self.respond(head))
        finally:
            self._slots.release()

    def respond(self, head: bytes) -> bytes:
        """The whole answer to one request head: the file or the API's JSON, else an error in one
        line."""
        method = ""
        try:
            method, target, headers = _parse_head(head)
            return self._route(method, target, headers)
        except FourdError as e:
            return _error(400, str(e), method == "HEAD")
        except Exception as e:  # a bug, not bad input: say so, and keep serving everyone else
            line = " ".join(f"internal error ({type(e).__name__}: {e}); please report it".split())
            print(f"fourd lab: {line}", file=sys.stderr)
            return _error(500, line, method == "HEAD")

    def _route(self, method: str, target: str, headers) -> bytes:
        head_only = method == "HEAD"
        if method not in ("GET", "HEAD"):
            allow = {"Allow": "GET, HEAD"}
            return _error(
                405, f"method {method} not allowed: the lab answers GET and HEAD only", extra=allow
            )
        self._check_host(headers.get_all("Host") or [])
        if not target.startswith("/"):
            raise FourdError(
                f"request target {target[:60]!r} is not a path: send origin-form, such as "
                "GET / HTTP/1.1"
            )
        parts = urlsplit(target)
        if parts.path.startswith("/api/"):
            name = parts.path[len("/api/") :]
            endpoint = api.ENDPOINTS.get(name)
            if endpoint is None:
                known = ", ".join(sorted(api.ENDPOINTS))
                return _error(
                    404, f"no API endpoint {parts.path[5:60]!r}; known: {known}", head_only
                )
            query = self._query(parts.query)

            if name in IN_THREAD:
                body = json_bytes(endpoint(query, trace_dir=self.trace_dir))
            else:
                body = self._compute(name, query)
            return _response(200, body, JSON, head_only)
        entry = self.static.get("index.html" if parts.path == "/" else parts.path[1:])
        return (
            _response(200, entry[0], entry[1], head_only)
            if entry
            else _error(404, "not found", head_only)
        )

    def _check_host(self, values: list[str]) -> None:
        if len(values) != 1:
            raise FourdError(
                f"the request has {len(values)} Host headers: send exactly one, such as "
                f"{self.hosts[0]}"
            )
        value = values[0].strip().lower()
        # A page elsewhere could point its own name at 127.0.0.1 (DNS rebinding); it would send that
        # name.
        if value not in self.hosts and not (
            self.any_name and value.endswith(f":{self.server_address[1]}")
        ):
            raise FourdError(
                f"Host {values[0][:60]!r} is not this lab: address it as {' or '.join(self.hosts)}"
            )

    @staticmethod
    def _query(text: str) -> dict[str, str]:
        try:
            return api.single_values(parse_qsl(text, keep_blank_values=True, max_num_fields=32))
        except ValueError:
            raise FourdError(
                "more than 32 query parameters: give each of the endpoint's parameters once"
            ) from None


def load_static(folder: Path) -> dict[str, tuple[bytes, str]]:
    """Regular files of known types directly in `folder`, read once: no request path reaches the
    file system."""
    files = {}
    with os.scandir(folder) as it:
        for entry in it:
            ctype = CONTENT_TYPES.get(Path(entry.name).suffix)
            if ctype and entry.is_file(follow_symlinks=False):
                files[entry.name] = (Path(entry.path).read_bytes(), f"{ctype}; charset=utf-8")
    return files


def _parse_request_line(line: bytes) -> list[str]:
    """METHOD, TARGET and the version of a request line; FourdError for anything else."""
    words = line.decode("latin-1").split()
    if len(words) != 3 or words[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise FourdError(f"request line {line.strip()[:60]!r} is not METHOD TARGET HTTP/1.1")
    return words


def _parse_head(head: bytes):
    line, _, rest = head.partition(b"\n")
    words = _parse_request_line(line)
    try:
        headers = http.client.parse_headers(io.BytesIO(rest))
    except http.client.HTTPException:
        raise FourdError("more than 100 header lines: send fewer") from None
    return words[0], words[1], headers


def _response(
    status: int, body: bytes, ctype: str, head_only: bool = False, extra: dict | None = None
) -> bytes:
    fields = {"Content-Type": ctype, "Content-Length": str(len(body)), **_HEADERS, **(extra or {})}
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        *(f"{k}: {v}" for k, v in fields.items()),
    ]
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + (b"" if head_only else body)


def _error(status: int, message: str, head_only: bool = False, extra: dict | None = None) -> bytes:
    return _response(status, json_bytes({"error": message}), JSON, head_only, extra)


def _close(conn: socket.socket, answer: bytes) -> None:
    """Send the answer (if any) and close; a client that left or stopped reading is not told
    more."""
    with contextlib.suppress(OSError):
        conn.sendall(answer)
        conn.shutdown(socket.SHUT_WR)
    conn.close()
