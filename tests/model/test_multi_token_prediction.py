"""Multi-token prediction in one process: the model's MTP losses equal a reference written out here (DeepSeek-V3's
modules step by step, with plain torch ops), the shifted targets respect sample ends, documents and the loss mask,
and a training step's ``loss`` stays the language-model loss of the same run without MTP (a mixture of experts whose
last layer, and so the MTP module's, is MoE: its statistics count the MTP layer too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.model import GPTModel
from megalite.model.context_parallel import shard_sequence
from megalite.model.multi_token_prediction import multi_token_targets
from megalite.tensor_parallel import TensorParallelRNG
from megalite.training.trainer import Trainer

from ..helpers import TINY_MOE, tiny_config

pytestmark = pytest.mark.usefixtures("single_process_layout")   # tests/conftest.py

MTP = dict(mtp_num_layers=2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True)


def test_mtp_losses_equal_a_reference_of_deepseek_v3_modules():
    cfg = tiny_config(model=MTP).model
    model = GPTModel(cfg, TensorParallelRNG(0, 0, 0, torch.device("cpu")))
    model.initialize(seed=3)
    for name, param in model.named_parameters():   # norm scales away from 1, so a swapped norm would show
        if name.endswith("norm.weight"):
            param.data.uniform_(0.5, 1.5)
    samples = torch.randint(cfg.vocab_size, (2, cfg.seq_length + 1))
    seq = cfg.seq_length
    shard = shard_sequence(seq, samples.device)
    targets = multi_token_targets(samples, cfg.mtp_num_layers, torch.ones(2, seq), None, shard)
    loss, mtp_losses = model(samples[:, :-1], samples[:, 1:], shard, mtp=targets)
    got = (mtp_losses * targets.loss_mask).sum(dim=(1, 2)) / targets.loss_mask.sum(dim=(1, 2))

    # The reference: h^0 the model's final normed hidden states; module k embeds the token k places ahead (the
    # last k positions have none: any token does, their loss is left out), h^k = norm_k(layer_k(W [enorm(e); hnorm(h)]))
    # predicts the token k + 1 places ahead with the shared (tied) output weight.
    with torch.no_grad():
        table = model.embedding.word.weight[:cfg.vocab_size]
        x = table[samples[:, :-1]]
        for layer in model.layers:
            x = layer(x)
        hidden = model.final_norm(x)
        assert torch.allclose(F.cross_entropy((hidden @ table.T).transpose(1, 2), samples[:, 1:], reduction="none"),
                              loss, atol=1e-5)
        expected = []
        for k, module in enumerate(model.mtp.layers, start=1):
            ahead = torch.cat([samples[:, k:], samples[:, :k - 1]], dim=1)   # positions past the end: anything
            joined = torch.cat([module.enorm(table[ahead]), module.hnorm(hidden)], dim=-1)
            hidden = module.final_norm(module.transformer_layer(joined @ module.eh_proj.weight.T))
            logits = hidden @ table.T
            expected.append(F.cross_entropy(logits[:, :seq - k].transpose(1, 2), samples[:, k + 1:]))
    torch.testing.assert_close(got.detach(), torch.stack(expected), rtol=1e-5, atol=1e-5)


def test_targets_stop_at_the_sample_end_and_at_documents():
    samples = torch.arange(100, 109).unsqueeze(0)    # 8 inputs, labels 101..108
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    loss_mask = torch.ones(1, 8)
    loss_mask[0, 5] = 0.0                            # --eod-mask-loss's zero at input 105
    shard = shard_sequence(8, samples.device)
    plain = multi_token_targets(samples, 2, loss_mask, None, shard)
    assert plain.tokens[1].tolist() == [[102, 103, 104, 105, 106, 107, 0, 0]]
    assert plain.labels[1].tolist() == [[103, 104, 105, 106, 107, 108, 0, 0]]
    assert plain.loss_mask[0].tolist() == [[1, 1, 1, 1, 0, 1, 1, 0]]   # depth 1 at i: the model's mask at i + 1
    packed = multi_token_targets(samples, 2, loss_mask, documents, shard)
    assert packed.loss_mask[0].tolist() == [[1, 1, 0, 1, 0, 1, 0, 0]]   # no token of the next document
    assert packed.loss_mask[1].tolist() == [[1, 0, 0, 0, 1, 0, 0, 0]]
    assert packed.tokens[1].tolist() == [[102, 0, 0, 105, 106, 0, 0, 0]]


def test_logged_loss_is_the_language_model_loss():
    records = {}
    for name, depth in (("plain", None), ("mtp", 2)):
        cfg = tiny_config(model={**MTP, **TINY_MOE, "moe_layer_freq": "[0,1]", "mtp_num_layers": depth},
                          training={"train_iters": 1, "global_batch_size": 2}, data={"eval_interval": 0})
        records[name] = Trainer.on_registered_layout(cfg, torch.device("cpu")).train_step()
    assert records["mtp"]["loss"] == records["plain"]["loss"]   # the same initial weights, the same samples
    assert records["plain"]["moe_layers"] == [1] and records["mtp"]["moe_layers"] == [1, 2, 3]
    assert "mtp_loss" not in records["plain"] and abs(records["mtp"]["mtp_loss"] - 5.7) < 0.3   # ~ ln 301
    assert len(records["mtp"]["mtp_losses"]) == 2
    assert records["mtp"]["grad_norm"] != records["plain"]["grad_norm"]
