"""The benchmarked model and data: residual MLP `Block`s (the FSDP unit every config wraps,
`fsdp_transformer_layer_cls_to_wrap: Block`) and a head owned by the root, so U = layers + 1."""

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
    """Returns {"loss": ...} so the very same model also runs under a stock `Trainer`."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return {"loss": F.mse_loss(self.head(x).squeeze(-1), y)}


def make_data(rows: int, dim: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` global samples; every configuration reads the same ones."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=g), torch.randn(rows, generator=g)
