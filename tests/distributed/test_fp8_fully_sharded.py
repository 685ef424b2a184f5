"""The tensors behind --fp8-param-gather at ZeRO-3 (megalite.distributed.fp8_fully_sharded), in one process: the
sharded weight behaves as its fp32 tensor and hands FSDP2 the FP8 bytes of its scale; the gathered weight gives the
FP8 linear its values as they are and every other op their dequantized values."""

from __future__ import annotations

import torch

from megalite.distributed.fp8_fully_sharded import Fp8GatheredWeight, Fp8ShardedWeight, Fp8ShardScales, plain
from megalite.parallel_state import GroupInfo
from megalite.tensor_parallel.fp8 import E4M3, quantize, scale_from_amax


class _Linear(torch.nn.Module):   # what the scales need of an FP8 linear
    fp8_history = None

    class fp8:
        margin = 0


def _sharded(values: torch.Tensor) -> tuple[Fp8ShardedWeight, Fp8ShardScales, _Linear]:
    scales, linear = Fp8ShardScales(torch.bfloat16, GroupInfo(None, (0,))), _Linear()
    return Fp8ShardedWeight(values, linear, scales), scales, linear


def test_the_sharded_weight_is_its_fp32_tensor_for_every_op():
    values = torch.randn(8, 4)
    weight, _, _ = _sharded(values)
    assert torch.equal(weight * 2, values * 2) and type(weight * 2) is torch.Tensor
    for view in (weight.view(-1), weight[2:4], weight.detach(), torch.chunk(weight, 2)[1]):
        assert isinstance(view, Fp8ShardedWeight)   # what FSDP2 does to shard it keeps the extension
    assert plain(weight[2:4]).untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
    weight[2:4].copy_(torch.ones(2, 4))   # an optimizer's or a checkpoint's write lands in the tensor inside
    assert torch.equal(values[2:4], torch.ones(2, 4))


def test_pre_all_gather_sends_the_bytes_of_the_whole_weights_scale():
    values = torch.randn(8, 4)
    weight, scales, linear = _sharded(values)
    scale = torch.tensor(100.0)
    scales.scales = {id(linear): scale}   # as if computed for the whole weight
    (sent,), (sent_scale,) = weight.fsdp_pre_all_gather(mesh=None)
    assert sent.dtype == torch.uint8 and sent_scale is scale
    assert torch.equal(sent.view(E4M3).float(), quantize(values.to(torch.bfloat16), scale, E4M3).float())


def test_the_gathered_weight_gives_fp8_values_to_the_linear_and_dequantized_ones_to_the_rest():
    values = torch.randn(8, 4)
    scale = scale_from_amax(values.abs().amax(), E4M3)
    data = quantize(values, scale, E4M3)
    weight, _, _ = _sharded(values)
    gathered, inner = weight.fsdp_post_all_gather((data.view(torch.uint8),), (scale,), torch.float32)
    assert isinstance(gathered, Fp8GatheredWeight) and gathered.dtype == torch.float32
    assert inner[0].dtype == torch.uint8   # the storage FSDP2 frees and refills
    view = torch.as_strided(gathered, (8, 4), (4, 1))   # what FSDP2 takes of it, then a parameter
    parameter = torch.nn.Parameter(view)
    found = parameter.fp8_gathered
    assert torch.equal(found.values.float(), data.float()) and torch.equal(found.inverse_scale, scale.reciprocal())
    assert found.version == parameter._version
    dequantized = data.float() * scale.reciprocal()
    assert torch.equal(parameter + 0, dequantized) and type(parameter + 0) is torch.Tensor
