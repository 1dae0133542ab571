"""A real llama-server engine (xllamacpp) for the tests: serves HTTP on 127.0.0.1:PORT.
Prints {"ready": pid, "url": ...} once listening, then serves until stdin closes."""

from __future__ import annotations

import argparse
import json
import os
import sys

import xllamacpp as x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=2048)
    a = ap.parse_args()
    p = x.CommonParams()
    p.model.path = a.model
    p.n_ctx = a.n_ctx
    p.n_parallel = a.parallel
    p.cpuparams.n_threads = a.threads
    p.cpuparams_batch.n_threads = a.threads
    p.warmup = False
    p.port = a.port
    server = x.Server(p)
    print(json.dumps({"ready": os.getpid(), "url": server.listening_address}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
