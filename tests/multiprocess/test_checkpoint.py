"""Checkpoints across ranks: exact resume at the same layout, and resharding to other layouts.

- Exact resume (4 ranks, dropout on; TP=2 x DP=2 with the distributed optimizer and overlapped parameter gather, and
  interleaved PP=2 x DP=2 with ZeRO-2): 10 iterations straight and 5 + save + resume for 5 give the same losses, bit
  for bit on CPU fp32 (asserted <= 1e-7 relative): weights, Adam states, data position and RNG states all come back.
- Import (4 ranks): a Hugging Face GPT-2 imported in one process fine-tunes at TP=2 x PP=2 like in one process.
- Async save (4 ranks, TP=2 x DP=2 ZeRO-1): held on one rank, it is not put in place while that rank writes, though
  the others have finished and training went on; then it equals a synchronous save bit for bit. A byte flipped in
  one item is found by the one rank whose share of the verification holds it, and every rank stops with its line.
- Reshard (8 ranks): a TP=2 x PP=2 x DP=2 run with the distributed optimizer saves after 4 of 6 iterations; resuming
  that checkpoint at TP=1 x PP=1 x DP=1 (rank 0 alone), TP=4 x DP=2 and PP=4 x DP=2 (plain optimizer) gives
  iterations 5 and 6 equal to the uninterrupted run's within 1e-5 relative (dropout off: RNG states only come back at
  the identical layout). A Llama-style model (grouped-query QKV: fused blocks of unequal sizes; gpt-oss' learnable
  attention sinks, saved whole: [heads]) reshards TP=2 x PP=2 -> PP=4 in the 4-rank launch.
- Megatron-LM (4 ranks, with megatron-core installed; tests/checkpoint/megatron_reference.py): Megatron's own models
  at TP=2 x PP=2 (EP=2 x PP=2 for the MoE styles; Llama also at PP=2 with 2 virtual stages) save in both of
  Megatron's formats; loading them back at that layout gives the saving models' logits bit for bit, and loading the
  torch_dist checkpoint at TP=1 x PP=1 (Megatron reshards) gives them within fp32 reordering. megalite imports each
  (one process) to Megatron's logits within 1e-5 of their scale (seen: 3.2e-7 at most), and its exports at the same
  layout, in both formats, load in Megatron (with the flags the export names) to the original's logits (seen: bit
  for bit). A megalite run resumed from the import of Megatron's GPT-3 and Llama saves trains at TP=2 x PP=2 with
  the single-process run's losses within 1e-5 relative.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megalite.checkpoint import CheckpointError, open_checkpoint
from megalite.checkpoint.convert import full_tensors
from megalite.checkpoint.directory import POINTER_NAME
from megalite.config import ModelConfig, ParallelConfig
from megalite.training import Trainer

from ..helpers import assert_close_to_scale, losses, max_relative_difference, tiny_config, with_checkpoint
from .groups import layout, requires_world
from .equivalence import CPU, full_parameters

EXACT = 1e-7
RESHARD = 1e-5


@pytest.mark.parametrize("label, tp, pp, model, optimizer", [
    ("TP=2 x DP=2 ZeRO-1, overlapped gather, Muon for the matrices", 2, 1, {},
     {"overlap_param_gather": True, "optimizer": "muon", "muon_tp_mode": "distributed"}),
    ("PP=2 (V=2) x DP=2 ZeRO-2, tied embedding across stages", 1, 2, {"num_layers": 4},
     {"zero_stage": 2, "overlap_grad_reduce": True}),
])
def test_exact_resume_same_layout(directory, label, tp, pp, model, optimizer):
    cfg = tiny_config(tp=tp, pp=pp, model={"hidden_dropout": 0.1, "attention_dropout": 0.1, **model},
                      optimizer={"use_distributed_optimizer": True, "ddp_bucket_size": 4000, **optimizer},
                      data={"eval_interval": 0})
    if pp > 1:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                    num_virtual_stages_per_pipeline_rank=2))
    with layout(tp, pp):
        straight = losses(Trainer.on_registered_layout(cfg, CPU).train())
    with layout(tp, pp):
        trainer = Trainer.on_registered_layout(cfg, CPU)
        first = [trainer.train_step()["loss"] for _ in range(5)]   # train_iters stays 10: the same LR schedule
        trainer.save_checkpoint(directory)
    with layout(tp, pp):
        resumed = Trainer.on_registered_layout(with_checkpoint(cfg, load=directory), CPU)
        assert resumed.state.iteration == 5 and resumed.state.consumed_samples == 40
        second = losses(resumed.train())
    difference = max_relative_difference(first + second, straight)
    print(f"exact resume {label}, with dropout: max rel loss diff {difference:.1e}")
    assert len(second) == 5 and difference <= EXACT


@requires_world(8)
def test_reshard_to_other_layouts(directory):
    cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4}, optimizer={"use_distributed_optimizer": True,
                                                                       "ddp_bucket_size": 4000},
                      training={"train_iters": 6}, data={"eval_interval": 0})
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, adam_eps=1e-5))   # see equivalence
    with layout(2, 2):
        uninterrupted = losses(Trainer.on_registered_layout(with_checkpoint(cfg, save=directory, save_interval=4), CPU).train())
    resumed_cfg = with_checkpoint(cfg, load=f"{directory}/iter_0000004")   # the end of training saved 6 too
    for label, tp, pp, ranks, optimizer, split in [
        ("TP=1 x PP=1 x DP=1", 1, 1, [0], {"use_distributed_optimizer": False}, None),
        ("TP=4 x PP=1 x DP=2", 4, 1, None, {}, None),
        ("TP=1 x PP=4 x DP=2", 1, 4, None, {"use_distributed_optimizer": False}, None),
        ("TP=2 x PP=4 split E|t|tt|tL", 2, 4, None, {}, "E|t|tt|tL"),   # an uneven pipeline
    ]:
        run_cfg = dataclasses.replace(
            resumed_cfg, parallel=dataclasses.replace(cfg.parallel, tensor_model_parallel_size=tp,
                                                      pipeline_model_parallel_size=pp,
                                                      pipeline_model_parallel_layout=split),
            optimizer=dataclasses.replace(cfg.optimizer, **optimizer))
        with layout(tp, pp, ranks=ranks) as member:
            if not member:
                continue
            trainer = Trainer.on_registered_layout(run_cfg, CPU)
            assert trainer.state.iteration == 4
            resumed = losses(trainer.train())
        difference = max_relative_difference(resumed, uninterrupted[4:])
        print(f"saved at TP=2 x PP=2 x DP=2 ZeRO-1 after 4 iterations, resumed at {label}: iterations 5-6 max rel "
              f"loss diff {difference:.1e}")
        assert difference < RESHARD


def test_imported_hugging_face_model_loads_at_a_parallel_layout(directory):
    """An import-hf checkpoint (one process, iteration 0, weights only; GPT-2 as published, with the tanh GeLU)
    fine-tuned at TP=2 x PP=2 with --finetune matches the same fine-tuning in one process."""
    transformers = pytest.importorskip("transformers")
    from megalite.checkpoint.convert import import_hf

    if dist.get_rank() == 0:
        config = transformers.GPT2Config(vocab_size=301, n_positions=32, n_embd=64, n_layer=4, n_head=4,
                                         activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        torch_model = transformers.GPT2LMHeadModel(config)
        torch_model.save_pretrained(f"{directory}/hf")
        import_hf(f"{directory}/hf", f"{directory}/ckpt")
    dist.barrier()
    cfg = with_checkpoint(tiny_config(model={"num_layers": 4, "openai_gelu": True}, training={"train_iters": 2},
                                       data={"eval_interval": 0}), load=f"{directory}/ckpt", finetune=True)
    with layout(1, 1, ranks=[dist.get_rank()]):
        expected = losses(Trainer.on_registered_layout(cfg, CPU).train())
    parallel = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tensor_model_parallel_size=2,
                                                                     pipeline_model_parallel_size=2))
    with layout(2, 2):
        actual = losses(Trainer.on_registered_layout(parallel, CPU).train())
    difference = max_relative_difference(actual, expected)
    print(f"imported GPT-2 fine-tuned at TP=2 x PP=2 vs one process: max rel loss diff {difference:.1e}")
    assert difference < RESHARD


LLAMA_STYLE = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
               "group_query_attention": True, "num_query_groups": 2, "disable_bias_linear": True}


def test_muon_momentum_reshards(directory):
    """Muon's momentum (sharded over DP like Adam's moments) saved at TP=2 x DP=2 ZeRO-1 after 5 of 10 iterations and
    resumed at TP=1 x DP=4 ZeRO-3 (row shards of FSDP2): iterations 6-10 equal the uninterrupted run's."""
    cfg = tiny_config(tp=2, optimizer={"use_distributed_optimizer": True, "ddp_bucket_size": 4000, "optimizer": "muon",
                                       "adam_eps": 1e-5}, data={"eval_interval": 0})
    with layout(2, 1):
        straight = losses(Trainer.on_registered_layout(cfg, CPU).train())
    with layout(2, 1):
        trainer = Trainer.on_registered_layout(cfg, CPU)
        for _ in range(5):
            trainer.train_step()
        trainer.save_checkpoint(directory)
    resumed_cfg = dataclasses.replace(with_checkpoint(cfg, load=directory),
                                      parallel=dataclasses.replace(cfg.parallel, tensor_model_parallel_size=1),
                                      optimizer=dataclasses.replace(cfg.optimizer, use_distributed_optimizer=False,
                                                                    ddp_bucket_size=None, zero_stage=3))
    with layout(1, 1):
        resumed = losses(Trainer.on_registered_layout(resumed_cfg, CPU).train())
    difference = max_relative_difference(resumed, straight[5:])
    print(f"Muon saved at TP=2 x DP=2 ZeRO-1, resumed at TP=1 x DP=4 ZeRO-3: iterations 6-10 max rel loss diff "
          f"{difference:.1e}")
    assert len(resumed) == 5 and difference < RESHARD


def test_reshard_llama_style_model(directory):
    """Fused blocks of unequal sizes (grouped-query QKV), SwiGLU's [gate; up], RMSNorm, rotary positions, learnable
    attention sinks (one logit per head, split over TP with the heads, saved whole), multi-token prediction (its
    module saved whole, the last stage's embedding copy not at all) and, where available, sequence parallelism:
    saved at TP=2 x PP=2, resumed at PP=4, iteration 4 (its loss and MTP loss) equals the uninterrupted run."""
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if not set(LLAMA_STYLE) <= model_fields:
        pytest.skip("these model options are not in this version")
    cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4, **LLAMA_STYLE, "softmax_type": "learnable",
                                         "mtp_num_layers": 1},
                      training={"train_iters": 4},
                      optimizer={"use_distributed_optimizer": True, "adam_eps": 1e-5}, data={"eval_interval": 0})
    if "sequence_parallel" in {f.name for f in dataclasses.fields(ParallelConfig)}:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=True))
    with layout(2, 2):
        records = Trainer.on_registered_layout(with_checkpoint(cfg, save=directory, save_interval=3), CPU).train()
    uninterrupted = losses(records)
    saved = full_tensors(open_checkpoint(f"{directory}/iter_0000003"))   # each TP rank's slice, merged
    sinks = {name: tuple(tensor.shape) for name, tensor in saved.items() if name.endswith("softmax_offset")}
    assert sinks == {f"{layer}.self_attention.softmax_offset": (cfg.model.num_attention_heads,)
                     for layer in [*(f"layers.{i}" for i in range(4)), "mtp.layers.0.transformer_layer"]}
    h = cfg.model.hidden_size
    assert tuple(saved["mtp.layers.0.eh_proj.weight"].shape) == (h, 2 * h)
    assert "mtp.layers.0.transformer_layer.mlp.linear_fc2.weight" in saved
    resumed_cfg = dataclasses.replace(
        with_checkpoint(cfg, load=f"{directory}/iter_0000003"),
        parallel=dataclasses.replace(ParallelConfig(), pipeline_model_parallel_size=4))
    with layout(1, 4):
        resumed_records = Trainer.on_registered_layout(resumed_cfg, CPU).train()
    resumed = losses(resumed_records)
    difference = max_relative_difference(resumed, uninterrupted[3:])
    assert max_relative_difference([r["mtp_loss"] for r in resumed_records if "mtp_loss" in r],
                                   [r["mtp_loss"] for r in records if "mtp_loss" in r][3:]) < RESHARD
    print(f"Llama-style model saved at TP=2 x PP=2 (ZeRO-1), resumed at PP=4: iteration 4 rel loss diff "
          f"{difference:.1e}")
    assert difference < RESHARD


def test_async_save_waits_for_every_rank_and_a_damaged_item_stops_every_rank(directory, monkeypatch):
    cfg = tiny_config(tp=2, optimizer={"use_distributed_optimizer": True}, data={"eval_interval": 0},
                      training={"train_iters": 6})
    with layout(2, 1):
        trainer = Trainer.on_registered_layout(cfg, CPU)
        for _ in range(2):
            trainer.train_step()
        trainer.save_checkpoint(f"{directory}/sync")
    release, write_data = threading.Event(), dcp.FileSystemWriter.write_data

    def held_on_rank_1(self, plan, planner):
        assert dist.get_rank() != 1 or release.wait(timeout=60)
        return write_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held_on_rank_1)
    with layout(2, 1):
        trainer = Trainer.on_registered_layout(with_checkpoint(cfg, async_save=True), CPU)
        for _ in range(2):
            trainer.train_step()
        trainer.save_checkpoint(f"{directory}/async")
        trainer.train_step()   # training goes on while the ranks write
        assert trainer.finish_save(wait=False) is None   # collective: rank 1 has not written yet
        assert not os.path.exists(f"{directory}/async/{POINTER_NAME}")
        release.set()
        assert trainer.finish_save().name == "iter_0000002"
    if dist.get_rank() == 0:
        sync, asynchronous = open_checkpoint(f"{directory}/sync"), open_checkpoint(f"{directory}/async")
        keys = sorted(sync.metadata.state_dict_metadata)
        assert keys == sorted(asynchronous.metadata.state_dict_metadata)
        assert all(torch.equal(a, b) for a, b in zip(sync.read(keys).values(), asynchronous.read(keys).values()))
        # Damage the last item of the last data file: the last rank's share of the verification.
        item, info = max(asynchronous.metadata.storage_data.items(), key=lambda kv: (kv[1].relative_path,
                                                                                     kv[1].offset))
        path = asynchronous.path / info.relative_path
        data = bytearray(path.read_bytes())
        data[info.offset + info.length - 4] ^= 0xFF
        path.write_bytes(bytes(data))
        damaged = [f"{path}: checksum mismatch in {item.fqn}"]
    else:
        damaged = [None]
    dist.broadcast_object_list(damaged, src=0)
    with layout(2, 1), pytest.raises(CheckpointError) as error:
        Trainer.on_registered_layout(with_checkpoint(cfg, load=f"{directory}/async"), CPU)
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, str(error.value))
    assert messages == damaged * dist.get_world_size(), messages


# Megatron-written layouts of the five styles (tests/checkpoint/megatron_reference.py): TP=2 x PP=2 for the dense ones,
# EP=2 x PP=2 for the mixtures of experts, and Llama with two virtual stages per pipeline rank (one layer a chunk).
MEGATRON_LAYOUTS = [("gpt3", 2, 2, None, 1), ("llama", 2, 2, None, 1), ("qwen", 2, 2, None, 1),
                    ("mixtral", 1, 2, None, 2), ("qwen_moe", 1, 2, None, 2), ("llama", 2, 2, 2, 1)]
MEGATRON_FORMATS = ("torch_dist", "torch")
MEGATRON_TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def relative_to_scale(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return float((actual - expected).abs().max() / expected.abs().max())


def save_megatron_checkpoints(directory, style, tp, pp, vpp, ep, formats=MEGATRON_FORMATS) -> torch.Tensor:
    """Megatron's models of ``style`` built at the layout on every rank and saved under ``directory/FORMAT``; their
    logits of MEGATRON_TOKENS [b, s, padded vocabulary] on every rank."""
    from ..checkpoint.megatron_reference import (build_models, megatron_args, megatron_layout, megatron_logits,
                                                 save_megatron)

    args = megatron_args(style, tp=tp, pp=pp, vpp=vpp, ep=ep)
    with megatron_layout(args):
        models = build_models(args)
        expected = megatron_logits(args, models, MEGATRON_TOKENS)
        for fmt in formats:
            save_megatron(megatron_args(style, tp=tp, pp=pp, vpp=vpp, ep=ep, ckpt_format=fmt), models,
                          f"{directory}/{fmt}")
    return expected


@pytest.mark.parametrize("style, tp, pp, vpp, ep", MEGATRON_LAYOUTS)
def test_megatron_checkpoints_load_reshard_import_and_export(directory, style, tp, pp, vpp, ep):
    """Megatron's own save at the layout, in both formats: loads back in Megatron bit for bit, reshards (torch_dist)
    to TP=1 x PP=1; imported into megalite (one process: ranks 0 and 1, one format each) it gives Megatron's logits
    within 1e-5 relative to their scale; exported back at the layout (4 exports: each import in each format, one a
    rank) it loads in Megatron on all ranks with the flags the export names and gives the original's logits."""
    pytest.importorskip("megatron.core")
    from megalite.checkpoint import load_pretrained
    from megalite.checkpoint.megatron_lm import export_megatron, import_megatron
    from ..checkpoint.megatron_reference import LOAD_FLAGS, loaded_megatron, megatron_logits

    expected = save_megatron_checkpoints(directory, style, tp, pp, vpp, ep)
    layout_sizes = (tp, pp, vpp, ep)
    command_line = LOAD_FLAGS.get(style, ())

    def loaded_layout(args):
        return (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                args.virtual_pipeline_model_parallel_size, args.expert_model_parallel_size)

    for fmt in MEGATRON_FORMATS:
        with loaded_megatron(f"{directory}/{fmt}", flags=command_line) as (loaded_args, loaded):
            assert loaded_layout(loaded_args) == layout_sizes
            torch.testing.assert_close(megatron_logits(loaded_args, loaded, MEGATRON_TOKENS), expected, rtol=0, atol=0)
    with loaded_megatron(f"{directory}/torch_dist", tp=1, pp=1, ep=1, flags=command_line) as (loaded_args, loaded):
        assert_close_to_scale(megatron_logits(loaded_args, loaded, MEGATRON_TOKENS), expected)
    if vpp and dist.get_rank() == 0:   # legacy files hold one model per virtual stage
        saved = torch.load(f"{directory}/torch/iter_0000010/mp_rank_00_000/model_optim_rng.pt", map_location="cpu",
                           weights_only=False)
        assert {"model0", "model1"} <= set(saved)

    rank = dist.get_rank()
    imported = {fmt: f"{directory}/megalite_{fmt}" for fmt in MEGATRON_FORMATS}
    import_difference = None
    if rank < len(MEGATRON_FORMATS):
        fmt = MEGATRON_FORMATS[rank]
        result = import_megatron(f"{directory}/{fmt}", imported[fmt], progress=False)
        assert result.format == fmt and result.iteration == 10
        with torch.no_grad():
            logits = load_pretrained(result.path)(MEGATRON_TOKENS)
        assert logits.shape == (2, 16, 101)   # NullTokenizer of --vocab-size 100: 100 ids and its EOD
        import_difference = relative_to_scale(logits, expected[..., :101])
    dist.barrier()
    source, target = MEGATRON_FORMATS[rank % 2], MEGATRON_FORMATS[rank // 2]
    _, flags = export_megatron(imported[source], f"{directory}/export_{source}_{target}", ckpt_format=target, tp=tp,
                               pp=pp, virtual_stages=vpp, ep=ep, progress=False)
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (import_difference, source, target, flags))
    import_differences = [o[0] for o in outcomes if o[0] is not None]
    print(f"Megatron {style} at (TP, PP, VPP, EP) = {layout_sizes} imported from torch_dist / torch: max rel logits "
          f"diff {import_differences[0]:.1e} / {import_differences[1]:.1e}")
    assert max(import_differences) <= RESHARD
    for _, source, target, flags in outcomes:
        with loaded_megatron(f"{directory}/export_{source}_{target}", flags=flags) as (loaded_args, loaded):
            assert loaded_layout(loaded_args) == layout_sizes
            exported = megatron_logits(loaded_args, loaded, MEGATRON_TOKENS)[..., :101]
        difference = relative_to_scale(exported, expected[..., :101])
        print(f"  imported from {source}, exported as {target} (flags {' '.join(flags)}): loaded in Megatron, max rel "
              f"logits diff {difference:.1e}")
        assert difference <= RESHARD
    if vpp and dist.get_rank() == 0:
        paths = sorted(Path(directory).glob("export_*_torch/iter_*/mp_rank_00_000/model_optim_rng.pt"))
        assert len(paths) == 2 and all({"model0", "model1"} <= set(torch.load(path, map_location="cpu",
                                                                              weights_only=False)) for path in paths)


@pytest.mark.parametrize("style", ["gpt3", "llama"])
def test_imported_megatron_checkpoint_trains_at_a_parallel_layout(directory, style):
    """A megalite run resumed (--load, no --finetune: Adam starts afresh) from the import of Megatron's TP=2 x PP=2
    torch_dist save trains at TP=2 x PP=2 (DP=1) with the losses of the same run in one process (within the suite's
    equivalence tolerance, 1e-5 relative; Adam's eps 1e-5 as there)."""
    pytest.importorskip("megatron.core")
    from megalite.checkpoint.megatron_lm import import_megatron

    save_megatron_checkpoints(directory, style, 2, 2, None, 1, formats=("torch_dist",))
    if dist.get_rank() == 0:
        import_megatron(f"{directory}/torch_dist", f"{directory}/megalite", progress=False)
    dist.barrier()
    model = dataclasses.replace(open_checkpoint(f"{directory}/megalite").manifest.megalite_config().model,
                                seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
    cfg = with_checkpoint(tiny_config(training={"train_iters": 4}, optimizer={"adam_eps": 1e-5},
                                      data={"eval_interval": 0}), load=f"{directory}/megalite")
    cfg = dataclasses.replace(cfg, model=model)
    expected = [None]
    with layout(1, 1, ranks=[0]) as member:
        if member:
            expected = [losses(Trainer.on_registered_layout(cfg, CPU).train())]
    dist.broadcast_object_list(expected, src=0)
    parallel = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tensor_model_parallel_size=2,
                                                                     pipeline_model_parallel_size=2))
    imported = full_tensors(open_checkpoint(f"{directory}/megalite"))
    with layout(2, 2):
        trainer = Trainer.on_registered_layout(parallel, CPU)
        assert trainer.state.iteration == 0
        started = full_parameters(trainer)   # this stage's, gathered over TP: the imported weights, not a fresh init
        different = [name for name in started if not torch.equal(started[name], imported[name])]
        assert started and not different, f"not the imported weights: {different}"
        actual = losses(trainer.train())
    difference = max_relative_difference(actual, expected[0])
    print(f"Megatron {style} imported, resumed at TP=2 x PP=2 vs one process: losses {actual}, max rel loss diff "
          f"{difference:.1e}")
    assert len(actual) == 4 and difference < RESHARD


def test_a_non_finite_shard_on_one_rank_stops_every_rank_before_anything_is_saved(directory):
    """TP=2 x DP=2 with the distributed optimizer: one weight made NaN on rank 1 only (its TP shard); the save's one
    all-reduce tells every rank, none writes anything, and the good checkpoint stays the latest."""
    from megalite.training.stopping import TrainingError

    cfg = tiny_config(tp=2, optimizer={"use_distributed_optimizer": True}, data={"eval_interval": 0})
    with layout(2, 1):
        trainer = Trainer.on_registered_layout(cfg, CPU)
        trainer.train_step()
        good = trainer.save_checkpoint(directory)
        trainer.train_step()
        if dist.get_rank() == 1:
            with torch.no_grad():
                next(iter(trainer.model[0].parameters())).view(-1)[0] = float("nan")
        with pytest.raises(TrainingError, match="iteration 2: the weights are not finite"):
            trainer.save_checkpoint(directory)
    dist.barrier()
    assert open_checkpoint(directory).path == good
    assert sorted(p.name for p in good.parent.iterdir() if p.name.startswith("iter_")) == [good.name]
