"""Context parallelism trains exactly like the single process, for each comm type and with the other parallelisms.

Same seed and global batch, dropout off, fp32, sequence 64: 10 iterations, per-iteration loss and gradient norm within
1e-5 relative, final weights within 1e-5 (tests/multiprocess/equivalence.py). Layouts of one model share one reference
run. The attention cores are also compared directly with SDPA over the whole sequence (outputs and the gradients of
q, k and v), with grouped-query attention and packed documents, in fp64 where the ring's blockwise softmax must agree
to rounding. Multi-token prediction rides along in three layouts (TP x CP with sequence parallelism, ZeRO-3 with full
recompute, packed documents under PP): its tokens k places ahead are cut from the whole sample before CP takes its
load-balanced chunks, and its loss is compared too. Fine-tuning on conversations (--sft: the loss on the assistant's
tokens only) rides along twice, padded at TP x CP and packed at TP x CP x PP (3 iterations each).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

from megalite import parallel_state
from megalite.model.context_parallel import context_parallel_attention, shard_sequence
from megalite.model.transformer import TransformerLayer, run_layers
from megalite.tensor_parallel import TensorParallelRNG
from megalite.training import Trainer

from ..activation_memory import saved_bytes
from ..data.helpers import build_chat_tokenizer, chat_records, write_progressions
from ..helpers import losses, max_relative_difference, tiny_config, with_checkpoint
from .equivalence import CPU, check_against_reference, reference
from .groups import layout, requires_world
from .test_model_options import MLA

# Every second layer global (Megatron's skip frequency); at CP=4 a chunk holds 8 of the 64 tokens, so the ring skips
# the blocks the window leaves out.
WINDOW = {"window_size": "7,0", "window_attn_skip_freq": "2"}
LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True,
         "group_query_attention": True, "num_query_groups": 2}
# Gemma 3's options but its windows (which context parallelism refuses): the ring scales the scores by 0.3
GEMMA = {"swiglu": False, "gated_linear_unit": True, "openai_gelu": True, "sandwich_norm": True, "qk_layernorm": True,
         "apply_layernorm_1p": True, "scale_embeddings": True, "softmax_scale": 0.3}


def slug(value) -> str | None:
    """The label of a case as a test id ``-k`` can select ('p2p CP=2 x DP=2' -> 'p2p_CP2_x_DP2'); pytest's own
    ids for the other parameters."""
    if not isinstance(value, str) or " " not in value:
        return None
    return "".join(c if c.isalnum() else "_" for c in value.replace("=", "")).strip("_")


def cp_config(cp: int, comm_type: str = "p2p", tp: int = 1, pp: int = 1, model=None, parallel=None, **sections):
    return tiny_config(tp=tp, pp=pp, model={"seq_length": 64, **(model or {})},
                       parallel={"context_parallel_size": cp, "cp_comm_type": comm_type, **(parallel or {})},
                       **sections)


def _sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


@requires_world(4)
@pytest.mark.parametrize("cp, comm_type", [(cp, kind) for kind in ("p2p", "a2a", "allgather") for cp in (2, 4)] +
                         [(4, "a2a+p2p")])   # hierarchical: a2a inside pairs of CP ranks, the ring across them
def test_attention_over_the_whole_sequence(cp, comm_type):
    torch.manual_seed(0)
    batch, heads, groups, length, dim = 2, 4, 2, 32, 8
    q = torch.randn(batch, heads, length, dim, dtype=torch.float64)
    k, v = (torch.randn(batch, groups, length, dim, dtype=torch.float64) for _ in range(2))
    documents = torch.cumsum((torch.rand(batch, length) < 0.15).long(), dim=1)
    with layout(ranks=list(range(cp)), cp=cp) as member:
        if not member:
            return
        # A window of 5 (each query and the 5 tokens before it): at CP=4 a chunk is 4 tokens, so the ring skips
        # the blocks beyond it.
        for docs, window in ((None, None), (documents, None), (None, 5), (documents, 5)):
            shard = shard_sequence(length, q.device, documents=docs, comm_type=comm_type,
                                   a2a_size=2 if comm_type == "a2a+p2p" else 1)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            expected = _sdpa(*full, shard.whole_sequence_mask(window))
            grad = torch.randn_like(expected)
            expected.backward(grad)

            def local(t):   # this rank's tokens of a [batch, heads, length, d] tensor
                return shard.take(t.transpose(1, 2)).transpose(1, 2)

            masks = []

            def core(q, k, v, mask=None):
                masks.append(mask)
                return _sdpa(q, k, v, mask)

            mine = [local(t).detach().clone().requires_grad_() for t in (q, k, v)]
            actual = context_parallel_attention(*mine, shard, core, window=window)
            if docs is None and window is None:   # plain causal attention needs no mask tensor (flash attention)
                assert all(m is None or isinstance(m, CausalBias) for m in masks), comm_type
            actual.backward(local(grad))
            torch.testing.assert_close(actual, local(expected), rtol=0, atol=1e-12)
            for name, got, want in zip("qkv", mine, full):
                torch.testing.assert_close(got.grad, local(want.grad), rtol=0, atol=1e-12, msg=name)


@requires_world(4)
@pytest.mark.parametrize("label, cp, comm_type, tp, model, parallel, optimizer", [
    ("p2p CP=2 x DP=2", 2, "p2p", 1, {}, {}, {}),
    ("p2p CP=4, sliding window (rotary)", 4, "p2p", 1, {**WINDOW, "position_embedding_type": "rope"}, {}, {}),
    ("a2a CP=2 x DP=2, multi-latent attention", 2, "a2a", 1, MLA, {}, {}),
    ("a2a CP=4, sliding window", 4, "a2a", 1, WINDOW, {}, {}),
    ("allgather CP=2 x DP=2, multi-latent attention", 2, "allgather", 1, MLA, {}, {}),
    ("allgather CP=4", 4, "allgather", 1, {}, {}, {}),
    ("a2a+p2p CP=4 (2 x 2), Llama-style (rotary, GQA)", 4, "a2a+p2p", 1, LLAMA,
     {"hierarchical_context_parallel_sizes": "2 2"}, {}),
    ("p2p CP=2 x TP=2, sequence parallel, Gemma-style (rotary, GQA, GeGLU, sandwich and q/k norms, scaled "
     "embeddings, softmax scale), MTP", 2, "p2p", 2, {**LLAMA, **GEMMA, "mtp_num_layers": 1},
     {"sequence_parallel": True}, {}),
    ("p2p CP=2 x DP=2, distributed optimizer over DP x CP, selective recompute, multi-latent attention", 2, "p2p",
     1, {"recompute_granularity": "selective", **MLA}, {}, {"use_distributed_optimizer": True, "overlap_grad_reduce": True}),
    ("p2p CP=2 x DP=2, ZeRO-3 over DP x CP, full recompute, rotary, MTP", 2, "p2p", 1,
     {"recompute_granularity": "full", "recompute_method": "uniform", "position_embedding_type": "rope",
      "mtp_num_layers": 1}, {}, {"zero_stage": 3}),
], ids=slug)
def test_losses_and_weights_match_single_process(label, cp, comm_type, tp, model, parallel, optimizer):
    cfg = cp_config(cp, comm_type, tp, model=model, parallel=parallel, optimizer=optimizer)
    check_against_reference(cfg, label=label)


@requires_world(8)
def test_context_pipeline_and_data_parallel_match_single_process(chat_data):
    cfg = cp_config(2, pp=2, model={"num_layers": 4})
    check_against_reference(cfg, label="p2p CP=2 x PP=2 x DP=2")
    # Fine-tuning on conversations, packed: the assistant-only loss mask through CP's split, TP and the last stage.
    packed = {**chat_data, "reset_position_ids": True, "reset_attention_mask": True}
    cfg = cp_config(2, tp=2, pp=2, data=packed, training=SHORT)
    check_against_reference(cfg, label="chat conversations (--sft), packed, p2p CP=2 x TP=2 x PP=2")


@requires_world(4)
def test_bf16_ring_attention_stays_close_to_fp32():
    fp32 = losses(reference(cp_config(2, optimizer={"adam_eps": 1e-5}))[0])   # the first test's reference run
    with layout(ranks=[0, 1], cp=2) as member:
        if not member:
            return
        trainer = Trainer.on_registered_layout(cp_config(2, training={"bf16": True}, optimizer={"adam_eps": 1e-5}), CPU)
        assert "TP=1 x CP=2 (p2p) x PP=1 x DP=1" in trainer.describe()   # the start-up line
        bf16 = losses(trainer.train())
    print(f"bf16 CP=2 vs fp32 single process after 10 iterations: {bf16[-1]:.5f} vs {fp32[-1]:.5f}")
    assert abs(bf16[-1] - fp32[-1]) / fp32[-1] < 0.02


@pytest.fixture
def packed_data(directory):
    """A dataset of short documents ended by EOD (NullTokenizer, vocabulary 301): every sample packs several."""
    prefix = Path(directory) / "progressions"
    if dist.get_rank() == 0:
        write_progressions(prefix, 600, 301)
    dist.barrier()
    return {"mock_data": False, "data_path": str(prefix), "tokenizer_type": "NullTokenizer",
            "reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}


@pytest.fixture
def chat_data(directory):
    """Short conversations (--sft) and a byte-level BPE with ChatML's template (tests/data/helpers.py): one per
    sample, padded (add --reset-attention-mask to pack them)."""
    tokenizer, path = Path(directory) / "chat_tokenizer", Path(directory) / "chat.jsonl"
    if dist.get_rank() == 0:
        build_chat_tokenizer(tokenizer)
        path.write_text("".join(json.dumps(record) + "\n" for record in chat_records(300)))
    dist.barrier()
    return {"mock_data": False, "sft": True, "data_path": str(path), "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": str(tokenizer), "eval_interval": 2}


# Chat runs are shorter (3 iterations, evaluated after 2 and 3): the test-time budget.
SHORT = {"train_iters": 3}


@requires_world(4)
@pytest.mark.parametrize("label, cp, comm_type, pp, model, tp, data", [
    ("packed documents, p2p CP=2 x DP=2", 2, "p2p", 1, {}, 1, "packed_data"),
    ("packed documents, a2a CP=4", 4, "a2a", 1, {}, 1, "packed_data"),
    ("packed documents, allgather CP=2 x PP=2 (V=2, interleaved), rotary, MTP", 2, "allgather", 2,
     {"num_layers": 4, "position_embedding_type": "rope", "mtp_num_layers": 1}, 1, "packed_data"),
    ("chat conversations (--sft), padded, p2p CP=2 x TP=2", 2, "p2p", 1, {}, 2, "chat_data"),
], ids=slug)
def test_packed_documents_match_single_process(request, label, cp, comm_type, pp, model, tp, data):
    cfg = cp_config(cp, comm_type, tp=tp, pp=pp, model=model, data=request.getfixturevalue(data),
                    parallel={"num_virtual_stages_per_pipeline_rank": 2 if pp > 1 else None},
                    training=SHORT if data == "chat_data" else {})
    check_against_reference(cfg, label=label)


@requires_world(4)
def test_checkpoints_move_between_context_parallel_sizes(directory):
    """Saved at CP=2 x DP=2 (distributed optimizer: Adam states sharded over DP x CP) after 4 of 6 iterations,
    resumed at CP=1 x DP=4 with the plain optimizer, which saves after iteration 5, resumed in turn at CP=4 with the
    distributed optimizer: every resumed iteration equals the uninterrupted run's (dropout off: RNG states come back
    at the identical layout only)."""
    cfg = cp_config(2, optimizer={"use_distributed_optimizer": True, "adam_eps": 1e-5},
                    training={"train_iters": 6}, data={"eval_interval": 0})

    def run(cp, distributed, load=None, save_after=None, save=None):
        """The losses of the iterations left, saving to ``save`` after iteration ``save_after``."""
        run_cfg = dataclasses.replace(with_checkpoint(cfg, load=load),
                                      parallel=dataclasses.replace(cfg.parallel, context_parallel_size=cp),
                                      optimizer=dataclasses.replace(cfg.optimizer,
                                                                    use_distributed_optimizer=distributed))
        with layout(cp=cp):
            trainer, result = Trainer.on_registered_layout(run_cfg, CPU), []
            while trainer.state.iteration < 6:
                result.append(trainer.train_step()["loss"])
                if trainer.state.iteration == save_after:
                    trainer.save_checkpoint(save)
            return result

    uninterrupted = run(2, True, save_after=4, save=f"{directory}/a")
    for label, resumed, expected in [
        ("saved at CP=2 x DP=2 after 4 iterations, resumed at CP=1 x DP=4",
         run(1, False, f"{directory}/a", save_after=5, save=f"{directory}/b"), uninterrupted[4:]),
        ("saved at CP=1 x DP=4 after 5 iterations, resumed at CP=4", run(4, True, f"{directory}/b"),
         uninterrupted[5:])]:
        difference = max_relative_difference(resumed, expected)
        print(f"{label}: max rel loss diff {difference:.1e}")
        assert difference < 1e-5


@requires_world(4)
def test_exact_resume_at_the_same_context_parallel_layout(directory):
    """With dropout on, CP=2 x DP=2 (ZeRO-1): 6 iterations straight and 3 + save + resume for 3 give the same losses
    bit for bit: every rank's RNG states (each CP rank draws its own masks) come back."""
    cfg = cp_config(2, model={"hidden_dropout": 0.1}, optimizer={"use_distributed_optimizer": True},
                    training={"train_iters": 6}, data={"eval_interval": 0})
    with layout(cp=2):
        straight = losses(Trainer.on_registered_layout(cfg, CPU).train())
    with layout(cp=2):
        trainer = Trainer.on_registered_layout(cfg, CPU)
        first = [trainer.train_step()["loss"] for _ in range(3)]
        trainer.save_checkpoint(directory)
    with layout(cp=2):
        second = losses(Trainer.on_registered_layout(with_checkpoint(cfg, load=directory), CPU).train())
    difference = max_relative_difference(first + second, straight)
    print(f"exact resume at CP=2 x DP=2, with dropout: max rel loss diff {difference:.1e}")
    assert len(second) == 3 and difference <= 1e-7


@requires_world(4)
@pytest.mark.parametrize("comm_type, op", [("p2p", "send"), ("a2a", "all_to_all_single"),
                                           ("allgather", "all_gather")])
def test_communication_per_step_is_the_planner_s(comm_type, op):
    """One training step at CP=2 x DP=2, counted at the torch.distributed calls on the context-parallel group: what
    the planner's model says each layer and micro-batch sends (megalite.planner.performance), and for the ring the
    analytic minimum of each pass (every rank's K/V block reaches the CP-1 others; its gradient's CP-1 other
    contributions come back): forward at it, backward CP / (CP-1) times it on the dK/dV part, the accumulator also
    travelling through its owner's neighbour back home."""
    from bench.comm_counter import count_communication   # noqa: PLC0415 - the benchmarks' counter, run as a test

    from megalite.planner import Layout   # noqa: PLC0415
    from megalite.planner.performance import context_parallel_bytes   # noqa: PLC0415

    cfg = cp_config(2, comm_type, training={"train_iters": 1}, data={"eval_interval": 0})
    with layout(cp=2):
        trainer = Trainer.on_registered_layout(cfg, CPU)
        with count_communication() as counter:
            trainer.train_step()
    m, layers = trainer.num_micro_batches, cfg.model.num_layers
    sent = context_parallel_bytes(cfg.model, Layout(cp=2, dp=2, cp_comm_type=comm_type,
                                                    micro_batch_size=cfg.training.micro_batch_size), 4)
    expected = (sent["forward"] + sent["backward"]) / 4 * layers * m   # fp32: 4 bytes an element
    counted = counter.elements(op, "context")
    if op == "all_to_all_single":   # counted: whole inputs; the model: the (CP-1)/CP that leaves the rank
        counted /= 2
    if op == "all_gather":   # counted: the gathered tensor (CP blocks) forward, reduce-scatter's input backward
        counted = (counter.elements("all_gather", "context") + counter.elements("reduce_scatter", "context")) / 2
    print(f"{comm_type} CP=2: {counted:,.0f} elements per step and rank on the CP group, the planner's "
          f"{expected:,.0f}")
    assert counted == expected
    if comm_type == "p2p":   # per layer and micro-batch, in K/V blocks of this rank's tokens
        block = 2 * cfg.training.micro_batch_size * cfg.model.seq_length // 2 * cfg.model.hidden_size * 4
        forward, backward = sent["forward"] / block, sent["backward"] / block
        print(f"ring vs analytic minimum: forward {forward:.0f} block(s) / 1, backward {backward:.0f} / 2 "
              f"(K/V again and the dK/dV accumulator, which also makes the trip home)")
        assert (forward, backward) == (1, 3)


@requires_world(4)
def test_hierarchical_communication_is_the_planner_s():
    """a2a+p2p at CP=4 (2 x 2), one step: the all-to-alls stay inside the pairs of adjacent CP ranks and the ring's
    sends run between the pairs, each as many elements as the planner's levels (megalite.planner.performance)."""
    from bench.comm_counter import count_communication   # noqa: PLC0415 - the benchmarks' counter, run as a test

    from megalite.planner import Layout   # noqa: PLC0415
    from megalite.planner.performance import _hierarchical_bytes   # noqa: PLC0415

    cfg = cp_config(4, "a2a+p2p", model=LLAMA, parallel={"hierarchical_context_parallel_sizes": "2 2"},
                    training={"train_iters": 1}, data={"eval_interval": 0})
    with layout(cp=4):
        trainer = Trainer.on_registered_layout(cfg, CPU)
        with count_communication() as counter:
            trainer.train_step()
    per_step = cfg.model.num_layers * trainer.num_micro_batches / 4   # fp32: 4 bytes an element
    a2a, ring = (sum(level) * per_step for level in _hierarchical_bytes(
        cfg.model, Layout(cp=4, cp_comm_type="a2a+p2p", cp_a2a=2, micro_batch_size=cfg.training.micro_batch_size), 4))
    counted_a2a = counter.elements("all_to_all_single", "context_a2a") / 2   # whole inputs; half leaves the rank
    counted_ring = counter.elements("send", "context_ring")
    print(f"a2a+p2p CP=4 (2 x 2): {counted_a2a:,.0f} elements all-to-all inside the pairs, {counted_ring:,.0f} sent "
          f"around the ring per step and rank; the planner's {a2a:,.0f} and {ring:,.0f}")
    assert (counted_a2a, counted_ring) == (a2a, ring)
    assert counter.elements("all_to_all_single", "context") == counter.elements("send", "context") == 0


@requires_world(4)
@pytest.mark.parametrize("comm_type", ["p2p", "a2a", "allgather", "a2a+p2p"])
def test_activation_bytes_per_rank_shrink_with_context_parallelism(comm_type):
    """What autograd keeps for one layer (saved-tensor hooks, tests/activation_memory.py), s = 128, b = 2, hidden
    dropout on: at CP=2 and 4 (a2a+p2p: 4 as 2 x 2) against CP=1 and against the planner's estimate
    (megalite.planner.memory)."""
    from megalite.planner.memory import Numerics, layer_activation_bytes   # noqa: PLC0415

    hierarchical = comm_type == "a2a+p2p"
    cfg = cp_config(1, comm_type, model={"num_layers": 1, "seq_length": 128, "hidden_dropout": 0.1},
                    parallel={"hierarchical_context_parallel_sizes": "2 2"} if hierarchical else None).model
    batch, measured = 2, {}
    for cp in ((1, 4) if hierarchical else (1, 2, 4)):
        with layout(ranks=list(range(cp)) if cp > 1 else [dist.get_rank()], cp=cp) as member:
            if member:
                rng = TensorParallelRNG(0, 0, 0, CPU, parallel_state.get_context_parallel_rank())
                layers = torch.nn.ModuleList([TransformerLayer(cfg, rng)])
                shard = shard_sequence(cfg.seq_length, CPU, comm_type=comm_type if cp > 1 else "p2p",
                                       a2a_size=2 if hierarchical and cp > 1 else 1)
                x = torch.randn(batch, cfg.seq_length // cp, cfg.hidden_size, requires_grad=True)
                measured[cp], output = saved_bytes(lambda h: run_layers(layers, h, cfg, rng, shard), x,
                                                   exclude=list(layers.parameters()))
                output.sum().backward()
    if dist.get_rank() != 0:
        return
    for cp, held in measured.items():
        planned = layer_activation_bytes(cfg, 1, False, batch, Numerics.cpu(4), cp=cp, cp_comm_type=comm_type)
        print(f"{comm_type} CP={cp}: {held:,} bytes per layer and rank, {held / measured[1]:.3f} of CP=1; the "
              f"planner's estimate {planned:,.0f} ({held / planned:.3f})")
        assert abs(held / planned - 1) < 0.05
    # allgather's two chunk cores keep one output-sized tensor (b s h) more than a single core and a quarter of its
    # s x L mask (on the CPU only; none on a GPU), which at s = 128 is a little more, at long sequences far less.
    if not hierarchical:
        assert measured[2] / measured[1] < {"p2p": 0.51, "a2a": 0.65, "allgather": 0.66}[comm_type]
