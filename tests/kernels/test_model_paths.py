"""The model's fused code paths, run on CPU through the kernels' torch ops, compute what its torch path computes; and
on CPU the default policy is exactly the torch path.

The fused paths are normally taken only for CUDA tensors; a policy that hands out ``torch_ops`` for CPU tensors runs
every one of them here (skipped bias add + bias-GeLU, the norms, rotary, the masked-softmax attention core with GQA,
the per-shard cross entropy). fp32, tolerance rtol 1e-5 / atol 1e-6 on the loss and every parameter's gradient.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from megalite.kernels import KernelPolicy, torch_ops
from megalite.model import GPTModel
from megalite.tensor_parallel import TensorParallelRNG

from ..helpers import tiny_config

pytestmark = pytest.mark.usefixtures("single_process_layout")   # tests/conftest.py


def _spy_ops(calls: set[str]) -> types.SimpleNamespace:
    """torch_ops, recording which functions were called."""
    def wrap(name):
        def call(*args, **kwargs):
            calls.add(name)
            return getattr(torch_ops, name)(*args, **kwargs)
        return call
    return types.SimpleNamespace(**{name: wrap(name) for name in dir(torch_ops) if name.endswith(
        ("_forward", "_backward", "_stats", "_grad"))})


@dataclasses.dataclass(frozen=True)
class CPUKernelPolicy(KernelPolicy):
    """Hands out the kernels' torch ops (spied) for CPU tensors, where the real policy hands out None."""
    calls: set = dataclasses.field(default_factory=set, compare=False)

    def ops(self, op, x):
        return _spy_ops(self.calls) if self.enabled(op) else None


def _loss_and_grads(model_cfg, kernels: KernelPolicy):
    model = GPTModel(model_cfg, TensorParallelRNG(0, 0, 0, torch.device("cpu")), kernels=kernels)
    model.initialize(seed=3)
    tokens = torch.randint(301, (2, 33), generator=torch.Generator().manual_seed(5))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.mean().backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
             group_query_attention=True, num_query_groups=2)
ARCHITECTURES = {"gpt2": {}, "gpt2_tanh_gelu": {"openai_gelu": True}, "llama": LLAMA,
                 "qwen2_rope_scaling": {**LLAMA, "add_qkv_bias": True, "use_rope_scaling": True,
                                        "rope_scaling_original_max_position_embeddings": 16}}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_default_policy_on_cpu_is_the_torch_path_bit_for_bit(arch):
    cfg = tiny_config(model=ARCHITECTURES[arch]).model
    loss, grads = _loss_and_grads(cfg, KernelPolicy())
    off_loss, off_grads = _loss_and_grads(cfg, KernelPolicy("off"))
    assert torch.equal(loss, off_loss)
    assert all(torch.equal(grads[name], off_grads[name]) for name in grads)


@pytest.mark.parametrize("arch, expected", [
    ("gpt2", {"layer_norm", "bias_gelu", "masked_softmax", "cross_entropy"}),
    ("gpt2_tanh_gelu", {"layer_norm", "bias_gelu", "masked_softmax", "cross_entropy"}),
    ("llama", {"rms_norm", "rope", "masked_softmax", "cross_entropy"}),
    ("qwen2_rope_scaling", {"rms_norm", "rope", "masked_softmax", "cross_entropy"}),
])
def test_fused_paths_compute_what_the_torch_path_computes(arch, expected):
    cfg = tiny_config(model=ARCHITECTURES[arch]).model
    loss, grads = _loss_and_grads(cfg, KernelPolicy("off"))
    fused_policy = CPUKernelPolicy("on")
    fused_loss, fused_grads = _loss_and_grads(cfg, fused_policy)
    called = {name.rsplit("_", 1)[0] for name in fused_policy.calls}
    assert {"cross_entropy" if name.startswith("cross_entropy") else name for name in called} == expected
    assert len(fused_policy.calls) == 2 * len(expected)   # every forward and its backward
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(fused_grads[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_auto_keeps_sdpa_for_the_attention_core():
    policy = CPUKernelPolicy("auto")
    _loss_and_grads(tiny_config().model, policy)
    assert not any(name.startswith("masked_softmax") for name in policy.calls)
    assert "bias_gelu_forward" in policy.calls
