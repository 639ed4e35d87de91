"""Interventions: what a replace hook is told (HookContext) and ready-made replace functions.

A replace function fn(tensor, HookContext) returns the tensor the forward continues with, or None to leave
it unchanged (engine.inspection.probe.Probe.replace)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.inspection.stages import ATTENTION_MAPS


@dataclass(frozen=True)
class HookContext:
    """What a replace function is told about the tensor it receives."""
    name: str
    layer: int | None
    step: int
    pos0: int          # absolute position of the first row (dim 0, or dim 1 for scores/pattern)


HookFn = Callable[[torch.Tensor, HookContext], "torch.Tensor | None"]


def scale(factor: float) -> HookFn:
    return lambda x, ctx: x * factor


def zero_heads(*heads: int) -> HookFn:
    """Zero some heads of a [T, heads, hd] stage (q/k/v/z) or of a [heads, T, S] pattern."""
    def fn(x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        y = x.clone()
        if ctx.name.endswith(ATTENTION_MAPS):
            y[list(heads)] = 0
        else:
            y[:, list(heads)] = 0
        return y
    return fn


def plant(value: float, *, position: int | None = None, index: int = 0) -> HookFn:
    """Set one element (flat feature index) to value: at an absolute position, or at every position."""
    def fn(x: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
        rows = x.reshape(x.shape[0], -1)
        if position is not None and not (ctx.pos0 <= position < ctx.pos0 + rows.shape[0]):
            return None
        y = rows.clone()
        r = slice(None) if position is None else position - ctx.pos0
        y[r, index] = value
        return y.reshape(x.shape)
    return fn
