"""Single-process checkpoint helpers: train a tiny model under a 1x1x1 layout and save it; perturb an HF model."""

from __future__ import annotations

import torch

from megalite.training import Trainer

from ..helpers import single_layout

CPU = torch.device("cpu")


def train_and_save(cfg, directory, iterations: int) -> list[float]:
    """Run ``iterations`` steps of ``cfg`` (whose train_iters sets the LR schedule), then save; the losses."""
    with single_layout():
        trainer = Trainer(cfg, CPU)
        result = [trainer.train_step()["loss"] for _ in range(iterations)]
        trainer.save_checkpoint(str(directory))
    return result


def perturb_and_save(model: torch.nn.Module, directory):
    """Add small noise to every tensor of a freshly built Hugging Face model (HF initializes biases to 0 and norms to
    1, which would hide a mixed-up mapping), save it with save_pretrained, and return it."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(directory)
    return model
