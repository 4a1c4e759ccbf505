"""The tiny network every inference-core test drives (torch, onnxruntime, tensorrt backends)."""

from __future__ import annotations

import torch
from torch import nn

from deploy_core.infer import TensorSpec

INPUTS = (TensorSpec("x", (-1, 3, 8, 8), torch.float32), TensorSpec("scale", (-1, 1), torch.float32))
OUTPUTS = (TensorSpec("logits", (-1, 5), torch.float32), TensorSpec("pooled", (-1, 4), torch.float32))


class SmallNet(nn.Module):
    """conv + linear with two inputs and two outputs (checks positional order both ways)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.conv(x))                          # (N, 4, 8, 8)
        return self.fc(y.flatten(1)) * scale, y.mean((2, 3))  # (N, 5), (N, 4)
