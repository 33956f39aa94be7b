"""The lab's HTTP server over real sockets: static files from an allow-list only, GET/HEAD only, one
Host naming this lab, origin-form targets, 400 with one line for bad parameters, 127.0.0.1 unless told
otherwise, and slow or hostile clients that cannot hold threads or stop it answering others."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fourd.lab.server import MAX_WAITING, STATIC_DIR, WORKERS, LabServer

SPREAD = True  # over the xdist workers: a server starts in milliseconds


@pytest.fixture(scope="module")
def lab():
    server = LabServer("127.0.0.1", 0)
    server.serve_in_thread()
    yield server
    server.shutdown()
    server.server_close()


def request(server, method: str, target: str, headers: dict | None = None):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    try:
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for k, v in ({"Host": f"127.0.0.1:{server.server_address[1]}"} | (headers or {})).items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_index_and_assets_are_served_with_their_types(lab):
    status, headers, body = request(lab, "GET", "/")
    assert status == 200
    assert body == (STATIC_DIR / "index.html").read_bytes()
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for name, ctype in (
        ("app.js", "text/javascript; charset=utf-8"),
        ("style.css", "text/css; charset=utf-8"),
    ):
        status, headers, body = request(lab, "GET", f"/{name}")
        assert (status, headers["Content-Type"], body) == (
            200,
            ctype,
            (STATIC_DIR / name).read_bytes(),
        )


def test_page_loads_nothing_from_elsewhere():
    """Offline: every script, style and link the page names is one of the files the server ships."""
    html = (STATIC_DIR / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"#]+)"', html)
    assert sorted(refs) == ["/app.js", "/style.css", "data:,"]
    for name in ("index.html", "app.js", "style.css"):
        text = (STATIC_DIR / name).read_text()
        assert not re.search(r"https?://", text.replace("http://www.w3.org/2000/svg", "")), name


TRAVERSALS = [
    "/../../../../etc/passwd",
    "/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "/%2E%2E/%2E%2E/%2E%2E/%2E%2E/etc/passwd",
    "/..%2f..%2f..%2f..%2fetc%2fpasswd",
    "/%2e%2e%2f%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "/%252e%252e/%252e%252e/%252e%252e/etc/passwd",
    "/%252e%252e%252f%252e%252e%252fetc%252fpasswd",
    "/..\\..\\..\\..\\etc\\passwd",
    "/..%5c..%5c..%5c..%5cetc%5cpasswd",
    "//etc/passwd",
    "/etc/passwd",
    "/%2fetc%2fpasswd",
    "/index.html/../../../../etc/passwd",
    "/./../../../../etc/passwd",
    "/.%2e/.%2e/.%2e/.%2e/etc/passwd",
    "/../server.py",
    "/%2e%2e/server.py",
    "/static/../server.py",
    "/../api.py",
    "/app.js%00.py",
]


@pytest.mark.parametrize("target", TRAVERSALS)
def test_traversal_never_returns_a_file_outside_static(lab, target):
    for method in ("GET", "HEAD"):
        status, _, body = request(lab, method, target)
        assert status == 404, (method, target, status)
        assert b"root:" not in body and b"def run(" not in body and b"ENDPOINTS" not in body


def test_symlinks_and_subfolders_in_the_static_folder_are_not_served(tmp_path):
    static = tmp_path / "static"
    (static / "sub").mkdir(parents=True)
    (static / "index.html").write_text("<p>hi</p>")
    (static / "sub" / "x.js").write_text("1")
    (tmp_path / "secret.txt").write_text("secret outside")
    os.symlink("/etc/passwd", static / "passwd.css")
    os.symlink(tmp_path / "secret.txt", static / "secret.js")
    os.symlink(tmp_path, static / "up")
    server = LabServer("127.0.0.1", 0, static_dir=static)
    server.serve_in_thread()
    try:
        assert request(server, "GET", "/")[::2] == (200, b"<p>hi</p>")
        for target in ("/passwd.css", "/secret.js", "/up/secret.txt", "/sub/x.js", "/sub", "/up"):
            status, _, body = request(server, "GET", target)
            assert status == 404, target
            assert b"secret" not in body and b"root:" not in body
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "PROPFIND", "FOO"]
)
def test_only_get_and_head(lab, method):
    for target in ("/", "/api/schedule?p=4&m=4"):
        status, headers, body = request(lab, method, target)
        assert status == 405
        assert headers["Allow"] == "GET, HEAD"
        assert (
            json.loads(body)["error"]
            == f"method {method} not allowed: the lab answers GET and HEAD only"
        )


def test_head_sends_the_length_of_get_without_a_body(lab):
    _, _, body = request(lab, "GET", "/app.js")
    status, headers, head_body = request(lab, "HEAD", "/app.js")
    assert (status, int(headers["Content-Length"]), head_body) == (200, len(body), b"")


def error_of(status_headers_body):
    """The one-line error of an answer: a JSON object {"error": ...} on one line, nothing else."""
    status, headers, body = status_headers_body
    assert headers["Content-Type"] == "application/json" and b"\n" not in body
    doc = json.loads(body)
    assert list(doc) == ["error"] and "\n" not in doc["error"]
    return status, doc["error"]


def test_requests_for_another_host_name_are_refused(lab):
    """A page elsewhere that points its own name at 127.0.0.1 (DNS rebinding) sends that name: 400."""
    port = lab.server_address[1]
    suggestion = f"127.0.0.1:{port} or localhost:{port}"
    for host in (
        "attacker.example:80",
        f"attacker.example:{port}",
        "localhost",
        "127.0.0.1",
        "127.0.0.1:1",
        "",
    ):
        assert error_of(request(lab, "GET", "/api/options", {"Host": host})) == (
            400,
            f"Host {host!r} is not this lab: address it as {suggestion}",
        ), host
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"LocalHost:{port}"):
        assert request(lab, "GET", "/", {"Host": host})[0] == 200


def raw(server, data: bytes, timeout: float = 10) -> bytes:
    """Send bytes as they are and read the answer until the server closes the connection."""
    with socket.create_connection(server.server_address[:2], timeout=timeout) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers["Content-Length"]) == len(body)
    return error_of((int(lines[0].split()[1]), headers, body))


def test_exactly_one_host_header(lab):
    port = lab.server_address[1]
    two = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: evil.example:{port}\r\n\r\n".encode()
    assert status_and_error(raw(lab, two)) == (
        400,
        f"the request has 2 Host headers: send exactly one, such as 127.0.0.1:{port}",
    )
    assert status_and_error(raw(lab, b"GET / HTTP/1.0\r\n\r\n")) == (
        400,
        f"the request has 0 Host headers: send exactly one, such as 127.0.0.1:{port}",
    )


@pytest.mark.parametrize(
    "target", ["http://127.0.0.1/../../../../etc/passwd", "http://other.example/", "*"]
)
def test_only_origin_form_targets(lab, target):
    """An absolute-form target would let a proxy-style request name another host: refused."""
    assert error_of(request(lab, "GET", target)) == (
        400,
        f"request target {target!r} is not a path: send origin-form, such as GET / HTTP/1.1",
    )


def test_a_server_on_every_interface_answers_any_name_with_its_port():
    server = LabServer("0.0.0.0", 0)
    server.serve_in_thread()
    try:
        port = server.server_address[1]
        assert request(server, "GET", "/api/options", {"Host": f"lab.example:{port}"})[0] == 200
        assert error_of(request(server, "GET", "/", {"Host": "lab.example"})) == (
            400,
            f"Host 'lab.example' is not this lab: address it as 127.0.0.1:{port} or localhost:{port}",
        )
    finally:
        server.shutdown()
        server.server_close()


BAD = [
    ("/api/schedule?p=0&m=16", "p=0 is out of range: give an integer from 1 to 16"),
    ("/api/schedule?p=17&m=16", "p=17 is out of range: give an integer from 1 to 16"),
    ("/api/schedule?p=16&m=65", "m=65 is out of range: give an integer from 1 to 64"),
    ("/api/schedule?p=16&m=0", "m=0 is out of range: give an integer from 1 to 64"),
    ("/api/schedule?p=abc&m=16", "p='abc' is not a whole number: give an integer from 1 to 16"),
    ("/api/schedule?p=-1&m=16", "p='-1' is not a whole number: give an integer from 1 to 16"),
    ("/api/schedule?p=1e1&m=16", "p='1e1' is not a whole number: give an integer from 1 to 16"),
    ("/api/schedule?p=%204&m=16", "p=' 4' is not a whole number: give an integer from 1 to 16"),
    (
        "/api/schedule?p=99999999999999999999&m=16",
        "p='99999999999999999999' is not a whole number: give an integer from 1 to 16",
    ),
    ("/api/schedule?m=16", "missing parameter p: give an integer from 1 to 16"),
    (
        "/api/schedule?p=4&m=4&schedule=pipedream",
        "schedule='pipedream': choose one of gpipe, 1f1b, interleaved, zero-bubble",
    ),
    (
        "/api/schedule?p=4&m=4&v=9&schedule=interleaved",
        "v=9 is out of range: give an integer from 1 to 8",
    ),
    (
        "/api/schedule?p=4&m=4&v=2&schedule=gpipe",
        "2 virtual stages need the interleaved schedule (gpipe runs one stage per rank): choose the interleaved "
        "schedule or one virtual stage",
    ),
    ("/api/schedule?p=4&m=4&q=1", "unknown parameter 'q'; this endpoint takes p, m, schedule, v"),
    ("/api/schedule?p=4&p=5&m=4", "parameter 'p' is given twice; give it once"),
    (
        "/api/cluster?layout=tp%3D0",
        "layout tp=0: each degree must be a positive integer, e.g. tp=2",
    ),
    (
        "/api/cluster?layout=xx%3D2",
        "layout 'xx=2': bad item 'xx=2'; write key=value with keys tp, cp, pp, dp",
    ),
    (
        "/api/cluster?layout=tp%3D8&cluster=..%2F..%2Fetc%2Fpasswd",
        "cluster='../../etc/passwd': give a cluster profile name such as llama3-h100",
    ),
    (
        "/api/cluster?layout=tp%3D8&cluster=%2Fetc%2Fx.toml",
        "cluster='/etc/x.toml': give a cluster profile name such as llama3-h100",
    ),
    ("/api/trace?path=..%2F..%2F..%2Fetc%2Fpasswd", None),
    ("/api/trace?path=%2Fetc%2Fpasswd", None),
    (
        "/api/trace?path=missing.json",
        "path='missing.json': no such file under the lab's --trace-dir",
    ),
    ("/api/trace", "missing parameter path: name a trace file under the lab's --trace-dir"),
    (
        "/api/trace?path=" + "a" * 300 + ".json",
        f"path={'a' * 80!r} cannot be read (File name too long): name a trace file under --trace-dir",
    ),
]


@pytest.mark.parametrize("target,message", BAD)
def test_bad_parameters_answer_400_with_the_reason(lab, target, message):
    status, error = error_of(request(lab, "GET", target))
    assert status == 400, error
    if message is None:
        assert "outside the lab's --trace-dir" in error and "root:" not in error
    else:
        assert error == message


def test_unknown_endpoint_is_404_naming_the_known_ones(lab):
    status, _, body = request(lab, "GET", "/api/nope")
    assert status == 404
    assert (
        json.loads(body)["error"]
        == "no API endpoint 'nope'; known: cluster, options, plan, schedule, simtrace, trace"
    )


def _listening_address(port: int) -> str:
    """The local address of the socket listening on `port`, from the kernel's table."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        addr, p = fields[1].split(":")
        if int(p, 16) == port and fields[3] == "0A":  # 0A: LISTEN
            return socket.inet_ntoa(bytes.fromhex(addr)[::-1])
    return ""


def test_cli_binds_loopback_by_default_and_prints_its_url():
    proc = subprocess.Popen(
        [sys.executable, "-m", "fourd", "lab", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        m = re.fullmatch(
            r"fourd lab: serving http://127\.0\.0\.1:(\d+)/ \(Ctrl-C to stop\)\n", line
        )
        assert m, line
        port = int(m.group(1))
        assert _listening_address(port) == "127.0.0.1"

        def get(target):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", target)
            status = conn.getresponse().status
            conn.close()
            return status

        # The page's first requests arrive together, each on its own thread, in a fresh process.
        targets = [
            "/api/schedule?p=6&m=10&schedule=zero-bubble",
            "/api/cluster?layout=tp%3D8%2Cpp%3D16",
            "/api/options",
            "/?p=16&m=16&schedule=gpipe",
        ]
        with ThreadPoolExecutor(len(targets)) as pool:
            assert list(pool.map(get, targets)) == [200] * len(targets)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_cli_names_a_busy_port_in_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "fourd", "lab", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert done.stderr == (
        f"fourd: error: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "choose another --port, or --port 0\n"
    )


def test_server_answers_while_another_request_is_slow(lab):
    """A client that opens a connection and sends nothing must not block everyone else (threads)."""
    stalled = socket.create_connection(lab.server_address[:2])
    try:
        t = time.monotonic()
        assert request(lab, "GET", "/style.css")[0] == 200
        assert time.monotonic() - t < 5
    finally:
        stalled.close()


def test_a_refused_upload_closes_the_connection(lab):
    """A POST's body is never read, so the connection cannot be trusted for a next request."""
    with socket.create_connection(lab.server_address[:2], timeout=10) as s:
        s.sendall(b"POST /api/trace HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nGET /")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 405 ")
    assert data.count(b"HTTP/1.1") == 1


@pytest.fixture
def quick():
    """A lab that gives each client one second to send its request."""
    server = LabServer("127.0.0.1", 0, timeout=1.0)
    server.serve_in_thread()
    yield server
    server.shutdown()
    server.server_close()


def test_a_bare_request_line_is_answered_within_the_timeout(quick):
    """`GET / HTTP/1.1` and no blank line: 408 in one line once the second has passed; silence: a clean close."""
    t = time.monotonic()
    assert status_and_error(raw(quick, b"GET / HTTP/1.1\r\n")) == (
        408,
        "the request did not arrive within 1 s: send it at once",
    )
    assert 0.9 < time.monotonic() - t < 3
    t = time.monotonic()
    assert raw(quick, b"") == b""
    assert 0.9 < time.monotonic() - t < 3


def test_a_client_that_drips_its_request_is_cut_off_at_the_deadline(quick):
    """The timeout bounds the whole request, not the gap between two bytes (slowloris)."""
    with socket.create_connection(quick.server_address[:2], timeout=10) as s:
        t = time.monotonic()
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\n" * 10:
            if select.select([s], [], [], 0.1)[0]:  # the server has answered
                break
            s.sendall(bytes([byte]))
        answer = s.recv(65536)
    assert 0.9 < time.monotonic() - t < 2
    assert status_and_error(answer) == (
        408,
        "the request did not arrive within 1 s: send it at once",
    )


def open_slow_clients(server, n: int) -> list[socket.socket]:
    """n connections that each send half a request and wait."""
    port = server.server_address[1]
    clients = []
    for _ in range(n):
        s = socket.create_connection(server.server_address[:2], timeout=10)
        s.sendall(f"GET /api/options HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode())
        clients.append(s)
    return clients


def test_300_slow_clients_hold_no_threads_and_others_are_answered():
    """A lab that gives each client 4 s: another client is answered while the 300 still hold their
    sockets (in under half that, so not after they were cut off, even on a busy machine)."""
    server = LabServer("127.0.0.1", 0, timeout=4.0)
    server.serve_in_thread()
    before = threading.active_count()
    clients = open_slow_clients(server, 300)
    try:
        t = time.monotonic()
        assert request(server, "GET", "/api/options")[0] == 200
        assert time.monotonic() - t < 2
        assert threading.active_count() <= before + WORKERS
        for s in clients:  # each is told it was too slow, then closed
            s.settimeout(10)
            assert s.recv(65536).startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    finally:
        for s in clients:
            s.close()
        server.shutdown()
        server.server_close()


def test_beyond_the_waiting_limit_the_oldest_connection_is_closed():
    server = LabServer(
        "127.0.0.1", 0, timeout=60.0
    )  # long enough to open them all on a busy machine
    server.serve_in_thread()
    clients = open_slow_clients(server, MAX_WAITING + 1)
    try:
        clients[0].settimeout(5)
        assert clients[0].recv(100) == b""  # closed without an answer, to make room
        clients[1].settimeout(0.2)
        with pytest.raises(TimeoutError):  # the next oldest still waits
            clients[1].recv(100)
        assert request(server, "GET", "/style.css")[0] == 200
    finally:
        for s in clients:
            s.close()
        server.shutdown()
        server.server_close()


HOSTILE = [
    (b"GET /\r\n\r\n", 400, "request line b'GET /' is not METHOD TARGET HTTP/1.1"),
    (b"\r\n\r\n", 400, "request line b'' is not METHOD TARGET HTTP/1.1"),
    (
        b"GET / HTTP/2.0\r\n\r\n",
        400,
        "request line b'GET / HTTP/2.0' is not METHOD TARGET HTTP/1.1",
    ),
    (
        b"GET / HTTP/1.1 extra\r\n\r\n",
        400,
        "request line b'GET / HTTP/1.1 extra' is not METHOD TARGET HTTP/1.1",
    ),
    (
        b"\xff\xfe / HTTP/1.1\r\n\r\n",
        405,
        "method \xff\xfe not allowed: the lab answers GET and HEAD only",
    ),
    (
        b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n",
        400,
        "more than 100 header lines: send fewer",
    ),
    (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n", 431, "the request head is over 16 KiB"),
    (b"GET http://evil.example/ HTTP/1.1\r\nHost: HOST\r\n\r\n", 400, None),
    (b"GET /api/schedule?p=4&m=4&%ff=%00 HTTP/1.1\r\nHost: HOST\r\n\r\n", 400, None),
    (b"GET /api/schedule?" + b"a=1&" * 40 + b" HTTP/1.1\r\nHost: HOST\r\n\r\n", 400, None),
    (b"GET /api/trace?path=%00 HTTP/1.1\r\nHost: HOST\r\n\r\n", 400, "path contains a NUL byte"),
    (b"GET /api/cluster?layout=tp%3D3 HTTP/1.1\r\nHost: HOST\r\n\r\n", 200, None),
    (b"GET /api/cluster?layout=dp%3D99999999999 HTTP/1.1\r\nHost: HOST\r\n\r\n", 400, None),
    (b"GET /api/plan?seq=99999999999 HTTP/1.1\r\nHost: HOST\r\n\r\n", 400, None),
    (b"GET /api/plan?gpus=8&global_batch_tokens=nan HTTP/1.1\r\nHost: HOST\r\n\r\n", 400, None),
    (b"GET /api/plan?gpus=8&global_batch_tokens=-5T HTTP/1.1\r\nHost: HOST\r\n\r\n", 400, None),
    (b"HEAD /nope HTTP/1.1\r\nHost: HOST\r\n\r\n", 404, None),
]


def test_no_hostile_request_gets_a_500_or_stops_the_lab(quick):
    """Each hostile request gets a 4xx (or a plain 200) with one line while 100 slow clients wait; then a
    normal request is answered at once."""
    host = f"127.0.0.1:{quick.server_address[1]}".encode()
    clients = open_slow_clients(quick, 100)
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(lambda case: raw(quick, case[0].replace(b"HOST", host)), HOSTILE)
            )
        for (data, status, message), answer in zip(HOSTILE, answers):
            if data.startswith(b"HEAD"):
                assert answer.startswith(b"HTTP/1.1 404 Not Found\r\n") and answer.endswith(
                    b"\r\n\r\n"
                )
                continue
            if status == 200:
                assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), data
                continue
            got = status_and_error(answer)
            assert got[0] == status and (message is None or got[1] == message), (data[:80], got)
        t = time.monotonic()
        assert request(quick, "GET", "/api/schedule?p=4&m=4")[0] == 200
        assert time.monotonic() - t < 1
    finally:
        for s in clients:
            s.close()


PLANNER_CASES = [
    # Each of these once ended in an exception inside the planner (a ZeroDivisionError: dp above the global
    # batch, tp that does not divide the model) or in a simulation that grew without bound (the planner chose
    # 244 million microbatches), and the lab answered 500 or ran out of memory.
    "/api/plan?gpus=16384&layout=tp%3D1%2Cpp%3D1%2Cdp%3D16384&seq=8192",
    "/api/simtrace?gpus=16384&layout=tp%3D1%2Cpp%3D1%2Cdp%3D16384&seq=8192",
    "/api/plan?model=debug&layout=tp%3D8&gpus=8&global_batch_tokens=65536",
    "/api/plan?model=llama3-8b&layout=dp%3D16&gpus=16&global_batch_tokens=65536",
    "/api/simtrace?model=debug&gpus=1&seq=256&global_batch_tokens=1T",
]


@pytest.fixture(scope="module")
def confined_lab():
    """`fourd lab` in its own process, limited to 4 GiB of address space: a request that would allocate
    without bound fails there rather than on this machine."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = subprocess.Popen(
        [sys.executable, "-m", "fourd", "lab", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=limit,
    )
    port = int(re.search(r":(\d+)/", proc.stdout.readline()).group(1))
    yield port
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.parametrize("target", PLANNER_CASES)
def test_planner_requests_that_once_failed_answer_400_at_once(confined_lab, target):
    conn = http.client.HTTPConnection("127.0.0.1", confined_lab, timeout=20)
    t = time.monotonic()
    conn.request("GET", target)
    resp = conn.getresponse()
    status, error = error_of((resp.status, dict(resp.getheaders()), resp.read()))
    conn.close()
    assert status == 400, error
    assert time.monotonic() - t < 10


# The simulated trace of one Llama 3 405B step over 1,024 GPUs: left to the planner, 512 microbatches
# of 126 layers, 129,024 pieces that took over 90 s to simulate.
HUGE_SIMTRACE = (
    "/api/simtrace?cluster=llama3-h100&layout=tp=4,dp=16,pp=16&v=4&gpus=1024&seq=256"
    "&global_batch_tokens=16M&schedule=&microbatches="
)


def refused_within(server, target: str, seconds: float) -> str:
    """The one-line error of a 400 answer to GET `target` that came within `seconds`."""
    t = time.monotonic()
    status, error = error_of(request(server, "GET", target))
    assert status == 400 and time.monotonic() - t < seconds, (status, error)
    return error


def test_a_simulated_trace_beyond_the_labs_bound_is_refused_at_once_naming_it(lab):
    assert refused_within(lab, HUGE_SIMTRACE, 2) == (
        "the step to simulate has 512 microbatches x 126 layers x 2 passes = 129,024 compute "
        "pieces; the lab simulates at most 10,000: give microbatches=39 or fewer, or run "
        "`fourd sim step` for the whole step"
    )
    small = "model=debug&gpus=8&layout=pp=4,dp=2&schedule=1f1b&microbatches=8&seq=256"
    t = time.monotonic()
    status, _, body = request(lab, "GET", f"/api/simtrace?{small}&global_batch_tokens=8192")
    assert status == 200 and time.monotonic() - t < 2
    steps = [e for e in json.loads(body)["traceEvents"] if e.get("tid") == 0 and e["ph"] == "X"]
    assert len(steps) == 2 * 8  # rank 0: a forward and a backward of each of 8 microbatches


def test_a_request_computing_longer_than_the_bound_is_refused_and_its_work_ended():
    """The bound ends the computation (its process), so slow requests cannot pile up."""
    server = LabServer("127.0.0.1", 0, compute_limit_s=0.05)
    server.serve_in_thread()
    try:
        children, descendants = _children(os.getpid()), _descendants()
        assert refused_within(server, "/api/plan?gpus=16384", 1) == (
            "this request takes more than 0.05 s to compute, the lab's bound on one request: "
            "give more of the settings (layout, schedule, microbatches), open a smaller trace, or "
            "run `fourd plan` or `fourd sim step`, which have no such bound"
        )
        assert _children(os.getpid()) == children
        deadline = time.monotonic() + 10  # the kernel reaps the killed process for the lab's helper
        while not _descendants() <= descendants and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _descendants() <= descendants  # the computing process was killed and reaped
        assert request(server, "GET", "/api/schedule?p=4&m=4")[0] == 200  # in the thread, cached
    finally:
        server.shutdown()
        server.server_close()


def test_an_answer_is_computed_by_a_child_of_the_labs_helper_never_by_a_fork_of_the_lab():
    """A child forked from the lab's multi-threaded process would inherit the locks and descriptors
    its other threads held at that moment (and could wait on them for ever): every process that
    computes an answer is a child of the lab's helper (fourd.lab.forker), none is this process's, and
    the helper ends with the server."""
    server = LabServer("127.0.0.1", 0, compute_limit_s=30.0)
    server.serve_in_thread()
    helper = server._forker._helper.pid
    try:
        children, descendants = _children(os.getpid()), _descendants()
        assert helper in children
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(request, server, "GET", "/api/plan?gpus=16384")
            seen_children, seen_descendants = set(), set()
            while not answer.done():
                seen_children |= _children(os.getpid()) - children
                seen_descendants |= _children(helper) - descendants
                time.sleep(0.005)
            assert answer.result()[0] == 200
        assert seen_descendants and not seen_children
    finally:
        server.shutdown()
        server.server_close()
    assert helper not in _children(os.getpid())


def test_a_helper_that_died_is_started_again_and_the_next_answer_comes():
    server = LabServer("127.0.0.1", 0, compute_limit_s=30.0)
    server.serve_in_thread()
    try:
        first = server._forker._helper
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        status, _, body = request(server, "GET", "/api/plan?model=debug&gpus=8")
        assert status == 200 and json.loads(body)["plan"]["gpus"] == 8
        assert server._forker._helper.pid != first.pid
    finally:
        server.shutdown()
        server.server_close()


def _children(pid: int) -> set[int]:
    """The child processes of `pid` (zombies included), from every thread's list in /proc."""
    lists = Path(f"/proc/{pid}/task").glob("*/children")
    with contextlib.suppress(FileNotFoundError):  # a process that ended while being read
        return {int(child) for f in lists for child in f.read_text().split()}
    return set()


def _descendants() -> set[int]:
    """Every process below this one: its children, theirs, and so on."""
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = set().union(*(_children(pid) for pid in frontier)) - found
        found |= frontier
    return found
