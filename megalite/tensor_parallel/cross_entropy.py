"""Cross entropy over vocabulary-split logits that never gathers the full logits.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. The softmax needs three reductions over
TP: the max (for stability), the target's logit (only its owner has it), and the sum of exponentials; each is a
scalar per token, so traffic is tokens x 3 numbers instead of tokens x vocabulary. Padded vocabulary columns are set to
-inf, so they get zero probability, no gradient, and the loss does not depend on how much padding the TP size implies.

Fused (on CUDA, when the kernel policy says so; ``--no-cross-entropy-loss-fusion`` turns it off): a kernel computes
this rank's max, sum of exponentials (relative to that max) and target logit in one pass over the logits; the maxima
are all-reduced, each rank rescales its sum to the global max, and the sums and target logits are all-reduced
together (two all-reduces instead of three). Backward recomputes the softmax from the saved logits (in their own
dtype) instead of keeping an fp32 softmax: with bf16 logits, half that memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite import parallel_state
from megalite.kernels import DEFAULT_POLICY, KernelPolicy
from megalite.kernels.policy import CROSS_ENTROPY


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_size: int):
        tensor = parallel_state.get_tensor_model_parallel_group()
        per_rank = logits.shape[-1]
        start = tensor.rank * per_rank
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        columns = torch.arange(start, start + per_rank, device=logits.device)
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))

        logits_max = tensor.max(logits.max(dim=-1).values)
        logits = logits - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = tensor.sum(target_logit)

        exp_logits = logits.exp()
        sum_exp = tensor.sum(exp_logits.sum(dim=-1))
        loss = sum_exp.log() - target_logit

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - one_hot(target); reuse the saved buffer
        one_hot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -one_hot)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The same loss from per-shard statistics (``ops``: the CUDA extension, or megalite.kernels.torch_ops)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_size: int, ops):
        tensor = parallel_state.get_tensor_model_parallel_group()
        per_rank = logits.shape[-1]
        start = tensor.rank * per_rank
        valid_cols = max(0, min(per_rank, vocab_size - start))   # the rest of this slice is padding
        local_target = (target - start).long()                    # outside [0, per_rank): another rank's token
        local_max, local_sum, target_logit = ops.cross_entropy_stats(logits, local_target, valid_cols)
        logits_max = tensor.max(local_max.clone())
        # exp(-inf) = 0 rescales the empty sum of an all-padding slice; the global max is finite (vocab_size >= 1).
        sums = tensor.sum(torch.stack([local_sum * torch.exp(local_max - logits_max), target_logit]))
        sum_exp, target_logit = sums[0], sums[1]
        ctx.save_for_backward(logits, local_target, logits_max, sum_exp)
        ctx.valid_cols, ctx.ops = valid_cols, ops
        return sum_exp.log() + logits_max - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, local_target, logits_max, sum_exp = ctx.saved_tensors
        grad = ctx.ops.cross_entropy_grad(logits, local_target, logits_max, sum_exp, grad_loss.float().contiguous(),
                                          ctx.valid_cols)
        return grad, None, None, None


def fused_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                                       ops) -> torch.Tensor:
    """The fused path with the given ``ops`` (the CUDA extension, or megalite.kernels.torch_ops): for checks."""
    return _FusedVocabParallelCrossEntropy.apply(logits, target, vocab_size, ops)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                                 kernels: KernelPolicy = DEFAULT_POLICY) -> torch.Tensor:
    """Per-token loss (fp32) from this rank's vocabulary slice of ``logits``; ``vocab_size`` is the unpadded size.
    ``kernels`` picks the fused path for CUDA logits (see the module docstring)."""
    ops = kernels.ops(CROSS_ENTROPY, logits)
    if ops is not None:
        return fused_vocab_parallel_cross_entropy(logits, target, vocab_size, ops)
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        # The whole vocabulary here: torch's cross entropy (one log-softmax pass, its backward one more) is the same
        # loss without the cross-rank bookkeeping; padding columns are sliced off, so they get no probability and a
        # zero gradient, as above.
        logits = logits.float()
        if logits.shape[-1] != vocab_size:
            logits = logits[..., :vocab_size]
        return F.cross_entropy(logits.reshape(-1, vocab_size), target.reshape(-1),
                               reduction="none").view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size)
