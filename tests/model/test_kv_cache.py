"""The KV cache: logits of a sequence fed in pieces (a prompt, single tokens, then several at once) through a cache
equal the logits of one pass over the whole sequence, for learned and rotary positions (Llama 3 scaling, grouped
queries, q/k/v biases; a sliding window in one layer; attention sinks, with and without a window). fp32, within 1e-5 of the largest logit (measured: below 1e-6)."""

from __future__ import annotations

import pytest
import torch

from megalite.model import GPTModel, KVCache
from megalite.tensor_parallel import TensorParallelRNG

from ..helpers import assert_close_to_scale, tiny_config

pytestmark = pytest.mark.usefixtures("single_process_layout")   # tests/conftest.py

QWEN2_LIKE = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                  add_qkv_bias=True, group_query_attention=True, num_query_groups=2, use_rope_scaling=True,
                  rope_scaling_factor=4.0, rope_scaling_original_max_position_embeddings=16)


# Layer 0 windowed (itself and the 5 tokens before), layer 1 global: the cache's window slides past the prompt.
WINDOWED = {**QWEN2_LIKE, "window_size": "5,0", "window_attn_skip_freq": "2"}


# gpt-oss' attention: learnable sinks in every layer, windowed in one; off-by-one without a window.
SINKS = {**WINDOWED, "softmax_type": "learnable"}


@pytest.mark.parametrize("options", [{}, QWEN2_LIKE, WINDOWED, SINKS, {**QWEN2_LIKE, "softmax_type": "off-by-one"}],
                         ids=["gpt2", "qwen2_like", "window", "learnable-sinks-window", "off-by-one"])
def test_cached_pieces_give_the_logits_of_one_pass(options):
    model = GPTModel(tiny_config(model=options).model, TensorParallelRNG(0, 0, 0, torch.device("cpu"))).eval()
    model.initialize(seed=3)
    tokens = torch.randint(301, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model.full_logits(tokens)
        cache = KVCache(32)
        pieces = [model.full_logits(tokens[:, :7], cache)]
        pieces += [model.full_logits(tokens[:, i:i + 1], cache) for i in range(7, 12)]
        pieces.append(model.full_logits(tokens[:, 12:], cache))   # several new tokens at once: a causal block
    assert cache.length == 30
    assert_close_to_scale(torch.cat(pieces, dim=1), whole)


def test_the_cache_refuses_more_positions_than_it_holds():
    model = GPTModel(tiny_config().model, TensorParallelRNG(0, 0, 0, torch.device("cpu"))).eval()
    cache = KVCache(8)
    with torch.no_grad(), pytest.raises(ValueError, match="holds 8 positions, 9 asked for"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache)
