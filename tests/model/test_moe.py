"""The MoE layer in one process against plain per-token references: routing (softmax, pre-softmax, sigmoid, expert
bias), the balancing losses and their gradients, capacity dropping, grouped against looped experts, shared experts,
the layer pattern, and per-head query/key norms."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.config import ConfigError, ModelConfig
from megalite.model import GPTModel
from megalite.model.experts import grouped_mm_available
from megalite.model.moe import MoELayer

from ..helpers import TINY_MOE, single_layout, tiny_config


def _config(**options) -> ModelConfig:
    return dataclasses.replace(tiny_config().model, **{**TINY_MOE, **options})


def _layer(seed: int = 0, **options) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(_config(**options))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def _reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the chosen experts' MLPs, weighted, as the router's definition says (dropless)."""
    cfg = layer.cfg
    tokens = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(tokens)
    for t, token in enumerate(tokens):
        logits = layer.router.weight @ token
        if layer.router.bias is not None:
            logits = logits + layer.router.bias
        if cfg.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            chosen = torch.topk(scores + (layer.router.expert_bias if layer.router.expert_bias is not None else 0),
                                cfg.moe_router_topk).indices
            weights = scores[chosen] / scores[chosen].sum()
        elif cfg.moe_router_pre_softmax:
            weights, chosen = torch.topk(torch.softmax(logits, -1), cfg.moe_router_topk)
        else:
            top, chosen = torch.topk(logits, cfg.moe_router_topk)
            weights = torch.softmax(top, -1)
        for w, e in zip(weights, chosen.tolist()):
            expert = layer.experts[str(e)]
            h = expert.linear_fc1.weight @ token
            if expert.linear_fc1.bias is not None:
                h = h + expert.linear_fc1.bias
            if cfg.swiglu:
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            elif cfg.quick_geglu:   # gpt-oss' experts (transformers' GptOssExperts._apply_gate, alpha 1.702)
                gate, up = h.chunk(2)
                gate, up = gate.clamp(max=cfg.activation_func_clamp_value), up.clamp(-cfg.activation_func_clamp_value,
                                                                                   cfg.activation_func_clamp_value)
                h = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
            else:
                h = F.gelu(h)
            y = expert.linear_fc2.weight @ h
            if expert.linear_fc2.bias is not None:
                y = y + expert.linear_fc2.bias
            out[t] += w * y
    return out.view_as(x)


# gpt-oss' experts: clamped quick GeGLU with offset 1, biases (router's too); a clamp the tokens reach.
GPT_OSS_EXPERTS = {"quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 0.5}


@pytest.mark.parametrize("options", [
    {},
    {"moe_router_pre_softmax": True, "swiglu": True, "disable_bias_linear": True},
    GPT_OSS_EXPERTS,
    {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
])
def test_layer_equals_token_by_token_reference(options):
    with single_layout():
        layer = _layer(**options)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(torch.tensor([0.5, -0.5, 0.2, 0.0]))   # changes the choices, not weights
        x = torch.randn(2, 8, 64)
        torch.testing.assert_close(layer(x), _reference(layer, x), rtol=1e-5, atol=1e-5)


# DeepSeek-V3's router in small: 8 experts in 4 groups, each token's top 4 from its best 2 groups (each group scored
# by its top 4 / 2 = 2 experts, as DeepSeek and Megatron both do), sigmoid scores normalized, then scaled by 2.5.
DEEPSEEK_V3_ROUTER = {"num_experts": 8, "moe_router_topk": 4, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                      "moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5}


def _routed(options: dict, bias: bool) -> tuple[MoELayer, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layer, tokens [T, h], its routing weights [T, E], the plain top-k map without groups) for 64 tokens."""
    torch.manual_seed(0)
    # DeepSeek's router has no bias: without the linears' biases, megalite's has none either
    layer = _layer(**{"disable_bias_linear": True, **options}, moe_router_enable_expert_bias=bias).eval()
    if bias:
        layer.router.expert_bias.copy_(torch.randn(layer.cfg.num_experts) * 0.3)
    tokens = torch.randn(64, 64)
    with torch.no_grad():
        routing, routing_map = layer.router(tokens, 1)
        ungrouped = dataclasses.replace(layer.cfg, moe_router_num_groups=None, moe_router_group_topk=None)
        layer.router.cfg = ungrouped
        plain_map = layer.router(tokens, 1)[1]
        layer.router.cfg = layer.cfg
    assert torch.equal(routing_map, routing != 0)
    assert not torch.equal(routing_map, plain_map), "the groups change some tokens' choices"
    return layer, tokens, routing, plain_map


@pytest.mark.parametrize("bias", [False, True])
def test_group_limited_routing_equals_transformers_deepseek_v3_gate(bias):
    """The choices and weights of transformers' DeepseekV3TopkRouter given the same weight and score-correction bias
    (the expert bias: it chooses groups and experts, never weights them)."""
    deepseek_v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    with single_layout():
        layer, tokens, routing, _ = _routed(DEEPSEEK_V3_ROUTER, bias)
        gate = deepseek_v3.DeepseekV3TopkRouter(DeepseekV3Config(
            hidden_size=64, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, norm_topk_prob=True))
        with torch.no_grad():
            gate.weight.copy_(layer.router.weight)
            if bias:
                gate.e_score_correction_bias.copy_(layer.router.expert_bias)
            _, weights, chosen = gate(tokens)
        expected = torch.zeros_like(routing).scatter(1, chosen, weights)
        torch.testing.assert_close(routing, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(routing != 0, expected != 0)


@pytest.mark.parametrize("options, bias", [
    (DEEPSEEK_V3_ROUTER, True),
    ({**DEEPSEEK_V3_ROUTER, "moe_router_topk": 3, "moe_router_num_groups": 2, "moe_router_group_topk": 1},
     False),   # a group's top 3 sum
    ({"num_experts": 8, "moe_router_num_groups": 2, "moe_router_group_topk": 1}, False),   # softmax of the top logits
    ({"num_experts": 6, "moe_router_topk": 3, "moe_router_num_groups": 3, "moe_router_group_topk": 2,
      "moe_router_pre_softmax": True}, False),
])
def test_group_limited_routing_equals_megatron(options, bias):
    """Megatron-core's topk_routing_with_score_function (its group_limited_topk) on the same logits."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    with single_layout():
        layer, tokens, routing, _ = _routed(options, bias)
        cfg = layer.cfg
        with torch.no_grad():
            expected, expected_map = topk_routing_with_score_function(
                tokens @ layer.router.weight.t(), cfg.moe_router_topk, use_pre_softmax=cfg.moe_router_pre_softmax,
                num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
                scaling_factor=cfg.moe_router_topk_scaling_factor, score_function=cfg.moe_router_score_function,
                expert_bias=layer.router.expert_bias)
        torch.testing.assert_close(routing, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(routing != 0, expected_map)


@pytest.mark.parametrize("options", [{"swiglu": True}, GPT_OSS_EXPERTS])
def test_grouped_experts_equal_the_loop_forward_and_backward(options):
    with single_layout():
        x = torch.randn(2, 16, 64, requires_grad=True)
        assert grouped_mm_available(x, [64, 64, 32]), "this torch offers torch._grouped_mm on the CPU"
        results = []
        for grouped in (False, True):
            layer = _layer(moe_grouped_gemm=grouped, **options)
            out = layer(x)
            out.backward(torch.ones_like(out))
            results.append((out.detach(), x.grad.clone(), [p.grad.clone() for p in layer.parameters()]))
            x.grad = None
        (out0, dx0, grads0), (out1, dx1, grads1) = results
        torch.testing.assert_close(out1, out0, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dx1, dx0, rtol=1e-6, atol=1e-6)
        for g0, g1 in zip(grads0, grads1):
            torch.testing.assert_close(g1, g0, rtol=1e-6, atol=1e-6)


def _switch_loss(scores: torch.Tensor, k: int, coeff: float) -> torch.Tensor:
    """Switch Transformer's loss by its definition: E x sum_e f_e P_e, f_e the fraction of the k T assignments."""
    tokens, experts = scores.shape
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(k).indices, 1.0)
    fraction = chosen.sum(0) / (tokens * k)
    return coeff * experts * (fraction * scores.mean(0)).sum()


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_balancing_and_z_losses_enter_backward_scaled_by_the_loss_weight(kind):
    """Gradients of (sum of outputs) through the attached losses equal autograd of sum + weight x (aux + z)."""
    with single_layout():
        layer = _layer(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
        layer.router.loss_weight, layer.router.loss_scale = 0.25, 8.0
        x = torch.randn(2, 8, 64)
        layer(x).sum().backward()
        attached = layer.router.weight.grad.clone()
        layer.router.weight.grad = None
        aux = layer.router.statistics(x.device)[4].item() / 0.25
        z = layer.router.statistics(x.device)[5].item() / 0.25

        logits = F.linear(x.reshape(-1, 64), layer.router.weight, layer.router.bias)   # the router's bias too
        scores = torch.softmax(logits, -1)
        if kind == "aux_loss":
            expected_aux = _switch_loss(scores, 2, 0.1)
        else:   # per sequence, averaged over the two sequences
            expected_aux = sum(_switch_loss(s, 2, 0.1) for s in scores.view(2, 8, -1)) / 2
        expected_z = 0.01 * torch.logsumexp(logits, -1).square().mean()
        assert aux == pytest.approx(expected_aux.item(), rel=1e-5)
        assert z == pytest.approx(expected_z.item(), rel=1e-5)
        layer.eval()   # the same forward without attached losses, plus the losses by their definitions
        total = layer(x).sum() + 0.25 * 8.0 * (expected_aux + expected_z)
        total.backward()
        # (rounding: sums of 16 tokens' terms in two orders; with the router's bias an element's gradient of ~0.1
        # differs by 3e-6)
        torch.testing.assert_close(attached, layer.router.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keeps_each_experts_best_or_first_tokens(policy):
    with single_layout():
        layer = _layer(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy)
        tokens = torch.randn(16, 64)
        routing, routing_map = layer.router(tokens, 2)
        limit = math.ceil(16 * 2 / 4 * 0.5)
        assert (routing_map.sum(0) <= limit).all()
        layer.cfg = dataclasses.replace(layer.cfg, moe_expert_capacity_factor=None)
        layer.router.cfg = layer.cfg
        full, full_map = layer.router(tokens, 2)
        for e in range(4):
            routed = full_map[:, e].nonzero().flatten()
            if policy == "probs":
                kept = routed[full[routed, e].argsort(descending=True)[:limit]]
            else:
                kept = routed[:limit]
            assert sorted(routing_map[:, e].nonzero().flatten().tolist()) == sorted(kept.tolist())
        torch.testing.assert_close(routing, full * routing_map)
        assert layer.router.statistics(tokens.device)[-1] > 0   # dropped assignments counted


def test_expert_bias_update_moves_towards_equal_load_and_stays_fp32():
    with single_layout():
        layer = _layer(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_bias_update_rate=0.1)
        layer.to(torch.bfloat16)
        assert layer.router.expert_bias.dtype == torch.float32 and hasattr(layer.router.expert_bias, "full_shape")
        layer.router.update_expert_bias(torch.tensor([10.0, 2.0, 4.0, 0.0]))
        assert layer.router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, -0.0, 0.1])


def test_shared_expert_with_gate_adds_a_gated_dense_mlp():
    with single_layout():
        layer = _layer(moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True)
        x = torch.randn(2, 8, 64)
        shared = layer.shared_experts
        dense = shared.linear_fc2(F.gelu(shared.linear_fc1(x)))
        expected = _reference(layer, x) + torch.sigmoid(x @ shared.gate_weight.t()) * dense
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_layer_pattern_places_moe_layers_and_names_experts_globally():
    cfg = _config(num_layers=4, moe_layer_freq="[0,1,1,0]")
    assert cfg.moe_layers() == [False, True, True, False]
    assert _config(num_layers=4, moe_layer_freq="2").moe_layers() == [True, False, True, False]
    assert _config(num_layers=4, moe_layer_freq="([1]+[0])*2").moe_layers() == [True, False, True, False]
    for bad in ("[0,1]", "[0,2,1,1]", "0", "[1]*4+__import__('os')"):
        with pytest.raises(ConfigError):
            _config(num_layers=4, moe_layer_freq=bad).moe_layers()
    with single_layout():
        names = [n for n, _ in GPTModel(cfg).canonical_named_parameters()]
    assert "layers.1.mlp.experts.3.linear_fc2.weight" in names and "layers.0.mlp.linear_fc1.weight" in names
    assert not any(n.startswith("layers.0.mlp.experts") or n.startswith("layers.3.mlp.router") for n in names)


def test_qk_layernorm_normalizes_each_head_before_attention():
    cfg = dataclasses.replace(tiny_config().model, qk_layernorm=True, normalization="RMSNorm")
    with single_layout():
        torch.manual_seed(0)
        model = GPTModel(cfg)
        model.initialize(1)
        attention = model.layers[0].self_attention
        with torch.no_grad():
            attention.q_layernorm.weight.normal_()
        x = torch.randn(2, 8, 64)
        q, k, v = attention.linear_qkv(x).split(64, dim=-1)

        def per_head(t, norm):
            t = t.view(2, 8, 4, 16)
            return (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * norm.weight).transpose(1, 2)

        expected = F.scaled_dot_product_attention(per_head(q, attention.q_layernorm), per_head(k, attention.k_layernorm),
                                                  v.view(2, 8, 4, 16).transpose(1, 2), is_causal=True)
        expected = attention.linear_proj(expected.transpose(1, 2).reshape(2, 8, 64))
        torch.testing.assert_close(attention(x), expected, rtol=1e-5, atol=1e-5)
        names = [n for n, _ in model.canonical_named_parameters()]
        assert "layers.0.self_attention.q_layernorm.weight" in names


def test_full_recompute_gives_the_same_gradients_and_counts_the_routing_once():
    """The recomputed forward (in backward) attaches the balancing losses and counts the loads; the first, no-grad
    forward does neither."""
    results = []
    for recompute in ({}, {"recompute_granularity": "full", "recompute_method": "uniform"}):
        cfg = _config(moe_z_loss_coeff=1e-2, **recompute)
        with single_layout():
            model = GPTModel(cfg)
            model.initialize(3)
            tokens = torch.randint(0, 301, (2, 33), generator=torch.Generator().manual_seed(0))
            model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
            results.append(([p.grad.clone() for p in model.parameters()],
                            [layer.mlp.router.statistics(tokens.device).clone() for layer in model.layers]))
    (grads, stats), (recomputed_grads, recomputed_stats) = results
    for g, r in zip(grads, recomputed_grads):
        torch.testing.assert_close(r, g, rtol=1e-6, atol=1e-7)
    for s, r in zip(stats, recomputed_stats):
        torch.testing.assert_close(r, s)
    assert stats[0][:4].sum() == 2 * 32 * 2   # tokens x top-2, once


class _HostReads(TorchDispatchMode):
    """Counts what makes the host wait for the device (a stream sync on CUDA): reads of values (``tolist``, ``cpu``,
    ``item``) and operations whose output size depends on values (boolean indexing, ``nonzero``,
    ``repeat_interleave`` without its output size)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        for name in ("tolist", "cpu"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def read(tensor, *args, **kwargs):
            self.count += 1
            return original(tensor, *args, **kwargs)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if (func in (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default)
                or (func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]))
                or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None)):
            self.count += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("options", [{"moe_grouped_gemm": True}, {"moe_grouped_gemm": False, "swiglu": True}])
def test_one_host_read_per_moe_layer_forward_and_backward(options, monkeypatch):
    """The split sizes are the only values the host reads (once): no boolean indexing, no bias repeat sized on the
    device, no copies of the counts from the host."""
    with single_layout():
        layer = _layer(**options)
        x = torch.randn(2, 16, 64, requires_grad=True)
        with _HostReads(monkeypatch) as reads:
            layer(x).sum().backward()
        assert reads.count == 1


class _FakeExpertGroup:
    """Two expert-parallel ranks in one process for the all-to-all dispatcher's host reads: the counts come back as
    sent, the rows as zeros (their values are not what is counted)."""
    ranks = (0, 1)
    size = 2
    group = None

    @staticmethod
    def all_to_all_single(out, x, output_splits=None, input_splits=None, group=None):
        out.copy_(x) if output_splits is None else out.zero_()


def test_all_to_all_dispatch_reads_the_host_once(monkeypatch):
    from megalite.model import dispatcher

    with single_layout():
        layer = _layer(moe_grouped_gemm=False, disable_bias_linear=True)   # all four experts here: the loop runs two
        monkeypatch.setattr(dispatcher.parallel_state, "get_expert_model_parallel_group", lambda: _FakeExpertGroup)
        monkeypatch.setattr(dispatcher, "dist", _FakeExpertGroup)
        x = torch.randn(2, 16, 64, requires_grad=True)
        with _HostReads(monkeypatch) as reads:
            layer(x).sum().backward()
        assert reads.count == 1


def _forward_backward(layer: MoELayer, x: torch.Tensor):
    out = layer(x)
    out.backward(torch.ones_like(out))
    return out.detach(), [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("options", [{}, {"swiglu": True, "disable_bias_linear": True}])
def test_grouped_experts_read_their_weights_in_place_bit_for_bit_as_stacked(options, monkeypatch):
    """The experts' weights of a kind lie stacked in memory, so the grouped product takes them without a copy, in
    every micro-batch, and after a cast; laid out apart (as FSDP2's gathered parameters) they are stacked, with
    the same bits."""
    from megalite.model.experts import stacked

    with single_layout():
        layer = _layer(moe_grouped_gemm=True, **options).double().float()   # moved: laid out again
        x = torch.randn(2, 16, 64)
        for group in layer.experts.stacked_parameters():
            assert stacked(group).data_ptr() == group[0].data_ptr()
        stacks = []
        real_stack = torch.stack
        monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or real_stack(*a, **k))
        in_place = [_forward_backward(layer, x) for _ in range(2)]   # two micro-batches: gradients accumulate
        assert not stacks
        monkeypatch.setattr(torch, "stack", real_stack)
        layer.zero_grad()
        for p in layer.experts.parameters():
            p.data = p.data.clone()   # each its own storage
        for group in layer.experts.stacked_parameters():
            assert stacked(group).data_ptr() != group[0].data_ptr()
        copied = [_forward_backward(layer, x) for _ in range(2)]
        for (out, grads), (out_copied, grads_copied) in zip(in_place, copied):
            assert torch.equal(out, out_copied)
            assert all(torch.equal(g, h) for g, h in zip(grads, grads_copied))


def test_the_data_parallel_buffer_keeps_each_experts_group_stacked():
    from megalite.model.experts import LocalExperts, stacked
    from megalite.training import Trainer

    with single_layout():
        cfg = tiny_config(model={**TINY_MOE, "moe_grouped_gemm": True}, data={"eval_interval": 0})
        trainer = Trainer.on_registered_layout(cfg, torch.device("cpu"))
        experts = [m for m in trainer.model.modules() if isinstance(m, LocalExperts)]
        assert experts
        for module in experts:
            for group in module.stacked_parameters():
                assert stacked(group).data_ptr() == group[0].data_ptr()
                buffers = {e.param_buffer.untyped_storage().data_ptr() for e in trainer.engine.engines}
                assert group[0].untyped_storage().data_ptr() in buffers   # the parameters live in the engine's buffer


def test_a_move_that_changes_nothing_keeps_the_experts_in_the_data_parallel_buffer():
    from megalite.model.experts import LocalExperts
    from megalite.training import Trainer

    with single_layout():
        cfg = tiny_config(model={**TINY_MOE, "moe_grouped_gemm": True}, data={"eval_interval": 0})
        trainer = Trainer.on_registered_layout(cfg, torch.device("cpu"))
        experts = next(m for m in trainer.model.modules() if isinstance(m, LocalExperts))
        before = [p.data_ptr() for p in experts.parameters()]
        trainer.model.to(torch.device("cpu"), torch.float32)
        assert [p.data_ptr() for p in experts.parameters()] == before
