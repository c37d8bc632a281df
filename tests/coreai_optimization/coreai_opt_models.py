# Copyright 2026 Apple Inc.
#
# Use of this source code is governed by a BSD-3-Clause license that can
# be found in the LICENSE file or at https://opensource.org/licenses/BSD-3-Clause

import torch
import torch.nn as nn


class SimpleModel(nn.Module):
    """Simple model for testing."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 32, 3, padding=1)
        self.relu = nn.ReLU()
        self.linear = nn.Linear(32 * 28 * 28, 10)

    def forward(self, x):
        x = self.conv(x)
        x = self.relu(x)
        x = x.view(x.size(0), -1)
        x = self.linear(x)
        return x


class GatedMLPModel(nn.Module):
    """Simple gated MLP model with uniform activation tensor rank.
    All intermediate activations are rank-3 tensors (batch, seq_len, dim or
    hidden_dim), making this model suitable for testing per-channel activation
    quantization across a wide range of axis values (0, 1, 2, -1, -2, -3)
    without out-of-bounds errors.
    Inspired by the MLP block in Qwen3 and similar transformer architectures.
    """

    def __init__(self, dim: int = 32, hidden_dim: int = 64) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up_tensor = self.up_proj(x)
        gate_tensor = nn.functional.silu(self.gate_proj(x))
        return self.down_proj(up_tensor * gate_tensor)
