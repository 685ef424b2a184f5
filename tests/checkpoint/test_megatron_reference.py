"""The Megatron-LM reference (megatron_reference.py) in one process: for each tiny style, the models Megatron builds
save in both of Megatron's formats and load back (as ``--load --use-checkpoint-args`` does) to the same logits, bit
for bit; a checkpoint missing a tensor fails to load."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from .megatron_reference import (LOAD_FLAGS, STYLES, build_models, loaded_megatron, megatron_args, megatron_layout,  # noqa: E402
                                 megatron_logits, save_megatron)

TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("style", STYLES)
def test_save_and_load_both_formats_give_the_same_logits(style, tmp_path):
    args = megatron_args(style)
    with megatron_layout(args):
        models = build_models(args)
        expected = megatron_logits(args, models, TOKENS)
        for fmt in ("torch_dist", "torch"):
            save_megatron(megatron_args(style, ckpt_format=fmt), models, tmp_path / fmt)
    assert expected.shape == (2, 16, args.padded_vocab_size) and expected.dtype == torch.float32
    for fmt in ("torch_dist", "torch"):
        with loaded_megatron(tmp_path / fmt, flags=LOAD_FLAGS.get(style, ())) as (loaded_args, loaded):
            assert loaded_args.ckpt_format == fmt and loaded_args.iteration == 10
            torch.testing.assert_close(megatron_logits(loaded_args, loaded, TOKENS), expected, rtol=0, atol=0)


@pytest.mark.parametrize("style, expected", [("gpt3", "linear_fc2.bias"), ("qwen", "linear_qkv.bias"),
                                             ("qwen_moe", "router.expert_bias")])
def test_perturbation_reaches_every_norm_and_bias(style, expected):
    """Norm weights and biases start at 1 and 0; the perturbation moves each of them (a converter that drops one
    would otherwise go unseen)."""
    args = megatron_args(style)
    with megatron_layout(args):
        model = build_models(args)[0]
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    touched = [n for n in state if "norm" in n or n.endswith((".bias", "expert_bias"))]
    assert any(expected in n for n in touched), touched
    for name in touched:
        assert not torch.all(state[name] == state[name].flatten()[0]), name


def test_a_missing_tensor_fails_the_load(tmp_path):
    args = megatron_args("llama", ckpt_format="torch")
    with megatron_layout(args):
        save_megatron(args, build_models(args), tmp_path)
    path = tmp_path / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    del state["model"]["decoder.final_layernorm.weight"]
    torch.save(state, path)
    with pytest.raises(RuntimeError, match="final_layernorm"):
        with loaded_megatron(tmp_path):
            pass


def test_the_layout_leaves_nothing_behind():
    """megalite's tests share the process: the CUDA stand-ins, Megatron's groups and the 1-rank world are undone."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    before = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, torch.get_rng_state())
    with megatron_layout(megatron_args("llama")):
        assert torch.cuda.current_device() == "cpu" and mpu.model_parallel_is_initialized()
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda) == before[:3]
    assert torch.equal(torch.get_rng_state(), before[3])
    assert not mpu.model_parallel_is_initialized() and not dist.is_initialized()
