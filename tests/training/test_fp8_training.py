"""FP8 training in one process: 30 iterations of a tiny GPT on the built-in corpus in bf16 and in each FP8 recipe
(hybrid format) stay within 2% of the bf16 losses; a delayed-scaling run saved and resumed has its amax histories
back bit for bit and continues with the uninterrupted run's losses; the start-up line names the recipe and says
that without FP8 tensor cores it is not faster."""

from __future__ import annotations

import pytest
import torch

from megalite.tensor_parallel import fp8_linear
from megalite.training import Trainer

from ..checkpoint.helpers import CPU
from ..helpers import losses, single_layout, tiny_config, with_checkpoint

ITERATIONS = 30   # torch._scaled_mm on the CPU is a slow reference kernel (~0.15 s for 128 x 64 x 256)
RECIPES = {"tensorwise": {}, "delayed": {"fp8_amax_history_len": 16, "fp8_amax_compute_algo": "max"},
           "rowwise": {}}


def _config(recipe: str | None, **training):
    model = {} if recipe is None else {"fp8_format": "hybrid", "fp8_recipe": recipe, **RECIPES[recipe]}
    training = {"bf16": True, "train_iters": ITERATIONS, "micro_batch_size": 4, "global_batch_size": 4, **training}
    return tiny_config(model=model, training=training, data={"mock_data": False, "eval_interval": 0})


def test_fp8_recipes_train_like_bf16():
    with single_layout():
        bf16 = losses(Trainer.on_registered_layout(_config(None), CPU).train())
        runs = {recipe: losses(Trainer.on_registered_layout(_config(recipe), CPU).train()) for recipe in RECIPES}
    assert bf16[-1] < bf16[0] - 0.3   # it learns
    for recipe, run in runs.items():
        gaps = [abs(a - b) / b for a, b in zip(run[-10:], bf16[-10:])]
        assert max(gaps) < 0.02, f"{recipe}: the last 10 losses differ from bf16's by up to {max(gaps):.2%}"
        assert run != bf16, f"{recipe}: the same losses as bf16 (no FP8 at all?)"


def test_delayed_histories_resume_bit_for_bit(tmp_path):
    cfg = _config("delayed", train_iters=4)
    with single_layout():
        whole = losses(Trainer.on_registered_layout(cfg, CPU).train())
        first = Trainer.on_registered_layout(with_checkpoint(cfg, save=str(tmp_path)), CPU)
        head = [first.train_step()["loss"] for _ in range(2)]
        first.save_checkpoint(str(tmp_path))
        resumed = Trainer.on_registered_layout(with_checkpoint(cfg, load=str(tmp_path)), CPU)
        assert ("bfloat16 with FP8 hybrid delayed (amax history 16, max) in the attention and MLP linears (no FP8 "
                "tensor cores on cpu: correct, but not faster than bf16" in resumed.describe())
        assert len(resumed.fp8_histories) == 2 * 4   # qkv, proj, fc1, fc2 of both layers
        for (name, saved), (again, loaded) in zip(first.fp8_histories, resumed.fp8_histories):
            assert name == again and saved.steps == loaded.steps == 2
            assert torch.equal(saved.history, loaded.history) and torch.equal(saved.scales, loaded.scales)
        rest = losses(resumed.train())
    assert head + rest == whole


def test_bf16_checkpoint_loads_into_a_delayed_run_with_fresh_histories(tmp_path):
    with single_layout():
        first = Trainer.on_registered_layout(with_checkpoint(_config(None, train_iters=2), save=str(tmp_path)), CPU)
        first.train()
        resumed = Trainer.on_registered_layout(with_checkpoint(_config("delayed", train_iters=3), load=str(tmp_path)), CPU)
    assert resumed.fp8_histories and all(history.steps == 0 for _, history in resumed.fp8_histories)


def _linear_gradients(recipe: str | None) -> dict[str, torch.Tensor]:
    """The main gradients of the attention and MLP linears after one global batch, fp32 activations."""
    with single_layout():
        trainer = Trainer.on_registered_layout(_config(recipe, bf16=False, train_iters=1), CPU)
        trainer.forward_backward(trainer.data.train, 0)
        return {name: param.main_grad.clone() for name, param in trainer.canonical_named_parameters()
                if ".linear_" in name}


def test_fp8_linears_hand_their_weight_gradients_to_the_optimizer():
    """Gradient-accumulation fusion (on by default) adds a linear's weight gradient into the main gradient from
    inside its backward; an FP8 linear returns it to autograd instead, so its weight keeps the hook: its main
    gradients are FP8's rounding away from the plain run's (fused away, they would be zero)."""
    plain, fp8 = _linear_gradients(None), _linear_gradients("tensorwise")
    assert plain.keys() == fp8.keys() and any(name.endswith("linear_qkv.weight") for name in plain)
    for name, grad in plain.items():
        assert float((fp8[name] - grad).norm() / grad.norm()) < 0.1, name


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_each_fp8_weight_is_quantized_once_a_step(recipe, monkeypatch):
    """Four micro-batches a step: every FP8 weight is quantized once a step, not once a micro-batch (nor never
    again: the optimizer writes the weights through the engine's flat buffer, which their version counters do not
    see)."""
    cfg = _config(recipe, train_iters=3, micro_batch_size=1, global_batch_size=4)
    quantized, original = [], fp8_linear.quantize

    def counting(x, scale, dtype):
        quantized.append(id(x))
        return original(x, scale, dtype)
    monkeypatch.setattr(fp8_linear, "quantize", counting)
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, CPU)
        weights = {id(m.weight) for m in trainer.model.modules() if getattr(m, "fp8", None) is not None}
        for step in range(1, 4):
            trainer.train_step()
            counts = [quantized.count(w) for w in weights]
            assert counts == [step] * len(weights), f"step {step}: {counts}"
