"""Models the engine tests compile, with small inputs so the CPU tests stay fast."""

from __future__ import annotations

import torch
import torch.nn as nn
import torchvision


class TwoInputs(nn.Module):
    """Two inputs, two independent branches, a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.b = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.GELU())

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        u = self.a(x)
        v = self.b(y).mean(dim=-1)
        return u + v, torch.cat([u, v], dim=1)


class Branches(nn.Module):
    """k independent equal branches (the overlap test), summed by a chain of adds (``reduce="chain"``:
    each add waits for one more branch) or by one kernel over their stacked outputs (``"stack"``)."""

    def __init__(self, k: int = 4, width: int = 256, depth: int = 4, reduce: str = "chain") -> None:
        super().__init__()
        if reduce not in ("chain", "stack"):
            raise ValueError(f"Branches: reduce must be 'chain' or 'stack', got {reduce!r}")
        self.reduce = reduce
        self.branches = nn.ModuleList(
            nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]) for _ in range(k)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce == "stack":
            return torch.stack([b(x) for b in self.branches]).sum(0)
        return sum(b(x) for b in self.branches)


class TinySqueezeExcite(nn.Module):
    """A convolution, a squeeze-excitation gate (pool, 1x1, ReLU, 1x1, sigmoid, the map scaled by it)
    and a classifier: the smallest model ``fold.fuse_gates`` takes."""

    def __init__(self, channels: int = 8, hidden: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.fc1, self.fc2 = nn.Conv2d(channels, hidden, 1), nn.Conv2d(hidden, channels, 1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.nn.functional
        y = self.conv(x)
        y = y * torch.sigmoid(self.fc2(torch.relu(self.fc1(f.adaptive_avg_pool2d(y, 1)))))
        return self.head(f.adaptive_avg_pool2d(y, 1).flatten(1))


def randomize_batchnorm(model: nn.Module, spread: float = 0.5) -> nn.Module:
    """Give every BatchNorm2d statistics and an affine map of its own (a fresh one is the identity, so a
    wrong fold would not show); returns the model in eval mode."""
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-spread, spread)
                mod.running_var.uniform_(0.5, 2.0)
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.5, 0.5)
    return model.eval()


def transformer_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def zoo(size: int = 64) -> dict[str, tuple[nn.Module, tuple[tuple[int, ...], ...], torch.dtype]]:
    """name -> (model, per-sample input shapes, dtype)."""
    tv = torchvision.models
    img = ((3, size, size),)
    return {
        "resnet18": (tv.resnet18(weights=None), img, torch.float32),
        "googlenet": (tv.googlenet(weights=None, aux_logits=False, init_weights=False), img, torch.float32),
        "inception_v3": (tv.inception_v3(weights=None, aux_logits=False, init_weights=False), ((3, 96, 96),), torch.float32),
        "mobilenet_v3_small": (tv.mobilenet_v3_small(weights=None), img, torch.float32),
        "efficientnet_b0": (tv.efficientnet_b0(weights=None), img, torch.float32),
        "densenet121": (tv.densenet121(weights=None), img, torch.float32),
        "transformer_encoder": (transformer_encoder(), ((16, 64),), torch.float32),
        "two_inputs": (TwoInputs(), ((16,), (4, 10)), torch.float32),
    }
