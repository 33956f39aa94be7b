"""The lab's computing processes, forked one per request by a helper process that runs no threads.

A child forked from a process with threads inherits every lock another thread held at that moment (a
module being imported, a stream being written) and can wait on it for ever, and every descriptor the
process had open. The lab answers from threads, so it never forks itself: it starts this helper, a
fresh interpreter that imports the API once and then only waits for requests. For each request the
lab hands the helper one end of a new socket pair with the request; the helper forks a child that
writes its pid, then the answer, into that socket and exits. The lab reads its own end with a deadline
and kills the child past it. The helper ignores SIGCHLD, so the kernel reaps its children, and it ends
when the lab closes it or is gone.

Where there is no fork (Windows) the answer is computed in the calling thread, unbounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import fourd
from fourd.errors import FourdError
from fourd.lab import api

_PID = struct.Struct("!q")  # the child's first bytes: its process id
_MAX_REQUEST = 1 << 16  # an endpoint name, at most 32 query parameters and a folder's path
_POLL_S = 1.0  # how often the helper checks that the lab is still there
_START_S = 120.0  # for the helper to import the API, on the busiest machine
_READY = b"ready"
# the kind byte before an answer's payload
_ANSWER, _REFUSED, _BUG = b"0", b"1", b"2"


class TooLong(Exception):
    """The computation outlasted its limit; its process was killed."""


def json_bytes(obj) -> bytes:
    """The lab's JSON: compact, and no NaN or infinity (which JSON does not have)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def answer_bytes(endpoint: str, query: dict[str, str], trace_dir: Path) -> bytes:
    """The JSON of API `endpoint`'s answer to `query`, as the lab sends it."""
    return json_bytes(api.ENDPOINTS[endpoint](query, trace_dir=trace_dir))


class Forker:
    """The lab's side of the helper: `compute` sends it one request and waits for the answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one sender at a time on the control socket
        self._control: socket.socket | None = None
        self._helper: subprocess.Popen | None = None
        if hasattr(os, "fork"):
            self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        root = str(Path(fourd.__file__).resolve().parents[1])  # this fourd, whatever the path
        command = (
            f"import sys; sys.path.insert(0, {root!r}); "
            f"from fourd.lab.forker import serve; serve({theirs.fileno()})"
        )
        with theirs:
            self._helper = subprocess.Popen(
                [sys.executable, "-c", command],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # it prints nothing; its errors, if any, go to stderr
            )
        self._control = ours
        if not select.select([ours], [], [], _START_S)[0] or ours.recv(16) != _READY:
            self.close()
            raise FourdError(
                f"the lab's computing process did not start within {_START_S:g} s: check that "
                f"`{sys.executable} -c 'import fourd.lab.api'` runs"
            )

    def compute(
        self, endpoint: str, query: dict[str, str], trace_dir: Path, limit_s: float
    ) -> bytes:
        """The answer's bytes, computed in a child of the helper that is killed after `limit_s`
        seconds (TooLong); the child's FourdError is raised here as it was, any other exception as
        a RuntimeError with its one line."""
        if self._control is None:
            return answer_bytes(endpoint, query, trace_dir)
        request = pickle.dumps((endpoint, query, trace_dir))
        mine, child_end = socket.socketpair()
        with mine:
            with child_end, self._lock:
                self._send(request, child_end.fileno())
            out = _receive(mine, time.monotonic() + limit_s)
        if out[:1] == _ANSWER:
            return out[1:]
        if out[:1] == _REFUSED:
            raise FourdError(out[1:].decode())
        raise RuntimeError(out[1:].decode() or "the computing process ended without an answer")

    def _send(self, request: bytes, fd: int) -> None:
        """Hand the helper one request and the child's end of its socket; a helper that has died
        (killed, out of memory) is started again first."""
        assert self._control is not None and self._helper is not None
        try:
            socket.send_fds(self._control, [request], [fd])
        except OSError:
            if self._helper.poll() is None:  # alive: the error is not its absence
                raise
            self._control.close()
            self._start()
            assert self._control is not None
            socket.send_fds(self._control, [request], [fd])

    def close(self) -> None:
        """End the helper; its children end with their answers or at their deadlines."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._helper is not None:
            self._helper.terminate()
            self._helper.wait(timeout=10)
            self._helper = None


def _receive(conn: socket.socket, deadline: float) -> bytes:
    """What the child writes until it closes its end, less its pid. Past `deadline` the child is
    killed (TooLong)."""
    data = bytearray()
    pid = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([conn], [], [], left)[0]:
            if pid:
                _kill(pid)
            raise TooLong
        chunk = conn.recv(1 << 20)
        if not chunk:
            return bytes(data[_PID.size :])
        data += chunk
        if not pid and len(data) >= _PID.size:
            (pid,) = _PID.unpack_from(data)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
        os.kill(pid, signal.SIGKILL)


def serve(control_fd: int) -> None:
    """The helper's loop: fork a child for each request until the lab closes the control socket or
    is gone (checked every _POLL_S)."""
    # Every child starts from what this process has loaded: the API's modules, and the presets and
    # interval tables a first answer reads (one small plan, about 0.1 s, saves each child 12 ms).
    answer_bytes("plan", {"model": "debug", "gpus": "1"}, Path("."))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the lab's to handle
    lab = os.getppid()
    control = socket.socket(fileno=control_fd)
    control.send(_READY)
    while os.getppid() == lab:
        if not select.select([control], [], [], _POLL_S)[0]:
            continue
        try:
            request, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST, 1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        except ConnectionError:  # the lab closed its end
            return
        if not fds:
            return  # an empty datagram: the lab closed its end
        if os.fork() == 0:
            control.close()
            _child(request, fds[0])
        os.close(fds[0])


def _child(request: bytes, fd: int) -> None:
    """Compute one request and write the pid, the kind byte and the payload to `fd`; never
    returns."""
    try:
        with socket.socket(fileno=fd) as conn:
            conn.sendall(_PID.pack(os.getpid()))
            try:
                out = _ANSWER + answer_bytes(*pickle.loads(request))
            except FourdError as e:
                out = _REFUSED + str(e).encode()
            except BaseException as e:  # noqa: BLE001 (sent to the lab, which answers 500)
                out = _BUG + f"{type(e).__name__}: {e}".encode()
            conn.sendall(out)
    finally:
        os._exit(0)  # no exit handlers: they belong to the helper
