"""The peer of our GPT: the same model written in plain PyTorch (nn.Embedding, nn.LayerNorm, nn.Linear,
scaled_dot_product_attention, F.cross_entropy), and its tensor-parallel plan for torch's DTensor.

Same maths as megalite's GPTModel with the bench config (GPT-2: learned positions, pre-norm LayerNorm, exact GeLU,
biases, output layer tied to the word embedding, dropout off, fp32): ``copy_from(ours)`` takes our full (TP=1)
model's weights, so both start from the same values and their first losses agree to fp32 round-off.

One layout difference, for tensor parallelism: our fused QKV weight is [Wq; Wk; Wv] with each block split over TP
separately; here the rows are grouped by head ([q k v] of head 0, then of head 1, ...), so that DTensor's
ColwiseParallel, which cuts the rows into contiguous blocks, gives each rank whole heads. The forward reads q, k and
v back per head; the maths is the same one matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.head_dim = hidden // heads
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # [b, s, heads (this rank's, under TP), 3, d] -> q, k, v each [b, heads, s, d]
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(context.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class ReferenceGPT(nn.Module):
    """A whole GPT, or the layers [first_layer, first_layer + num_layers) of one (a pipeline stage: with the
    embedding if ``pre_process``, with the final norm and output layer if ``post_process``)."""

    def __init__(self, vocab: int, hidden: int, heads: int, num_layers: int, seq: int, ffn: int | None = None,
                 eps: float = 1e-5):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn or 4 * hidden, eps) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight   # tied
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab]."""
        x = self.wte(tokens) + self.wpe(self.positions[: tokens.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @classmethod
    def like(cls, cfg) -> "ReferenceGPT":
        """The reference model of a megalite ModelConfig (weights to be copied with ``copy_from``)."""
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_layers, cfg.seq_length,
                   cfg.ffn_size, cfg.layernorm_epsilon)

    @torch.no_grad()
    def copy_from(self, ours) -> "ReferenceGPT":
        """Take the weights of our whole GPTModel (TP=1, one stage), reordering the QKV rows by head."""
        theirs = dict(ours.named_parameters())
        vocab = self.wte.weight.shape[0]
        self.wte.weight.copy_(theirs["embedding.word.weight"][:vocab])
        self.wpe.weight.copy_(theirs["embedding.position.weight"])
        heads = None
        for i, block in enumerate(self.blocks):
            p = f"layers.{i}."
            heads = block.qkv.weight.shape[0] // (3 * block.head_dim)
            qkv_w, qkv_b = theirs[p + "self_attention.linear_qkv.weight"], theirs[p + "self_attention.linear_qkv.bias"]
            block.qkv.weight.copy_(qkv_w.view(3, heads, block.head_dim, -1).transpose(0, 1).reshape_as(qkv_w))
            block.qkv.bias.copy_(qkv_b.view(3, heads, block.head_dim).transpose(0, 1).reshape(-1))
            for mine, name in ((block.ln_1, "input_norm"), (block.proj, "self_attention.linear_proj"),
                               (block.ln_2, "pre_mlp_norm"), (block.fc1, "mlp.linear_fc1"),
                               (block.fc2, "mlp.linear_fc2")):
                mine.weight.copy_(theirs[p + name + ".weight"])
                mine.bias.copy_(theirs[p + name + ".bias"])
        self.ln_f.weight.copy_(theirs["final_norm.weight"])
        self.ln_f.bias.copy_(theirs["final_norm.bias"])
        return self


def parallelize(model: ReferenceGPT, mesh) -> ReferenceGPT:
    """torch's tensor parallelism on the reference model (the torchtitan recipe, without sequence parallelism):
    per block QKV and fc1 column-parallel, proj and fc2 row-parallel; the word embedding row-parallel (split by
    vocabulary) and the tied output layer column-parallel with its logits left split by vocabulary for
    ``loss_parallel``. Norms and the position table stay plain replicated tensors, as in our model."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.qkv": ColwiseParallel(), f"blocks.{i}.proj": RowwiseParallel(),
                     f"blocks.{i}.fc1": ColwiseParallel(), f"blocks.{i}.fc2": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    # Both sharded their own copy of the tied weight along the vocabulary (dim 0): tie them again.
    model.lm_head.weight = model.wte.weight
    return model


def clip_grad_norm_(params, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ for a mix of DTensor and plain parameters (torch's own stacks the per-tensor
    norms, which fails on such a mix): sharded norms are completed over their mesh, replicated ones counted once."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norms = []
    for g in grads:
        n = torch.linalg.vector_norm(g)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    coefficient = min(max_norm / (float(total) + 1e-6), 1.0)
    for g in grads:
        g.mul_(coefficient)
    return float(total)
