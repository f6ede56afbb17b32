"""LoRA adapters on a frozen MLP, fine-tuned federatedly: only the adapters travel.

    meshkit run examples/torch/lora.toml    # [strategy] trainable = ["@lora"]

``LoRALinear`` is LoRA (Hu et al., 2021) by hand: a frozen ``base`` layer plus
``lora_a`` (r x in) and ``lora_b`` (out x r, zero at the start), so the
adapted layer starts as the base one. ``meshkit.torch`` names every state key
with a ``lora_`` part as the group ``"@lora"`` (PEFT's ``lora_A``/``lora_B``
too). The base weights are frozen in the model (``requires_grad = False``),
and ``trainable`` keeps them off the wire after the first round.

The task: 4-class synthetic blobs in 16 dimensions, from a fixed seed (no
download); the base MLP is a random projection the adapters learn to use.
"""

import numpy as np
import torch
from torch import nn

import meshkit.torch

RANK = 4


class LoRALinear(nn.Module):
    """``base(x) + x A^T B^T``: a frozen linear layer with a trainable rank-``r`` update."""

    def __init__(self, inputs: int, outputs: int, r: int = RANK) -> None:
        super().__init__()
        self.base = nn.Linear(inputs, outputs)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(r, inputs) / inputs ** 0.5)
        self.lora_b = nn.Parameter(torch.zeros(outputs, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = LoRALinear(16, 64)
        self.head = LoRALinear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(x)))


def blobs(options=None):
    """1,200 training and 400 held-out points of 4 Gaussian blobs in 16-d (seed 0)."""
    rng = np.random.default_rng(0)
    centres = rng.normal(0.0, 1.0, (4, 16)).astype(np.float32)

    def draw(n: int):
        y = rng.integers(0, 4, n)
        x = centres[y] + rng.normal(0.0, 1.0, (n, 16)).astype(np.float32)
        return x.astype(np.float32), y.astype(np.int64)

    return draw(1200), draw(400)


task = meshkit.torch.task(model=Net, loss=nn.CrossEntropyLoss(), data=blobs,
                          optimizer=lambda params, options: torch.optim.SGD(
                              [p for p in params if p.requires_grad], lr=options.lr))
