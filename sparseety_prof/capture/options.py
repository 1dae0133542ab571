"""What the probes capture beyond token boundaries: the sparse decisions of each forward pass.

One frozen settings object, shared by the CLI, the loader (which turns it into compile-time
flags, so disabled features cost nothing on the engine's hot path) and the recording metadata.
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_ACT_THRESHOLD = 1e-2


#: the sparsest --act-every: one forward pass in a million still counts some
MAX_ACT_EVERY = 1_000_000


@dataclass(frozen=True)
class Capture:
    routes: bool = True  # MoE expert ids and gate weights per (row, layer)
    router_probs: bool = False  # router probabilities of every expert (--capture-router-probs)
    activations: bool = True  # FFN activation zero / below-threshold counts per (row, layer)
    masks: bool = False  # the activation zero masks themselves (--capture-masks)
    attention: bool = True  # attended cells per output row and attention layer
    act_threshold: float = DEFAULT_ACT_THRESHOLD  # |x| below this counts in act_below_ratio
    # activations counted on one one-row forward pass in act_every (--act-every): the rest of the
    # decode steps keep their routing, their activation ratios are null
    act_every: int = 1
    # when each engine thread reached each layer's probe point, per one-row step (the layer_times
    # table, the tokens' slowest layer): --no-layer-times leaves the probes' timestamps out
    layer_times: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.act_threshold) and self.act_threshold > 0):
            raise ValueError(
                f"activation threshold must be a positive finite number, not {self.act_threshold}"
            )
        if self.masks and not self.activations:
            raise ValueError("activation masks need activation capture")
        if not 1 <= self.act_every <= MAX_ACT_EVERY:
            raise ValueError(f"--act-every must be 1-{MAX_ACT_EVERY}, not {self.act_every}")
        if self.act_every > 1 and (self.masks or self.router_probs or not self.activations):
            raise ValueError(
                "--act-every samples the activations gathered per one-row forward pass: not with "
                "--capture-masks or --capture-router-probs (every layer then sends its own records)"
            )

    @property
    def any(self) -> bool:
        return self.routes or self.router_probs or self.activations or self.attention

    @property
    def threshold_bits(self) -> int:
        """IEEE-754 single-precision bits of the threshold: for finite non-negative floats the
        bit patterns order like the values, so BPF compares |x| < t on integers."""
        (bits,) = struct.unpack("<I", struct.pack("<f", self.act_threshold))
        return int(bits)

    def cflags(self) -> list[str]:
        flags = [f"-DACT_BELOW_BITS={self.threshold_bits}ULL"]
        for on, name in (
            (self.routes, "CAPTURE_ROUTES"),
            (self.router_probs, "CAPTURE_PROBS"),
            (self.activations, "CAPTURE_ACT"),
            (self.masks, "CAPTURE_MASKS"),
            (self.attention, "CAPTURE_ATTN"),
            (self.layer_times, "CAPTURE_LAYER_TIMES"),
        ):
            if on:
                flags.append(f"-D{name}")
        if (self.routes or self.activations) and not (self.router_probs or self.masks):
            # one aggregate record per one-row micro-batch (router probabilities and masks are
            # too large for it: with those, every layer sends its own records)
            flags.append("-DAGG_STEPS")
            if self.act_every > 1:
                flags.append(f"-DACT_EVERY={self.act_every}")
        return flags

    def to_meta(self) -> dict[str, Any]:
        return asdict(self)


TOKENS_ONLY = Capture(
    routes=False, router_probs=False, activations=False, masks=False, attention=False, layer_times=False
)
