"""What the sparse-decision probes are built for: the model's layers that have each decision
(from its tensor names) and where the MoE probes read. Made at attach time from the model file,
used by the BPF loader (compile flags) and by the correlator (the per-layer list orders)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSet:
    """Which model layers have which sparse decision, from the model file's tensor names; the
    token rows' per-layer lists follow these orders."""

    moe: tuple[int, ...] = ()
    ffn: tuple[int, ...] = ()
    attn: tuple[int, ...] = ()

    def to_meta(self) -> dict[str, list[int]]:
        return {"moe": list(self.moe), "ffn": list(self.ffn), "attn": list(self.attn)}


def layer_set(tensor_names: list[str], n_layer: int) -> LayerSet:
    """MoE layers have a router (blk.L.ffn_gate_inp), FFN layers a down projection (dense or
    experts), attention layers an output projection (blk.L.attn_output)."""
    names = set(tensor_names)
    moe = tuple(i for i in range(n_layer) if f"blk.{i}.ffn_gate_inp.weight" in names)
    ffn = tuple(
        i
        for i in range(n_layer)
        if f"blk.{i}.ffn_down.weight" in names or f"blk.{i}.ffn_down_exps.weight" in names
    )
    attn = tuple(i for i in range(n_layer) if f"blk.{i}.attn_output.weight" in names)
    return LayerSet(moe=moe, ffn=ffn, attn=attn)


# Architectures whose MoE layers scale the FFN input by the gate weights before the experts run
# (llama.cpp's build_moe_ffn with weight_before_ffn): their "ffn_moe_weighted" node does not sit
# on the experts' output.
_WEIGHT_BEFORE_FFN = frozenset({"llama4"})


@dataclass(frozen=True)
class MoePlan:
    """Where the MoE probes read. The "ffn_moe_weighted-L" multiply (experts' output x gate
    weights) runs right after the down projection, whose sources are still intact at its entry:
    the selected expert ids (the down projection's ids) and, when every FFN of the model is an
    expert FFN, the GLU activations the experts ran on. Reading them there saves the get_rows
    probe and the GLU entry and return probes: about half of the uprobe hits per token on the
    bench model, each a trap into the kernel before any BPF runs (docs/overhead.md)."""

    ids_at_mul: bool = False
    act_at_mul: bool = False

    def cflags(self) -> list[str]:
        return [f for on, f in ((self.ids_at_mul, "-DIDS_AT_MUL"), (self.act_at_mul, "-DACT_AT_MUL")) if on]

    def to_meta(self) -> dict[str, bool]:
        return {"ids_at_mul": self.ids_at_mul, "act_at_mul": self.act_at_mul}


def moe_plan(tensor_names: list[str], layers: LayerSet, arch: str) -> MoePlan:
    """The MoE read points for a model: at the weighted multiply unless the architecture weights
    before the experts; activations too only when no FFN outside the experts (dense layers,
    shared experts) has a GLU node of its own."""
    if not layers.moe or arch in _WEIGHT_BEFORE_FFN:
        return MoePlan()
    names = set(tensor_names)
    experts_only = all(
        layer in layers.moe
        and f"blk.{layer}.ffn_down.weight" not in names
        and f"blk.{layer}.ffn_down_shexp.weight" not in names
        for layer in layers.ffn
    )
    return MoePlan(ids_at_mul=True, act_at_mul=experts_only)
