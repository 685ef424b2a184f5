"""The GPT model in one process: loss at initialization, padding never learns, names are canonical; Llama-style
options give Hugging Face-shaped canonical tensors, grouped-query attention is attention with repeated key/value heads,
recompute changes nothing (dropout on), and the model configs have the sizes their names say."""

from __future__ import annotations

import math

import pytest
import torch

from megalite.model import GPTModel
from megalite.tensor_parallel import TensorParallelRNG

from ..helpers import tiny_config

pytestmark = pytest.mark.usefixtures("single_process_layout")   # tests/conftest.py


def _model(**model_overrides) -> GPTModel:
    cfg = tiny_config(model=model_overrides).model
    model = GPTModel(cfg, TensorParallelRNG(0, 0, 0, torch.device("cpu")))
    model.initialize(seed=3)
    return model


def test_initial_loss_is_near_uniform_and_padding_gets_no_gradient():
    model = _model()
    tokens = torch.randint(301, (2, 33))
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    assert abs(loss.detach().item() - math.log(301)) < 0.1
    loss.backward()
    weight = model.embedding.word.weight
    assert weight.shape[0] == 384
    assert torch.count_nonzero(weight[301:]) == 0 and torch.count_nonzero(weight.grad[301:]) == 0


def test_tied_and_untied_output():
    tied = _model()
    assert tied.output_weight() is tied.embedding.word.weight
    assert not any("output_layer" in name for name, _ in tied.named_parameters())
    untied = _model(untie_embeddings_and_output_weights=True)
    assert untied.output_weight() is untied.output_layer.weight
    assert not torch.equal(untied.output_layer.weight, untied.embedding.word.weight)


def test_full_logits_drop_padding():
    model = _model()
    assert model.full_logits(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 301)


def test_canonical_names_number_layers_globally():
    cfg = tiny_config().model
    stage = GPTModel(cfg, None, pre_process=False, post_process=False, layer_offset=6, num_layers=2)
    names = [name for name, _ in stage.canonical_named_parameters()]
    assert names[0].startswith("layers.6.") and names[-1].startswith("layers.7.")


def test_dropout_needs_no_rng_when_off_and_changes_outputs_when_on():
    model = _model(hidden_dropout=0.5, attention_dropout=0.5)
    tokens = torch.randint(301, (2, 32))
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


LLAMA_LIKE = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
              "group_query_attention": True, "num_query_groups": 2, "disable_bias_linear": True,
              "untie_embeddings_and_output_weights": True}


def test_llama_like_model_has_the_canonical_hugging_face_shaped_tensors():
    model = _model(**LLAMA_LIKE, ffn_hidden_size=176)
    params = dict(model.named_parameters())
    assert not any(name.endswith(".bias") for name in params)
    assert "embedding.position.weight" not in params
    qkv = params["layers.0.self_attention.linear_qkv.weight"]
    # [q_proj; k_proj; v_proj]: 4 query heads and 2 key/value heads of dimension 16.
    assert qkv.full_shape == (64 + 2 * 32, 64) and qkv.partition.fused == (64, 32, 32)
    fc1 = params["layers.0.mlp.linear_fc1.weight"]
    assert fc1.full_shape == (2 * 176, 64) and fc1.partition.fused == 2      # [gate_proj; up_proj]
    assert params["layers.0.input_norm.weight"].shape == (64,)
    tokens = torch.randint(301, (2, 33))
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    assert abs(loss.item() - math.log(301)) < 0.1


def test_grouped_query_attention_equals_repeated_key_value_heads():
    """GQA with G key/value heads is multi-head attention whose k and v heads are each repeated heads/G times."""
    gqa = _model(group_query_attention=True, num_query_groups=2)
    mha = _model()
    with torch.no_grad():
        for (name, p_gqa), (_, p_mha) in zip(gqa.named_parameters(), mha.named_parameters()):
            if "linear_qkv.weight" in name or "linear_qkv.bias" in name:
                q, k, v = p_gqa.split([64, 32, 32])
                repeat = [t.unflatten(0, (2, 16)).repeat_interleave(2, dim=0).flatten(0, 1) for t in (k, v)]
                p_mha.copy_(torch.cat([q, *repeat]))
            else:
                p_mha.copy_(p_gqa)
    tokens = torch.randint(301, (2, 32))
    torch.testing.assert_close(gqa(tokens), mha(tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("recompute", [
    {"recompute_granularity": "selective"},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
])
def test_recompute_with_dropout_gives_identical_losses_and_gradients(recompute):
    def run(options):
        cfg = tiny_config(model={"num_layers": 3, "hidden_dropout": 0.2, "attention_dropout": 0.2, **options}).model
        model = GPTModel(cfg, TensorParallelRNG(0, 0, 0, torch.device("cpu")))
        model.initialize(seed=3)
        tokens = torch.randint(301, (2, 33), generator=torch.Generator().manual_seed(0))
        losses = [model(tokens[:, :-1], tokens[:, 1:]).mean() for _ in range(2)]   # two micro-batches
        sum(losses).backward()
        return [loss.item() for loss in losses], {n: p.grad for n, p in model.named_parameters()}

    (plain_losses, plain_grads), (losses, grads) = run({}), run(recompute)
    assert losses == plain_losses and plain_losses[0] != plain_losses[1]   # dropout on: the masks differ per pass
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("config, billions", [
    ("gpt2_small", 0.124), ("gpt2_medium", 0.355), ("gpt2_large", 0.774), ("gpt2_xl", 1.56), ("gpt_1_3b", 1.32),
    ("llama3_1b", 1.24), ("llama3_8b", 8.03), ("llama2_7b", 6.74), ("llama2_13b", 13.0),
])
def test_model_configs_have_their_sizes(config, billions):
    from megalite.config.cli import parse_args
    cfg = parse_args([f"model={config}", "data=mock"]).model
    with torch.device("meta"):   # shapes only: no memory, no initialization
        model = GPTModel(cfg)
    count = sum(p.numel() for p in model.parameters())
    padding = (cfg.padded_vocab_size(1) - cfg.vocab_size) * cfg.hidden_size
    assert abs((count - padding) / 1e9 - billions) / billions < 0.01, count


def test_scaled_embeddings_multiply_by_sqrt_hidden_rounded_to_the_dtype():
    """--scale-embeddings: the word embeddings times sqrt(hidden size), that factor first rounded to the weights'
    dtype (transformers' Gemma: sqrt(64) is exact, sqrt(96) is not in bf16); the tied output layer's weight unscaled."""
    cfg = tiny_config(model={"hidden_size": 96, "scale_embeddings": True, "position_embedding_type": "rope"}).model
    model = GPTModel(cfg)
    model.initialize(1)
    model = model.to(torch.bfloat16)
    tokens = torch.tensor([[1, 7, 300]])
    factor = torch.tensor(96 ** 0.5).to(torch.bfloat16)
    assert float(factor) != 96 ** 0.5
    assert torch.equal(model.embedding(tokens), model.embedding.word(tokens) * factor)
    assert model.output_weight() is model.embedding.word.weight
