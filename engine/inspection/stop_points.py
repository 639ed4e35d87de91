"""Where a forward stops (Model.forward's stop_after): a stage of the forward or a block index, as a StopPoint."""
from __future__ import annotations

from typing import NamedTuple

from engine.errors import InputError
from engine.inspection.plans import split_name
from engine.inspection.stages import LAYER_STAGES

ATTN_HALF = frozenset(LAYER_STAGES[:LAYER_STAGES.index("resid_mid") + 1])   # a block's stages up to resid_mid


class StopPoint(NamedTuple):
    """A forward that ends early runs `blocks` whole blocks, then the attention half of the next (attn_half)
    or the final norm (final_norm, after every block)."""
    blocks: int
    attn_half: bool = False
    final_norm: bool = False


def stop_point(stop_after: str | int, num_layers: int) -> StopPoint | None:
    """Where a forward given stop_after (a stage of the forward, or a block index: after its resid_post) ends;
    None for "logits" (it does not). A stage ends its half-block. InputError for anything else."""
    layer, stage = split_name(stop_after) if isinstance(stop_after, str) else (None, None)
    if type(stop_after) is int and 0 <= stop_after < num_layers:
        return StopPoint(stop_after + 1)
    if stop_after in ("embed", "final_norm", "logits"):
        return {"embed": StopPoint(0), "final_norm": StopPoint(num_layers, final_norm=True)}.get(stop_after)
    if layer is not None and layer < num_layers and stage in LAYER_STAGES:
        return StopPoint(layer, attn_half=True) if stage in ATTN_HALF else StopPoint(layer + 1)
    raise InputError(f"stop_after {stop_after!r} is neither a stage of the forward (embed, blocks.{{i}}.<stage>, "
                     f"final_norm, logits) nor a block index i, with i in [0, {num_layers})")
