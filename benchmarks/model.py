"""The benchmarked model and data: residual MLP `Block`s (the FSDP unit every config wraps,
`fsdp_transformer_layer_cls_to_wrap: Block`) and a root that owns an input projection and an
output head, so U = layers + 1.

The root is as large as a block (8 dim^2 + 5 dim parameters each), as in a language model,
whose root holds the embedding and the LM head. A root of a few parameters would be a unit
whose reduce-scatter costs latency but no memory to defer: full deferral would get it for free
and no byte budget below full deferral could, which skews the memory/time frontier on a
latency-bound model (docs/performance.md shows the effect)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """Returns {"loss": ...} so the very same model also runs under a stock `Trainer`. Inputs
    and targets have 4 dim features (the "vocabulary" the root projects in and out of)."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Linear(4 * dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 4 * dim)

    def forward(self, x, y):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return {"loss": F.mse_loss(self.head(x), y)}


def make_data(rows: int, dim: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` global samples of 4 dim features in and out; every configuration reads the same ones."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4 * dim, generator=g), torch.randn(rows, 4 * dim, generator=g)
