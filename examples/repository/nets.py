"""Small models for the example repository (CPU-friendly; used by the serve tests)."""

from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Module):
    """16 features -> 4 scores."""

    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TinyCNN(nn.Module):
    """A 3x16x16 image -> 10 logits and an 8-dim embedding (two outputs, by name)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 10)

    def forward(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.conv(image)
        return {"logits": self.head(z), "embedding": z}


def tiny_mlp(**kw) -> nn.Module:
    return TinyMLP(**kw)


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    return TinyCNN()


def linear(features: int = 16, classes: int = 4) -> nn.Module:
    """One linear layer: the protocol benchmark's trivial model."""
    torch.manual_seed(0)
    return nn.Linear(features, classes)
