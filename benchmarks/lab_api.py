"""How long the lab takes to answer: API latency over a real socket, the same while 300 slow clients hold
connections open, and a full page render in headless Chromium (first request to the readouts in the DOM).

    .venv/bin/python benchmarks/lab_api.py
"""

from __future__ import annotations

import http.client
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time

from fourd.lab.server import LabServer

REQUESTS = {
    "bench p=16 m=16 gpipe": "/api/schedule?p=16&m=16&schedule=gpipe",
    "bench p=16 m=64 zero-bubble": "/api/schedule?p=16&m=64&schedule=zero-bubble",
    "bench p=16 m=64 interleaved V=8 (largest)": "/api/schedule?p=16&m=64&schedule=interleaved&v=8",
    "cluster row tp=8,pp=16,dp=128": "/api/cluster?layout=tp%3D8%2Cpp%3D16%2Cdp%3D128",
    "planner 405B on 16,384 GPUs, layout given": "/api/plan?model=llama3-405b&gpus=16384&layout=tp%3D8%2Cpp%3D16%2Cdp%3D128"
    "&schedule=interleaved&microbatches=16&seq=8192",
    "static app.js": "/app.js",
}
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def timed(host: str, port: int, target: str) -> tuple[float, int]:
    """Seconds to the whole answer of one GET, and its size."""
    conn = http.client.HTTPConnection(host, port)
    t = time.perf_counter()
    conn.request("GET", target)
    resp = conn.getresponse()
    size = len(resp.read())
    elapsed = time.perf_counter() - t
    assert resp.status == 200, (target, resp.status)
    conn.close()
    return elapsed, size


def main():
    server = LabServer("127.0.0.1", 0)
    server.serve_in_thread()
    host, port = server.server_address[:2]
    print("| request | first ms | again ms (median of 6) | bytes |\n|---|---|---|---|")
    for label, target in REQUESTS.items():
        runs = [timed(host, port, target) for _ in range(7)]
        times = [t for t, _ in runs]
        print(
            f"| {label} | {1000 * times[0]:.1f} | {1000 * statistics.median(times[1:]):.1f} | {runs[-1][1]:,} |"
        )
    slow = [socket.create_connection((host, port)) for _ in range(300)]
    for s in slow:
        s.sendall(
            f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
        )  # and never the blank line
    during = [timed(host, port, REQUESTS["bench p=16 m=16 gpipe"])[0] for _ in range(7)]
    print(
        f"\nwith 300 slow clients connected: bench p=16 m=16 gpipe in {1000 * statistics.median(during):.1f} ms "
        f"(median of 7); {threading.active_count()} threads in this process"
    )
    for s in slow:
        s.close()
    chromium = shutil.which("chromium")
    if chromium:
        with tempfile.TemporaryDirectory() as profile:
            runs = []
            for _ in range(3):
                t = time.perf_counter()
                dom = subprocess.run(
                    [
                        chromium,
                        *FLAGS,
                        f"--user-data-dir={profile}",
                        "--virtual-time-budget=5000",
                        "--dump-dom",
                        f"{server.url}?p=16&m=16&schedule=gpipe",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=60,
                ).stdout
                runs.append(time.perf_counter() - t)
                assert '<output id="idle">48.4 %</output>' in dom
        print(
            f"\nchromium --dump-dom of /?p=16&m=16&schedule=gpipe (browser start included): "
            f"median {statistics.median(runs):.2f} s"
        )
    server.shutdown()


if __name__ == "__main__":
    main()
