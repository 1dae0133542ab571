"""A real llama-cpp-python engine process for the tests, with its own in-process ground truth.

Protocol on stdin/stdout (one JSON object per line):
  engine prints {"ready": pid, "n_vocab": V, "llama_cpp_version": v, "libllama": path,
                "ggml_version": g}           after the model is loaded: which release and library
                                              file this process imported, and what that library's
                                              ggml_version() returns
  test sends   {"prompts": [...], "max_tokens": N, "temp": T, "seed": S}
  engine prints {"results": [{"prompt_tokens": [...], "ids": [...], "log_probs": [...],
                               "times_ns": [...], "t_request_ns": t}, ...]}
               (times_ns: when each token reached the caller; t_request_ns: when the prompt's
               processing began; both time.perf_counter_ns, CLOCK_MONOTONIC)
               optional "force": [{decode order: token id or "least"}, ...] (one dict per prompt,
               keys as strings): at those decode orders the sampler may return only that token
               ("least": the least likely token of the raw logits row), through a logits processor
               ahead of the greedy sampler, so the raw logits (and log_probs) stay the model's
  test sends   {"teacher_force": [{"prompt_ids": [...], "ids": [...]}, ...]}
  engine prints {"results": [{"prompt_tokens": [...], "ids": [...], "log_probs": [...]}, ...]}
  test sends   {"exit": true}  (or closes stdin)
A request may hold both "prompts" and "teacher_force"; the results are then the generations
followed by the teacher-forced items, in one "results" message.

Ground truth: token ids are what Llama.generate() yielded; log-probs are the log-softmax of the
raw logits row it sampled from (llm.scores, which needs logits_all=True).

Teacher forcing: for each item the KV cache is reset, the prompt ids are evaluated with one
Llama.eval (llama-cpp-python splits it into llama_decode calls of n_batch rows), then each id but
the last is evaluated alone, as a server's decode loop does (the last id is scored, never
evaluated, as in a generation that stops after it). log_probs[j] is the log-softmax of the logits
row just before ids[j] (the prompt's last row for j == 0), read with llama_get_logits_ith(ctx, -1),
so it works with and without logits_all.

Graph trace (--graph-trace PATH): llama.cpp's cb_eval graph callback
(ggml_backend_sched_eval_callback) is installed into the context. In the "ask" phase it answers
True only for the tensors below, so the scheduler splits the graph only there; in the "eval" phase
it reads them (host memory; this engine runs on the CPU) and writes JSON lines to PATH, flushed at
the end of every request, before the "results" message. The callback never raises into C: an
exception becomes an "error" line and the computation continues. With the same model, prompts,
seed and settings, a SEPARATE run gives the sparse decisions the eBPF profiler must reproduce
(tracing does not change ids or log-probs: the split graph computes the same ops; tested).

Trace lines (every line has "kind"):
  {"kind": "meta", "pid", "model", "arch", "n_layer", "n_expert", "n_expert_used", "n_ctx",
   "n_batch", "n_ubatch", "logits_all", "flash_attn", "threshold", "expert_weights_norm",
   "llama_cpp_version"}                                       first line
  {"kind": "request", "request": r, "item": i, "mode": "generate"|"teacher_force",
   "prompt_tokens": [...]}                                    before each prompt / forced item
  {"kind": "eval", "eval": e, "request": r, "item": i, "n_past": P, "n_batch_rows": U,
   "positions": [...], "output_positions": [...], "tokens": [...]}
        one per llama_decode call, written before it runs: positions and tokens are the llama_batch
        rows as passed to llama.cpp (pos[i] == P + i for this engine), output_positions those rows
        whose logits flag is set: all rows with logits_all, else the last row of EACH llama_decode
        (llama-cpp-python flags the last row of every n_batch chunk, prompt chunks included)
Per graph evaluation and layer L, common keys: "kind", "eval" (index of the eval line), "n_past"
(llm.n_tokens read inside the callback: n_past of the batch being evaluated, == the eval line's),
"n_batch_rows" U, "layer" L, "name" (the tensor's name without "-L"; "ffn_moe" for moe records),
"n_rows" (rows of THIS tensor), "positions" (the position of each of its rows). Row i of a full
tensor is position n_past + i. Attention runs on every row; the last layer's FFN only on the rows that
produce logits (llama.cpp does get_rows(inp_out_ids) after the last attention, in batch order): its
"moe"/"act" records have positions == output_positions (1 row with logits_all=False). Rows are never
invented: a tensor whose row count is neither U nor the number of outputs gets "positions": null
and an error line.
  {"kind": "moe", ..., "k": k, "n_expert": E,
   "ids": [[k expert ids] per row],          ffn_moe_topk-L, a view of the argsort (row stride nb[1]),
                                             best first
   "weights": [[k gate weights] per row],    src[1] of ffn_moe_weighted-L: the weights AS APPLIED,
                                             same order as ids. Renormalised to sum 1 whenever the
                                             arch's graph says so: llama (Mixtral), qwen3moe and
                                             smallthinker hard-code norm_w = true, whatever the GGUF
                                             key <arch>.expert_weights_norm (absent in generated models)
   "probs": [[E router probabilities] per row]}  ffn_moe_probs-L (the gating function's output)
  {"kind": "act", ..., "moe": bool, "values": [...], "zeros": [...], "below": [...], "threshold": t}
        the GLU output feeding the down projection (ffn_moe_{swiglu,reglu,geglu}-L: [n_ff, k, rows],
        the k experts actually run; ffn_{swiglu,reglu,geglu}-L: [n_ff, rows]); per row: number of
        values, number exactly 0.0 (+0 or -0), number with |x| < t (compared in float32; t is the
        --act-threshold value as given), summed over the k expert slots of the row for MoE
  {"kind": "attn", ..., "source": "soft_max"|"flash_attn", "attended": [...], "n_kv": n}
        the layer's mask as applied (its own with sliding-window layers): src[1] of kq_soft_max-L
        (F32), or with flash attention src[3] of the flash_attn_ext node (F16; this build leaves it
        unnamed, so it is found under kqv_out-L; __fattn__-L in builds that name it); per row the
        number of KV cells that are not -inf; n_kv is the mask width (the KV cache view, which
        llama.cpp pads: 256 cells with these small prompts), so attended <= n_kv
  {"kind": "error", "eval": e, "name": tensor name, "error": "..."}
  {"kind": "nodes", "eval": e, "nodes": [[op, name, empty, [src names]], ...]}
        every node of the eval's graphs in the order the scheduler asked about them (once each):
        its operator's name (ggml_op_name), its tensor name, whether it has no elements, and the
        names of its first two sources; written after the eval's graph ran
With n_batch == n_ubatch (this engine sets both) each llama_decode is one micro-batch; should a
layer's tensor appear twice in one eval (several micro-batches), records carry "ubatch": j > 0,
"positions": null, and an error line says so.
Cost: the callback splits the graph at ~3 nodes per layer and serialises JSON; on the 4-layer test
MoE decode goes from ~0.22 to ~1.5 ms/token. Trace in a separate truth run, never while measuring
the profiler's overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import llama_cpp
import llama_cpp.llama_cpp as C
import numpy as np
import numpy.typing as npt
from llama_cpp import Llama, LogitsProcessorList


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


# ---------------------------------------------------------------- ggml tensor access


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h; GGML_MAX_DIMS=4, GGML_MAX_SRC=10, GGML_MAX_OP_PARAMS=64,
    GGML_MAX_NAME=64): 336 bytes, type@0, ne@16, nb@48, op@80, src@152, data@248, name@256."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


assert ctypes.sizeof(GgmlTensor) == 336
for _field, _offset in (("type", 0), ("ne", 16), ("nb", 48), ("op", 80), ("src", 152), ("data", 248)):
    assert getattr(GgmlTensor, _field).offset == _offset, _field
assert GgmlTensor.name.offset == 256

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_I32 = 26
_NP_TYPES: dict[int, type[np.generic]] = {
    GGML_TYPE_F32: np.float32,
    GGML_TYPE_F16: np.float16,
    GGML_TYPE_I32: np.int32,
}


def _tensor(ptr: int | None) -> GgmlTensor | None:
    return GgmlTensor.from_address(ptr) if ptr else None


def _name(t: GgmlTensor) -> str:
    raw: bytes = t.name
    return raw.decode(errors="replace")


def _src(t: GgmlTensor, i: int) -> GgmlTensor | None:
    ptr: int | None = t.src[i]
    return _tensor(ptr)


def _op_name(op: int) -> str:
    """ggml's name of an operator (ggml_op_name, from the engine's own libggml)."""
    from llama_cpp._ggml import libggml

    fn = libggml.ggml_op_name
    fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_int]
    name: bytes = fn(op)
    return name.decode()


def _read(t: GgmlTensor) -> npt.NDArray[Any]:
    """A copy of the tensor's data as a numpy array of shape (ne[3], ne[2], ne[1], ne[0]), honouring
    the byte strides nb (so views, e.g. ffn_moe_topk of the argsort, read only their elements)."""
    dtype = _NP_TYPES.get(int(t.type))
    if dtype is None:
        raise TypeError(f"{_name(t)}: unsupported ggml type {t.type}")
    ne = [int(t.ne[i]) for i in range(4)]
    nb = [int(t.nb[i]) for i in range(4)]
    shape = tuple(reversed(ne))
    if min(ne) <= 0:
        return np.zeros(shape, dtype=dtype)
    if not t.data:
        raise ValueError(f"{_name(t)}: no data")
    itemsize = np.dtype(dtype).itemsize
    extent = itemsize + sum((n - 1) * s for n, s in zip(ne, nb, strict=True))
    buf = (ctypes.c_char * extent).from_address(int(t.data))
    view = np.ndarray(shape, dtype=dtype, buffer=memoryview(buf), strides=tuple(reversed(nb)))
    return view.copy()


# ---------------------------------------------------------------- graph trace

MOE_PARTS = {"ffn_moe_probs": "probs", "ffn_moe_topk": "ids", "ffn_moe_weighted": "weights"}
ACT_MOE = ("ffn_moe_swiglu", "ffn_moe_reglu", "ffn_moe_geglu")
ACT_DENSE = ("ffn_swiglu", "ffn_reglu", "ffn_geglu")
ATTN_SOFT_MAX = "kq_soft_max"  # soft_max_ext(kq, mask): mask is src[1]
ATTN_FATTN = "__fattn__"  # flash_attn_ext(q, k, v, mask), named so by some llama.cpp builds: src[3]
ATTN_FATTN_OUT = "kqv_out"  # this build leaves flash_attn_ext unnamed; kqv_out-L is a reshape of it


class GraphTrace:
    """cb_eval ground truth: see the module docstring for what is recorded and the line format."""

    def __init__(self, path: str, threshold: float, flash_attn: bool) -> None:
        self.out: IO[str] = open(path, "w")  # noqa: SIM115 (lives as long as the engine)
        self.threshold = threshold
        self._threshold32 = np.float32(threshold)
        self.flash_attn = flash_attn
        self.llm: Llama | None = None
        self.request = -1
        self.item = -1
        self.eval_idx = -1
        self.n_errors = 0
        self._eval: dict[str, Any] | None = None
        self._seen: set[tuple[str, int]] = set()
        self._ubatch = 0
        self._moe: dict[int, dict[str, Any]] = {}
        self._nodes: list[list[Any]] = []
        wanted = {*MOE_PARTS, *ACT_MOE, *ACT_DENSE, ATTN_SOFT_MAX, ATTN_FATTN}
        if flash_attn:
            wanted.add(ATTN_FATTN_OUT)
        self._wanted = frozenset(wanted)
        # keep the C function pointer alive as long as the context that calls it
        self.callback = C.ggml_backend_sched_eval_callback(self._callback)

    # -- installation

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While active, new llama contexts get cb_eval = this trace's callback (Llama() builds its
        context params from llama_cpp.llama_context_default_params())."""
        orig = C.llama_context_default_params

        def patched() -> Any:
            p = orig()
            p.cb_eval = self.callback
            p.cb_eval_user_data = None
            return p

        C.llama_context_default_params = patched
        try:
            yield
        finally:
            C.llama_context_default_params = orig

    def attach(self, llm: Llama) -> None:
        """Wrap the context's decode so that every llama_decode gets an "eval" line first."""
        self.llm = llm
        ctx = llm._ctx
        orig: Callable[[Any], Any] = ctx.decode

        def decode(batch: Any) -> Any:
            self.begin_eval(batch.batch)
            try:
                return orig(batch)
            finally:
                self.end_eval()

        setattr(ctx, "decode", decode)  # noqa: B010 (an instance attribute shadows the method)
        md = llm.metadata
        arch = md.get("general.architecture", "")

        def num(key: str) -> int | None:
            v = md.get(f"{arch}.{key}")
            return int(v) if v is not None else None

        self.emit(
            kind="meta",
            pid=os.getpid(),
            model=llm.model_path,
            arch=arch,
            n_layer=num("block_count"),
            n_expert=num("expert_count") or 0,
            n_expert_used=num("expert_used_count") or 0,
            n_ctx=llm.n_ctx(),
            n_batch=int(llm.context_params.n_batch),
            n_ubatch=int(llm.context_params.n_ubatch),
            logits_all=bool(llm._logits_all),
            flash_attn=self.flash_attn,
            threshold=self.threshold,
            expert_weights_norm=md.get(f"{arch}.expert_weights_norm"),
            llama_cpp_version=llama_cpp.__version__,
        )

    # -- output

    def emit(self, **kw: Any) -> None:
        self.out.write(json.dumps(kw) + "\n")

    def flush(self) -> None:
        self.out.flush()

    def error(self, name: str, err: str) -> None:
        self.n_errors += 1
        self.emit(kind="error", eval=self.eval_idx, name=name, error=err)

    def start_item(self, mode: str, prompt_tokens: Sequence[int]) -> None:
        self.item += 1
        self.emit(
            kind="request", request=self.request, item=self.item, mode=mode, prompt_tokens=list(prompt_tokens)
        )

    def start_request(self) -> None:
        self.request += 1
        self.item = -1

    # -- per llama_decode

    def _batch_info(self, b: Any) -> dict[str, Any]:
        n = int(b.n_tokens)
        positions = [int(b.pos[i]) for i in range(n)] if b.pos else []
        outputs = [positions[i] for i in range(n) if b.logits and b.logits[i]] if positions else []
        tokens = [int(b.token[i]) for i in range(n)] if b.token else []
        n_past = int(self.llm.n_tokens) if self.llm is not None else None
        return {
            "n_past": n_past,
            "n_batch_rows": n,
            "positions": positions,
            "outputs": outputs,
            "tokens": tokens,
        }

    def begin_eval(self, b: Any) -> None:
        try:
            self.eval_idx += 1
            info = self._batch_info(b)
            self._eval = info
            self._seen.clear()
            self._ubatch = 0
            self._moe.clear()
            self._nodes = []
            self.emit(
                kind="eval",
                eval=self.eval_idx,
                request=self.request,
                item=self.item,
                n_past=info["n_past"],
                n_batch_rows=info["n_batch_rows"],
                positions=info["positions"],
                output_positions=info["outputs"],
                tokens=info["tokens"],
            )
        except Exception as e:  # the trace must never break the engine
            self.error("<eval>", repr(e))

    def end_eval(self) -> None:
        for layer in sorted(self._moe):
            self._emit_incomplete(layer)
        self.emit(kind="nodes", eval=self.eval_idx, nodes=self._nodes)
        self._eval = None

    def _emit_incomplete(self, layer: int) -> None:
        parts = self._moe.pop(layer)
        missing = sorted({"ids", "weights", "probs"} - parts.keys())
        self.error(f"ffn_moe-{layer}", f"incomplete MoE record, missing {missing}")
        self._emit_moe(layer, parts)

    # -- the callback

    def _callback(self, t_ptr: int | None, ask: bool, _user_data: int | None) -> bool:
        """ask: "do you want this node's data?"; not ask: the node was computed, "continue?"."""
        name = "?"
        try:
            t = _tensor(t_ptr)
            if t is None:
                return not ask
            name = _name(t)
            base, sep, layer = name.rpartition("-")
            wanted = bool(sep) and layer.isdigit() and base in self._wanted
            if ask:
                empty = min(int(t.ne[i]) for i in range(4)) <= 0
                srcs = [_name(src) for i in range(2) if (src := _src(t, i)) is not None]
                self._nodes.append([_op_name(int(t.op)), name, empty, srcs])
                return wanted
            if wanted:
                self._record(t, base, int(layer))
        except BaseException as e:  # never raise into C: record it and let the computation go on
            with contextlib.suppress(BaseException):
                self.error(name, repr(e))
            return not ask
        return True

    def _common(self, kind: str, base: str, layer: int, n_rows: int) -> dict[str, Any]:
        if self._eval is None:  # a graph computed outside Llama's decode: use the batch Llama set
            if self.llm is None:
                raise RuntimeError("graph evaluated before the trace was attached")
            self.begin_eval(self.llm._batch.batch)
            self.error(f"{base}-{layer}", "graph evaluated outside the wrapped llama_decode")
        ev = self._eval
        assert ev is not None
        key = (base, layer)
        if key in self._seen:  # same tensor again in one llama_decode: a new micro-batch
            self._ubatch += 1
            self._seen.clear()
            self.error(f"{base}-{layer}", "several micro-batches in one llama_decode: positions unknown")
        self._seen.add(key)
        positions: list[int] | None = None
        if self._ubatch == 0:
            if n_rows == ev["n_batch_rows"]:
                positions = ev["positions"]
            elif n_rows == len(ev["outputs"]):
                positions = ev["outputs"]
            else:
                self.error(f"{base}-{layer}", f"{n_rows} rows: neither the batch nor its outputs")
        rec: dict[str, Any] = {
            "kind": kind,
            "eval": self.eval_idx,
            "n_past": int(self.llm.n_tokens) if self.llm is not None else None,
            "n_batch_rows": ev["n_batch_rows"],
            "layer": layer,
            "name": base,
            "n_rows": n_rows,
            "positions": positions,
        }
        if self._ubatch:
            rec["ubatch"] = self._ubatch
        return rec

    def _record(self, t: GgmlTensor, base: str, layer: int) -> None:
        if base in MOE_PARTS:
            self._record_moe(t, base, layer)
        elif base in ACT_MOE or base in ACT_DENSE:
            self._record_act(t, base, layer)
        else:
            self._record_attn(t, base, layer)

    def _record_moe(self, t: GgmlTensor, base: str, layer: int) -> None:
        part = MOE_PARTS[base]
        if part == "weights":
            w = _src(t, 1)
            if w is None:
                raise ValueError("ffn_moe_weighted has no src[1]")
            a = _read(w)[0]  # [rows, k, 1]
            rows = a.reshape(a.shape[0], -1)
        else:
            a = _read(t)[0, 0]  # ids: [rows, k] (view of the argsort); probs: [rows, n_expert]
            rows = a
        parts = self._moe.setdefault(layer, {})
        if "rec" not in parts:
            parts["rec"] = self._common("moe", "ffn_moe", layer, int(rows.shape[0]))
        elif part in parts:  # a second micro-batch before this layer's record was complete
            self._emit_incomplete(layer)
            return self._record_moe(t, base, layer)
        parts[part] = rows
        if {"ids", "weights", "probs"} <= parts.keys():
            del self._moe[layer]
            self._emit_moe(layer, parts)

    def _emit_moe(self, layer: int, parts: dict[str, Any]) -> None:
        rec = dict(parts["rec"])
        ids = parts.get("ids")
        probs = parts.get("probs")
        weights = parts.get("weights")
        n_rows = {int(x.shape[0]) for x in (ids, probs, weights) if x is not None}
        if len(n_rows) > 1:
            self.error(f"ffn_moe-{layer}", f"row counts differ between ids/weights/probs: {sorted(n_rows)}")
        rec.update(
            k=int(ids.shape[1]) if ids is not None else None,
            n_expert=int(probs.shape[1]) if probs is not None else None,
            ids=ids.tolist() if ids is not None else None,
            weights=weights.astype(np.float32).tolist() if weights is not None else None,
            probs=probs.astype(np.float32).tolist() if probs is not None else None,
        )
        self.emit(**rec)

    def _record_act(self, t: GgmlTensor, base: str, layer: int) -> None:
        a = _read(t)
        moe = base in ACT_MOE
        # MoE: [ne3, rows, k, n_ff] -> one row holds its k experts; dense: [ne3, ne2, rows, n_ff]
        rows = a[0].reshape(a.shape[1], -1) if moe else a[0, 0]
        x = rows.astype(np.float32, copy=False)
        rec = self._common("act", base, layer, int(rows.shape[0]))
        rec.update(
            moe=moe,
            values=[int(rows.shape[1])] * int(rows.shape[0]),
            zeros=(x == 0).sum(axis=1).tolist(),
            below=(np.abs(x) < self._threshold32).sum(axis=1).tolist(),
            threshold=self.threshold,
        )
        self.emit(**rec)

    def _record_attn(self, t: GgmlTensor, base: str, layer: int) -> None:
        if base == ATTN_SOFT_MAX:
            mask, source = _src(t, 1), "soft_max"
        elif base == ATTN_FATTN:
            mask, source = _src(t, 3), "flash_attn"
        else:  # kqv_out-L = reshape(flash_attn_ext): look a few nodes down its src[0] chain
            mask, source, node = None, "flash_attn", _src(t, 0)
            for _ in range(4):
                if node is None:
                    break
                cand = _src(node, 3)
                if cand is not None and "kq_mask" in _name(cand):
                    mask = cand
                    break
                node = _src(node, 0)
            if mask is None:
                return  # no flash attention in this graph (llama.cpp fell back): kq_soft_max has it
        if mask is None:
            raise ValueError(f"{base}-{layer} has no mask")
        values = _read(mask)  # [n_stream, 1, rows per stream, n_kv]
        n_kv = int(values.shape[-1])
        rows = values[:, 0].reshape(-1, n_kv)  # streams in order; rows beyond the batch are padding
        ev = self._eval
        n_batch = ev["n_batch_rows"] if ev is not None else rows.shape[0]
        rows = rows[: min(int(rows.shape[0]), int(n_batch))]
        rec = self._common("attn", base, layer, int(rows.shape[0]))
        rec.update(
            source=source,
            attended=(~np.isneginf(rows)).sum(axis=1).tolist(),
            n_kv=n_kv,
        )
        self.emit(**rec)


# ---------------------------------------------------------------- requests


def last_logits(llm: Llama) -> npt.NDArray[np.float32]:
    """The logits of the last row that produced logits in the last llama_decode."""
    ptr = C.llama_get_logits_ith(llm._ctx.ctx, -1)
    if not ptr:
        raise RuntimeError("no logits")
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def teacher_force(llm: Llama, prompt_ids: Sequence[int], ids: Sequence[int]) -> list[float]:
    """Log-probs of ``ids`` after ``prompt_ids``: cache reset, the prompt in one eval, then each id
    but the last alone (see the module docstring)."""
    llm.reset()
    llm.eval(list(prompt_ids))
    lps: list[float] = []
    for j, t in enumerate(ids):
        lps.append(float(log_softmax(last_logits(llm))[int(t)]))
        if j + 1 < len(ids):
            llm.eval([int(t)])
    return lps


def forcing(n_prompt: int, plan: dict[str, int | str]) -> LogitsProcessorList | None:
    """A logits processor that leaves only the planned token at the planned decode orders (it sees
    the evaluated ids, prompt and tokens so far, and the logits row in token id order)."""
    if not plan:
        return None

    def force(input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        want = plan.get(str(len(input_ids) - n_prompt))
        if want is None:
            return scores
        token = int(np.argmin(scores)) if want == "least" else int(want)
        out = np.full_like(scores, -np.inf)
        out[token] = 0.0
        return out

    return LogitsProcessorList([force])


def ggml_version() -> str:
    """What ggml_version() of the loaded library returns (libllama's symbol lookup reaches the
    libggml-base it links; the bindings do not wrap the function)."""
    fn = C._lib.ggml_version
    fn.restype = ctypes.c_char_p
    return str(fn().decode())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--no-logits-all", action="store_true")
    ap.add_argument("--n-batch", type=int, default=512, help="n_batch and n_ubatch")
    ap.add_argument("--flash-attn", action="store_true", help="enable flash attention")
    ap.add_argument(
        "--graph-trace", metavar="PATH", help="write the cb_eval ground truth (module docstring) to PATH"
    )
    ap.add_argument(
        "--act-threshold",
        type=float,
        default=1e-2,
        help="activations with |x| below this count as near-zero in the graph trace (default 1e-2)",
    )
    a = ap.parse_args()
    trace = GraphTrace(a.graph_trace, a.act_threshold, a.flash_attn) if a.graph_trace else None

    def load() -> Llama:
        return Llama(
            model_path=a.model,
            n_ctx=a.n_ctx,
            n_batch=a.n_batch,
            n_ubatch=a.n_batch,
            n_threads=a.threads,
            n_threads_batch=a.threads,
            seed=1,
            logits_all=not a.no_logits_all,
            flash_attn=a.flash_attn,
            verbose=False,
        )

    if trace is not None:
        with trace.installed():
            llm = load()
        trace.attach(llm)
        trace.flush()
    else:
        llm = load()
    ready = {
        "ready": os.getpid(),
        "n_vocab": llm.n_vocab(),
        "llama_cpp_version": llama_cpp.__version__,
        "libllama": C._lib._name,
        "ggml_version": ggml_version(),
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        if trace is not None:
            trace.start_request()
        results: list[dict[str, Any]] = []
        plans = cmd.get("force") or [{} for _ in cmd.get("prompts", [])]
        for prompt, plan in zip(cmd.get("prompts", []), plans, strict=True):
            t_request = time.perf_counter_ns()  # the request's start, for time to first token
            llm.set_seed(int(cmd.get("seed", 1)))
            toks = llm.tokenize(prompt.encode())
            if trace is not None:
                trace.start_item("generate", toks)
            ids: list[int] = []
            lps: list[float] = []
            times: list[int] = []  # when each token reached the caller (for the overhead benchmark)
            temp = float(cmd.get("temp", 0.0))
            forcer = forcing(len(toks), plan)
            for t in llm.generate(
                toks, top_k=1 if temp == 0 else 40, temp=temp, reset=True, logits_processor=forcer
            ):
                times.append(time.perf_counter_ns())
                ids.append(int(t))
                if not a.no_logits_all:
                    row = llm.scores[llm.n_tokens - 1]
                    lps.append(float(log_softmax(row)[t]))
                if len(ids) >= int(cmd["max_tokens"]) or t == llm.token_eos():
                    break
                if cmd.get("stop_file") and os.path.exists(cmd["stop_file"]):
                    break  # the test says when: a request that lasts as long as attaching takes
                if cmd.get("token_delay"):  # a slow client, so a test can attach mid-request
                    time.sleep(float(cmd["token_delay"]))
            results.append(
                {
                    "prompt_tokens": toks,
                    "ids": ids,
                    "log_probs": lps,
                    "times_ns": times,
                    "t_request_ns": t_request,
                }
            )
        for tf in cmd.get("teacher_force", []):
            prompt_ids = [int(x) for x in tf["prompt_ids"]]
            forced = [int(x) for x in tf["ids"]]
            if trace is not None:
                trace.start_item("teacher_force", prompt_ids)
            lps = teacher_force(llm, prompt_ids, forced)
            results.append({"prompt_tokens": prompt_ids, "ids": forced, "log_probs": lps})
        if trace is not None:
            trace.flush()
        print(json.dumps({"results": results}), flush=True)
    if trace is not None:
        trace.out.close()


if __name__ == "__main__":
    main()
