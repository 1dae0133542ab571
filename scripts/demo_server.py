"""The demo's engine: xllamacpp's llama-server (llama.cpp's server in a prebuilt wheel) serving MODEL
over HTTP on 127.0.0.1:PORT, run in this process, which is the PID the profiler attaches to.

    python scripts/demo_server.py MODEL --port PORT [--threads N]

Prints {"ready": <pid>, "url": "http://127.0.0.1:PORT"} once listening, then serves until stdin
closes (scripts/demo.py starts and stops it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import xllamacpp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    params = xllamacpp.CommonParams()
    params.model.path = a.model
    params.n_ctx = 2048
    params.n_parallel = 1
    params.cpuparams.n_threads = a.threads
    params.cpuparams_batch.n_threads = a.threads
    params.warmup = False  # the profiler sees the prompts' passes only
    params.port = a.port
    server = xllamacpp.Server(params)
    print(json.dumps({"ready": os.getpid(), "url": server.listening_address}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
