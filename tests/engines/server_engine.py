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
    # secrets and prompts on the command line, as operators pass them (the redaction tests)
    ap.add_argument("--api-key", action="append", default=[])
    ap.add_argument("--system-prompt", default=None)
    ap.add_argument("--hf-token", default=None)
    a = ap.parse_args()
    p = x.CommonParams()
    p.model.path = a.model
    p.n_ctx = a.n_ctx
    p.n_parallel = a.parallel
    p.cpuparams.n_threads = a.threads
    p.cpuparams_batch.n_threads = a.threads
    p.warmup = False
    p.port = a.port
    if a.api_key:
        p.api_keys = a.api_key
    if a.system_prompt is not None:
        p.system_prompt = a.system_prompt
    if a.hf_token is not None:
        p.hf_token = a.hf_token
    server = x.Server(p)
    print(json.dumps({"ready": os.getpid(), "url": server.listening_address}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
