"""A built llama-server executable as a test engine: starts BINARY on the model, waits until it
answers /health, prints {"ready": <its pid>, "url": ...}, and stops it when stdin closes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=2048)
    a = ap.parse_args()
    cmd = [a.binary, "-m", a.model, "--port", str(a.port), "--host", "127.0.0.1", "-t", str(a.threads)]
    cmd += ["-np", str(a.parallel), "-c", str(a.n_ctx), "--no-warmup"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{a.port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if p.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"llama-server did not come up (exit {p.poll()})")
        time.sleep(0.2)
    print(json.dumps({"ready": p.pid, "url": url}), flush=True)
    try:
        sys.stdin.read()
    finally:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


if __name__ == "__main__":
    main()
