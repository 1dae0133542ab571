"""A real llama-cpp-python engine process for the tests, with its own in-process ground truth.

Protocol on stdin/stdout (one JSON object per line):
  engine prints {"ready": pid}                  after the model is loaded
  test sends   {"prompts": [...], "max_tokens": N, "temp": T, "seed": S}
  engine prints {"results": [{"ids": [...], "log_probs": [...]}, ...]}
  test sends   {"exit": true}  (or closes stdin)

Ground truth: token ids are what Llama.generate() yielded; log-probs are the log-softmax of the
raw logits row it sampled from (llm.scores, which needs logits_all=True).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from llama_cpp import Llama


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--no-logits-all", action="store_true")
    ap.add_argument("--n-batch", type=int, default=512, help="n_batch and n_ubatch")
    a = ap.parse_args()
    llm = Llama(
        model_path=a.model,
        n_ctx=a.n_ctx,
        n_batch=a.n_batch,
        n_ubatch=a.n_batch,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        seed=1,
        logits_all=not a.no_logits_all,
        verbose=False,
    )
    print(json.dumps({"ready": os.getpid(), "n_vocab": llm.n_vocab()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        results = []
        for prompt in cmd["prompts"]:
            llm.set_seed(int(cmd.get("seed", 1)))
            toks = llm.tokenize(prompt.encode())
            ids: list[int] = []
            lps: list[float] = []
            times: list[int] = []  # when each token reached the caller (for the overhead benchmark)
            temp = float(cmd.get("temp", 0.0))
            for t in llm.generate(toks, top_k=1 if temp == 0 else 40, temp=temp, reset=True):
                times.append(time.perf_counter_ns())
                ids.append(int(t))
                if not a.no_logits_all:
                    row = llm.scores[llm.n_tokens - 1]
                    lps.append(float(log_softmax(row)[t]))
                if len(ids) >= int(cmd["max_tokens"]) or t == llm.token_eos():
                    break
                if cmd.get("token_delay"):  # a slow client, so a test can attach mid-request
                    time.sleep(float(cmd["token_delay"]))
            results.append({"prompt_tokens": toks, "ids": ids, "log_probs": lps, "times_ns": times})
        print(json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    main()
