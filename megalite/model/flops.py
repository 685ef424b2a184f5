"""The two halves of MFU: the model's FLOPs per iteration, and the peak FLOP/s of the device that runs it.

Model FLOPs per iteration (Korthikanti et al. 2022, appendix; Narayanan et al. 2021 eq. 3):
72 B L s h^2 (1 + s/(6h) + V/(12 h L)) for GPT shapes (f = 4h, no grouping). Written here for the exact
architecture: 6 B s (L (dense multiply-adds per token per layer) + 2 L s h + V h) - forward 2 FLOPs per
multiply-add, backward twice the forward, the attention scores over the full s x s square as in the paper - which is
the formula above when a layer's matrices are 12 h^2. Recompute is work that MFU does not count. Multi-token
prediction adds, per depth, a layer like the last one, its 2h x h projection and another output layer (Megatron's
count, which also adds 3h multiply-adds for the norms).

The trainer (MFU in the metrics), the planner (step time) and tools/gpu_check.py all use these.
"""

from __future__ import annotations

from typing import Optional

from megalite.config import ModelConfig

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from NVIDIA's data sheets, keyed by a part of the device name;
# the first key found in the name wins, so "H100 PCIe" must come before the "H100" of the SXM part.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0}


def peak_bf16_tflops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of the device called ``device_name`` (torch.cuda.get_device_name), None if unknown."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in device_name), None)


def _mlp_macs(model: ModelConfig, ffn: int) -> int:
    return model.hidden_size * ffn * (3 if model.gated_mlp else 2)


def attention_macs_per_token(model: ModelConfig) -> int:
    """Multiply-adds of one layer's attention projections per token: QKV and output projection; with multi-latent
    attention its down- and up-projections and output projection."""
    h = model.hidden_size
    if not model.multi_latent_attention:
        return h * (model.query_size + 2 * model.query_groups * model.head_dim) + model.query_size * h
    heads, rope, rank = model.num_attention_heads, model.qk_pos_emb_head_dim, model.kv_lora_rank
    q_width = heads * (model.qk_head_dim + rope)
    queries = h * q_width if model.q_lora_rank is None else model.q_lora_rank * (h + q_width)
    keys_values = h * (rank + rope) + rank * heads * (model.qk_head_dim + model.v_head_dim)
    return queries + keys_values + heads * model.v_head_dim * h


def core_width(model: ModelConfig) -> int:
    """Channels a query's scores and its weighted sum of values take over all heads (q k^T + probabilities x v) per
    key: 2 x heads x head dim, or heads x (qk + rope + v channels) with multi-latent attention."""
    if model.multi_latent_attention:
        return model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim)
    return 2 * model.query_size


def dense_macs_per_token_per_layer(model: ModelConfig) -> int:
    """Multiply-adds of one layer's matrices per token: attention projections, MLP."""
    return attention_macs_per_token(model) + _mlp_macs(model, model.ffn_size)


def macs_per_token_per_layer(model: ModelConfig, index: int) -> int:
    """Layer ``index``'s multiply-adds per token of its *active* parameters: a dense layer's, or for an MoE layer
    attention, the router (h x E), the k experts a token goes to and the shared expert (not the E - k others)."""
    if not model.moe_layers()[min(index, model.num_layers - 1)]:   # MTP's layers (after the last) are like the last
        return dense_macs_per_token_per_layer(model)
    attention = dense_macs_per_token_per_layer(model) - _mlp_macs(model, model.ffn_size)
    shared = model.moe_shared_expert_intermediate_size or 0
    return (attention + model.hidden_size * model.num_experts + model.moe_router_topk *
            _mlp_macs(model, model.expert_ffn_size) + _mlp_macs(model, shared) + (model.hidden_size if
                                                                                 model.moe_shared_expert_gate else 0))


def model_flops_per_iteration(model: ModelConfig, global_batch_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward, no recompute): see the module docstring. A mixture
    of experts counts its active parameters (each token's k experts), as MFU is reported for MoE models."""
    s, h = model.seq_length, model.hidden_size
    depth = model.mtp_num_layers or 0
    L = model.num_layers + depth
    per_token = (sum(macs_per_token_per_layer(model, i) for i in range(L)) + L * s * core_width(model)
                 + (1 + depth) * model.vocab_size * h + depth * (2 * h * h + 3 * h))
    return 6.0 * global_batch_size * s * per_token
