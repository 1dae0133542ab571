"""The llama.cpp section of the GPU check (scripts/gpu_check.sh --llamacpp): the CUDA build of
llama.cpp made by scripts/build_llamacpp_cuda.sh, on a GPU machine, with the project's GPU path.

Needs: the package build/llamacpp-cuda-b<BUILD>.tar.xz (and its MANIFEST.json) carried from the
build machine, cupti_ext/build/ (the injection library), the CUDA 13 libraries the package needs
(found in the Python's site-packages/nvidia/cu13/lib, as PyTorch installs them), and the project's
Python side (polars, gguf, rich: build/gpu_pydeps.tar.xz, which gpu_check.sh unpacks).

What it does, in order:
1. unpacks the package and checks that every library it needs resolves (ldd), with
   LD_LIBRARY_PATH = the CUDA 13 libraries' folder;
2. generates the MoE test model (sparseety_prof.synthetic, preset "moe": 8 experts, top-2);
3. tokens/s with and without tracing, interleaved: per round, llama-server started plain ("off"),
   under `sparseety-prof launch` ("kernels": activity only) and under `launch --preset llamacpp`
   ("buffers": plus the watched top-k buffers), each timing one greedy completion after a warm-up
   one (the server's own `timings.predicted_per_second`), modes in rotating order;
4. a recording: the server under `launch --preset llamacpp`, `sparseety-prof record --pid` while
   one greedy completion runs (n_probs 1, the server's own token ids and log-probs);
5. the GPU oracle (llamacpp-gpu-oracle, the same build in its own process, teacher-forced with the
   prompt's and the answer's tokens; its eval callback copies each layer's top-k ids back from the
   device): the server's tokens equal the oracle's greedy choices, its log-probs within 1e-4 of
   the oracle's, and the recording's `routes` (first n_expert_used ids of each row) equal the
   oracle's expert ids per (position, layer);
6. the recording's kernels: how they were joined to steps (by thread where the host uprobes gave
   steps, gpu_step where only CUPTI did), the watched kernels all captured, losses.
Prints one JSON object and writes it under --results as <date>-<device>-llamacpp.json; exit 0 when
every check passed, 1 when one failed, 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "gpu_check"
LIB = ROOT / "cupti_ext" / "build" / "libsparseety_cupti.so"
PROMPT = "the expert routes every token of the model to the"
N_GPU_LAYERS = 99
LOGPROB_TOL = 1e-4
CLI = [sys.executable, "-m", "sparseety_prof.cli"]


def fail(msg: str) -> NoReturn:
    print(json.dumps({"ok": False, "error": msg}))
    sys.exit(2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cuda_lib_dir() -> Path | None:
    """site-packages/nvidia/cu13/lib of any interpreter path entry that has libcudart.so.13."""
    for entry in sys.path:
        d = Path(entry) / "nvidia" / "cu13" / "lib"
        if (d / "libcudart.so.13").exists():
            return d
    return None


def unpack(package: Path, into: Path) -> Path:
    with tarfile.open(package) as t:
        t.extractall(into, filter="data")
    return into / "bin"


def unresolved(binary: Path, env: dict[str, str]) -> list[str]:
    r = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, timeout=60)
    return [line.split()[0] for line in r.stdout.splitlines() if "not found" in line]


# ---------------------------------------------------------------- the server


#: how the server is started per mode: plain, or under `launch` with these flags
MODES: dict[str, list[str] | None] = {
    "off": None,
    "kernels": ["--flush-ms", "100"],
    "buffers": ["--preset", "llamacpp", "--flush-ms", "100"],
}
RECORD_LAUNCH = ["--preset", "llamacpp", "--flush-ms", "50"]


def server_argv(bindir: Path, model: Path, port: int, launch: list[str] | None) -> list[str]:
    argv = [
        str(bindir / "llama-server"),
        *("-m", str(model), "-ngl", str(N_GPU_LAYERS), "--port", str(port)),
        *("-np", "1", "-c", "2048", "--no-warmup"),
    ]
    return argv if launch is None else [*CLI, "launch", *launch, "--", *argv]


def plan(bindir: Path, model: Path) -> dict[str, Any]:
    """The commands the check runs (--dry-run), with placeholder ports and pids."""
    return {
        "throughput_modes": {m: server_argv(bindir, model, 8080, f) for m, f in MODES.items()},
        "record": {
            "server": server_argv(bindir, model, 8080, RECORD_LAUNCH),
            "record": [*CLI, "record", "--pid", "PID", "-o", "REC"],
        },
        "oracle": [str(bindir / "llamacpp-gpu-oracle"), str(model), str(N_GPU_LAYERS), "TOKENS_FILE"],
    }


class Server:
    """llama-server on the test model, started plain or under `sparseety-prof launch`."""

    def __init__(
        self, bindir: Path, model: Path, env: dict[str, str], log: Path, launch: list[str] | None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = server_argv(bindir, model, self.port, launch)
        self.argv = argv
        self.log = log
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited {self.proc.returncode}: {self.log.read_text()[-1500:]}"
                )
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"llama-server not ready within {timeout_s:.0f} s")

    def engine_pid(self) -> int:
        """The llama-server process: `launch` starts it as its child and says its pid ("started
        pid N"); started plain, the process itself."""
        if self.argv[: len(CLI)] != CLI:
            return self.proc.pid
        m = re.search(r"started pid (\d+)", self.log.read_text())
        if m is None:
            raise RuntimeError(f"`launch` did not say the engine's pid: {self.log.read_text()[-800:]}")
        return int(m.group(1))

    def post(self, path: str, body: dict[str, Any], timeout: float = 300) -> Any:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def completion(self, n: int, n_probs: int = 0) -> dict[str, Any]:
        """A greedy completion: token ids, log-probs and timings. Builds before 2026.10 answer HTTP
        500 on this random-weight model's output unless streamed (tests/test_build_matrix.py)."""
        body = {"prompt": PROMPT, "n_predict": n, "temperature": 0, "ignore_eos": True, "return_tokens": True}
        if n_probs:
            body["n_probs"] = n_probs
        try:
            whole = self.post("/completion", body)
            return {k: whole.get(k) for k in ("tokens", "completion_probabilities", "timings")} | {
                "complete": True
            }
        except urllib.error.HTTPError as e:
            if e.code != 500:
                raise
        out: dict[str, Any] = {
            "tokens": [],
            "completion_probabilities": [],
            "timings": None,
            "complete": False,
        }
        req = urllib.request.Request(
            self.url + "/completion",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    break
                out["tokens"] += chunk.get("tokens", [])
                out["completion_probabilities"] += chunk.get("completion_probabilities", [])
                if chunk.get("timings"):
                    out["timings"] = chunk["timings"]
                if chunk.get("stop"):
                    break
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------- comparisons (tested without a GPU)


def read_oracle(text: str) -> dict[str, Any]:
    """The oracle's JSON lines: ids per (position, layer), log-prob and greedy choice per position."""
    ids: dict[tuple[int, int], list[int]] = {}
    logprob: dict[int, float] = {}
    argmax: dict[int, int] = {}
    errors: list[str] = []
    for line in text.splitlines():
        r = json.loads(line)
        if r["kind"] == "moe":
            for pos, row in zip(r["positions"], r["ids"], strict=True):
                ids[(pos, r["layer"])] = row
        elif r["kind"] == "logprob":
            logprob[r["pos"]] = r["logprob"]
            argmax[r["pos"]] = r["argmax"]
        elif r["kind"] == "error":
            errors.append(r["error"])
    return {"ids": ids, "logprob": logprob, "argmax": argmax, "errors": errors}


def compare_answer(
    prompt_tokens: list[int], answer: dict[str, Any], oracle: dict[str, Any]
) -> dict[str, Any]:
    """The server's greedy tokens against the oracle's choices, its log-probs against the oracle's
    (log p(token i | tokens before i) is the oracle's row i - 1)."""
    n0 = len(prompt_tokens)
    tokens = list(answer["tokens"])
    choices = [oracle["argmax"].get(n0 + i - 1) for i in range(len(tokens))]
    diffs = []
    by_id = list(answer.get("completion_probabilities") or [])
    j = 0
    for i, t in enumerate(tokens):  # a token ending inside a UTF-8 character has no entry of its own
        if j < len(by_id) and by_id[j].get("id") == t and "logprob" in by_id[j]:
            ref = oracle["logprob"].get(n0 + i - 1)
            if ref is not None:
                diffs.append(abs(float(by_id[j]["logprob"]) - ref))
            j += 1
    return {
        "answer_tokens": len(tokens),
        "tokens_equal_oracle": bool(tokens) and tokens == choices,
        "logprobs_compared": len(diffs),
        "logprob_max_abs_diff": max(diffs) if diffs else None,
        "logprobs_within_tol": bool(diffs) and max(diffs) <= LOGPROB_TOL,
    }


def positions_of_steps(steps: list[tuple[int, int]], n_prompt: int) -> dict[int, int]:
    """Recorded step id -> the position of its row 0, for one sequence served alone: `steps` are
    (step_id, rows) in execution order; the prompt's step is the first with n_prompt rows (a step
    before it is not this request's), each later step one position on."""
    out: dict[int, int] = {}
    pos = None
    for step_id, rows in steps:
        if pos is None:
            if rows != n_prompt:
                continue
            pos = 0
        out[step_id] = pos
        pos += rows
    return out


def compare_routes(
    rows: list[tuple[int, int, int, list[int]]],
    chronological_steps: list[int],
    n_prompt: int,
    k: int,
    oracle_ids: dict[tuple[int, int], list[int]],
) -> dict[str, Any]:
    """`routes` rows (step_id, row, layer, expert_ids) against the oracle's ids per (position,
    layer): the first k ids of each recorded row (llama.cpp's rows rank every expert). A layer with
    fewer rows than its step ran only on the rows that give logits (llama.cpp's last layer, after
    get_rows(inp_out_ids)): for one sequence those are the step's last rows."""
    per_step: dict[int, int] = {}
    per_layer: dict[tuple[int, int], int] = {}
    for step_id, row, layer, _ids in rows:
        per_step[step_id] = max(per_step.get(step_id, 0), row + 1)
        per_layer[(step_id, layer)] = max(per_layer.get((step_id, layer), 0), row + 1)
    start = positions_of_steps([(s, per_step[s]) for s in chronological_steps if s in per_step], n_prompt)
    recorded: dict[tuple[int, int], list[int]] = {}
    for step_id, row, layer, ids in rows:
        if step_id in start:
            skipped = per_step[step_id] - per_layer[(step_id, layer)]
            recorded[(start[step_id] + skipped + row, layer)] = list(ids)[:k]
    both = sorted(set(recorded) & set(oracle_ids))
    differ = [key for key in both if recorded[key] != oracle_ids[key][:k]]
    same_set = [key for key in differ if sorted(recorded[key]) == sorted(oracle_ids[key][:k])]
    return {
        "routes_pairs": len(recorded),
        "routes_pairs_compared": len(both),
        "routes_pairs_equal": len(both) - len(differ),
        "routes_pairs_rank_swapped": len(same_set),  # same experts, other order (a tie)
        "routes_first_difference": list(differ[0]) if differ else None,
        "routes_row_width": len(rows[0][3]) if rows else None,
        "routes_equal_oracle": bool(both) and not differ,
    }


# ---------------------------------------------------------------- the cases


def throughput(
    bindir: Path, model: Path, env: dict[str, str], tmp: Path, rounds: int, n: int
) -> dict[str, Any]:
    modes = MODES
    runs: dict[str, list[float]] = {m: [] for m in modes}
    names = list(modes)
    for rnd in range(rounds):
        for i in range(len(names)):
            mode = names[(rnd + i) % len(names)]  # rotating order
            srv = Server(bindir, model, env, tmp / f"tps-{mode}-{rnd}.log", modes[mode])
            try:
                srv.wait_ready()
                srv.completion(n)  # warm-up: CUDA graphs captured, kernels loaded
                t = srv.completion(n).get("timings") or {}
                runs[mode].append(float(t.get("predicted_per_second") or 0.0))
            finally:
                srv.stop()
    med = {m: statistics.median(v) for m, v in runs.items() if v}
    return {
        "tokens_per_s_runs": runs,
        "tokens_per_s_median": med,
        "slowdown_vs_off": {m: round(med[m] / med["off"], 4) for m in med if m != "off" and med.get("off")},
    }


def record_case(bindir: Path, model: Path, env: dict[str, str], tmp: Path, n: int) -> dict[str, Any]:
    rec = tmp / "rec"
    srv = Server(bindir, model, env, tmp / "server.log", RECORD_LAUNCH)
    result: dict[str, Any] = {"server": " ".join(srv.argv[2:])}
    rec_log = tmp / "record.log"
    rec_proc: subprocess.Popen[bytes] | None = None
    try:
        srv.wait_ready()
        prompt_tokens = srv.post("/tokenize", {"content": PROMPT, "add_special": True})["tokens"]
        cmd = [*CLI, "record", "--pid", str(srv.engine_pid()), "-o", str(rec)]
        result["record"] = " ".join(cmd[2:])
        with open(rec_log, "w") as f:
            rec_proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while "attached to PID" not in rec_log.read_text():
            if rec_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"record did not attach: {rec_log.read_text()[-1500:]}")
            time.sleep(0.1)
        answer = srv.completion(n, n_probs=1)
        time.sleep(1.0)  # the last activity buffers flushed (--flush-ms 50)
        rec_proc.send_signal(signal.SIGINT)
        result["record_exit_code"] = rec_proc.wait(timeout=120)
    finally:
        if rec_proc is not None and rec_proc.poll() is None:
            rec_proc.kill()
        srv.stop()
    result["record_log"] = rec_log.read_text()[-1500:]
    result["prompt_tokens"] = prompt_tokens
    result["answer"] = answer
    return result


def analyse_recording(rec: Path, prompt_tokens: list[int], k: int, oracle: dict[str, Any]) -> dict[str, Any]:
    import sparseety_prof

    r = sparseety_prof.open(rec)
    routes = r.routes()
    kernels = r.kernels()
    steps = sorted(set(routes["step_id"].to_list()))
    # host step ids count up; GPU-only steps (gpu_step) count down from -1
    chronological = steps if all(s >= 0 for s in steps) else sorted(steps, reverse=True)
    rows = list(zip(*(routes[c].to_list() for c in ("step_id", "row", "layer", "expert_ids")), strict=True))
    watched = kernels.filter(kernels["name"].str.contains("topk_moe_cuda|k_argsort_f32_i32"))
    gpu_meta = r.meta.get("gpu", {})
    return compare_routes(rows, chronological, len(prompt_tokens), k, oracle["ids"]) | {
        "kernels_rows": kernels.height,
        "kernel_joins": {
            str(j): n
            for j, n in zip(*kernels["join"].value_counts().to_dict(as_series=False).values(), strict=True)
        },
        "watched_kernel_rows": watched.height,
        "watched_kernels_captured": int(watched["buffer_captured"].sum()) if watched.height else 0,
        "watched_graph_kernels": int(watched["graph_id"].is_not_null().sum()) if watched.height else 0,
        "join_mode": gpu_meta.get("join_mode"),
        "losses": r.meta.get("losses"),
        "layer_coverage": r.meta.get("layer_coverage"),
    }


def device_facts() -> dict[str, Any]:
    r = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    name, _, driver = (r.stdout.strip().splitlines() or [""])[0].partition(", ")
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": name or "unknown",
        "driver": driver or None,
    }


def write_results(report: dict[str, Any], results: Path) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    stamp = str(report["date"]).replace(":", "").replace("+0000", "Z")
    device = re.sub(r"[^A-Za-z0-9]+", "-", str(report["device"])).strip("-").lower()
    path = results / f"{stamp}-{device}-llamacpp.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", type=Path, help="llamacpp-cuda-b<BUILD>.tar.xz (default: the one in build/)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each tracing mode, rotating (default 3)")
    ap.add_argument("--n-predict", type=int, default=128, help="tokens per timed completion (default 128)")
    ap.add_argument(
        "--record-tokens", type=int, default=32, help="tokens of the recorded completion (default 32)"
    )
    ap.add_argument("--results", type=Path, default=RESULTS, help=f"folder for the JSON (default {RESULTS})")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the commands it would run, as JSON, and exit (no GPU needed)",
    )
    args = ap.parse_args()
    if args.dry_run:
        print(json.dumps(plan(Path("PKG/bin"), Path("MODEL.gguf")), indent=1))
        return 0
    t0 = time.monotonic()
    if not (Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()):
        fail("no GPU on this machine: run this on the GPU machine")
    package = args.package or next(iter(sorted((ROOT / "build").glob("llamacpp-cuda-b*.tar.xz"))), None)
    if package is None or not package.exists():
        fail("no build/llamacpp-cuda-b*.tar.xz: build it with scripts/build_llamacpp_cuda.sh and carry it")
    if not LIB.exists():
        fail(f"{LIB} is not built (bash cupti_ext/build.sh) or was not carried")
    cu = cuda_lib_dir()
    if cu is None:
        fail("no site-packages/nvidia/cu13/lib with libcudart.so.13 on this Python's path")
    report: dict[str, Any] = device_facts() | {"package": package.name, "cuda_libraries": str(cu)}
    manifest = package.with_name(package.name.replace(".tar.xz", ".manifest.json"))
    if manifest.exists():
        report["manifest"] = {
            k: v
            for k, v in json.loads(manifest.read_text()).items()
            if k in ("revision", "nvcc", "archive_bytes")
        }
    tmp = Path(tempfile.mkdtemp(prefix="sparseety-gpucheck-llamacpp-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARSEETY_", "CUDA_INJECTION64"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(cu), os.environ.get("LD_LIBRARY_PATH")) if p)
    env["SPARSEETY_CUPTI_LIB"] = str(LIB)
    try:
        bindir = unpack(package, tmp / "pkg")
        missing = unresolved(bindir / "llama-server", env) + unresolved(bindir / "llamacpp-gpu-oracle", env)
        report["unresolved_libraries"] = sorted(set(missing))
        if missing:
            raise RuntimeError(f"libraries not found: {sorted(set(missing))}")
        # a C or C++ runtime older than the package's (GLIBC_2.34, GLIBCXX_3.4.30) fails here
        v = subprocess.run(
            [str(bindir / "llama-server"), "--version"], env=env, capture_output=True, text=True, timeout=60
        )
        report["server_version"] = (v.stdout + v.stderr).strip()[-400:]
        if v.returncode != 0:
            raise RuntimeError(f"llama-server --version exited {v.returncode}")
        model = tmp / "moe.gguf"
        subprocess.run(
            [sys.executable, "-m", "sparseety_prof.synthetic", str(model), "--preset", "moe"],
            env=env,
            check=True,
            capture_output=True,
            timeout=300,
        )
        from sparseety_prof.synthetic import PRESETS

        k = PRESETS["moe"].n_expert_used
        rec = record_case(bindir, model, env, tmp, args.record_tokens)
        report["record"] = {key: v for key, v in rec.items() if key != "answer"}
        tokens = [*rec["prompt_tokens"], *rec["answer"]["tokens"]]
        (tmp / "tokens.txt").write_text(" ".join(map(str, tokens)))
        o = subprocess.run(
            [str(bindir / "llamacpp-gpu-oracle"), str(model), str(N_GPU_LAYERS), str(tmp / "tokens.txt")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        oracle = read_oracle(o.stdout)
        report["oracle"] = {
            "exit_code": o.returncode,
            "errors": oracle["errors"],
            "pairs": len(oracle["ids"]),
        }
        report["answer"] = compare_answer(rec["prompt_tokens"], rec["answer"], oracle) | {
            "complete": rec["answer"]["complete"]
        }
        if rec.get("record_exit_code") in (0, 130):
            report["recording"] = analyse_recording(tmp / "rec", rec["prompt_tokens"], k, oracle)
        report["throughput"] = throughput(bindir, model, env, tmp, args.rounds, args.n_predict)
    except Exception as e:  # every failure goes into the JSON that is kept
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    recd = report.get("recording", {})
    report["checks"] = {
        "tokens_equal_oracle": report.get("answer", {}).get("tokens_equal_oracle") is True,
        "logprobs_within_1e-4": report.get("answer", {}).get("logprobs_within_tol") is True,
        "expert_ids_equal_oracle": recd.get("routes_equal_oracle") is True,
        "watched_kernels_captured": bool(recd.get("watched_kernel_rows"))
        and recd.get("watched_kernel_rows") == recd.get("watched_kernels_captured"),
        "kernels_joined_by_thread": bool(recd.get("kernel_joins", {}).get("thread")),
        "throughput_measured": bool(report.get("throughput", {}).get("slowdown_vs_off")),
    }
    report["ok"] = all(report["checks"].values()) and "error" not in report
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    path = write_results(report, args.results)
    print(json.dumps(report, indent=1))
    print(f"kept: {path}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
