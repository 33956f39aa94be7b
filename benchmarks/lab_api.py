"""How long the lab takes to answer: API latency over a real socket, and a full page render in headless
Chromium (first request to the readouts in the DOM).

    .venv/bin/python benchmarks/lab_api.py
"""

from __future__ import annotations

import http.client
import shutil
import statistics
import subprocess
import tempfile
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


def main():
    server = LabServer("127.0.0.1", 0)
    server.serve_in_thread()
    host, port = server.server_address[:2]
    print("| request | first ms | again ms (median of 6) | bytes |\n|---|---|---|---|")
    for label, target in REQUESTS.items():
        times, size = [], 0
        for _ in range(7):
            conn = http.client.HTTPConnection(host, port)
            t = time.perf_counter()
            conn.request("GET", target)
            resp = conn.getresponse()
            size = len(resp.read())
            times.append(time.perf_counter() - t)
            assert resp.status == 200, (target, resp.status)
            conn.close()
        print(f"| {label} | {1000 * times[0]:.1f} | {1000 * statistics.median(times[1:]):.1f} | {size:,} |")
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
