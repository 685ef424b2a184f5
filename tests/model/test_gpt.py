"""The GPT model in one process: loss at initialization, padding never learns, names are canonical."""

from __future__ import annotations

import math

import pytest
import torch

from megalite import parallel_state
from megalite.model import GPTModel
from megalite.tensor_parallel import TensorParallelRNG

from ..helpers import tiny_config


@pytest.fixture(autouse=True)
def single_process_layout():
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


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
