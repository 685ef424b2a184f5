"""Cross-field rules, checked before any process group exists, so that a bad value stops every rank with one line
instead of hanging in a collective. Messages name options by their flags (``FLAG.num_layers`` is ``--num-layers``)."""

from __future__ import annotations

from typing import Any, Iterable

from megalite.config.flags import FLAG
from megalite.config.schema import ConfigError, MegaliteConfig


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _at_least(low: int, values: Iterable[tuple[str, Any]]) -> None:
    """Each (field name, value) is >= ``low`` (None meaning "not set" passes)."""
    for name, value in values:
        _require(value is None or value >= low, f"{getattr(FLAG, name)} must be >= {low}, got {value}")


def _one_of(name: str, value: Any, choices: tuple) -> None:
    shown = [str(c) for c in choices if c is not None]
    _require(value in choices, f"{getattr(FLAG, name)} must be {', '.join(shown[:-1])} or {shown[-1]}, got {value!r}")


def validate(cfg: MegaliteConfig, world_size: int) -> None:
    """Check every cross-field rule; raise ConfigError naming the offending values."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    _at_least(1, [("num_layers", m.num_layers), ("hidden_size", m.hidden_size),
                  ("num_attention_heads", m.num_attention_heads), ("seq_length", m.seq_length),
                  ("vocab_size", m.vocab_size), ("make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
                  ("tensor_model_parallel_size", p.tensor_model_parallel_size),
                  ("pipeline_model_parallel_size", p.pipeline_model_parallel_size),
                  ("micro_batch_size", t.micro_batch_size), ("global_batch_size", t.global_batch_size),
                  ("log_interval", cfg.logging.log_interval), ("exit_interval", t.exit_interval)])
    _at_least(0, [("train_iters", t.train_iters)])
    _one_of("timing_log_level", cfg.logging.timing_log_level, (0, 1, 2))
    for name, value in [("exit_duration_in_mins", t.exit_duration_in_mins),
                        ("distributed_timeout_minutes", t.distributed_timeout_minutes)]:
        _require(value is None or value > 0, f"{getattr(FLAG, name)} must be > 0, got {value}")
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by {FLAG.tensor_model_parallel_size} {tp} x "
             f"{FLAG.pipeline_model_parallel_size} {pp} = {tp * pp}")
    dp = world_size // (tp * pp)
    _check_pipeline(cfg, dp)
    _require(m.hidden_size % m.num_attention_heads == 0,
             f"{FLAG.hidden_size} {m.hidden_size} is not divisible by {FLAG.num_attention_heads} "
             f"{m.num_attention_heads}")
    for name, value in [("num_attention_heads", m.num_attention_heads), ("ffn_hidden_size", m.ffn_size)]:
        _require(value % tp == 0,
                 f"{getattr(FLAG, name)} {value} is not divisible by {FLAG.tensor_model_parallel_size} {tp}")
    _check_architecture(cfg)
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"{FLAG.global_batch_size} {t.global_batch_size} is not divisible by {FLAG.micro_batch_size} "
             f"{t.micro_batch_size} x data-parallel size {dp} = {t.micro_batch_size * dp}")
    _require(m.max_positions >= m.seq_length,
             f"{FLAG.max_position_embeddings} {m.max_positions} is smaller than {FLAG.seq_length} {m.seq_length}")
    for name, value in [("hidden_dropout", m.hidden_dropout), ("attention_dropout", m.attention_dropout)]:
        _require(0.0 <= value < 1.0, f"{getattr(FLAG, name)} must be in [0, 1), got {value}")
    _check_optimizer(cfg, dp)
    _check_data(cfg)
    _check_checkpoint(cfg)
    _check_kernels(cfg)


def _check_pipeline(cfg: MegaliteConfig, dp: int) -> None:
    """Layers split evenly over PP x V chunks; the interleaved schedules need micro-batches in multiples of PP; the
    schedule's name, its PP > 1, its chunks (zbv: 2) and its engine (W steps: not FSDP2)."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    pp, per_chunk, v = (p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage,
                        p.num_virtual_stages_per_pipeline_rank)
    _at_least(1, [("num_layers_per_virtual_pipeline_stage", per_chunk), ("num_virtual_stages_per_pipeline_rank", v)])
    if per_chunk is not None:
        _require(m.num_layers % (per_chunk * pp) == 0,
                 f"{FLAG.num_layers} {m.num_layers} is not divisible by {FLAG.num_layers_per_virtual_pipeline_stage} "
                 f"{per_chunk} x {FLAG.pipeline_model_parallel_size} {pp} = {per_chunk * pp}")
        _require(v is None or v * per_chunk * pp == m.num_layers,
                 f"{FLAG.num_virtual_stages_per_pipeline_rank} {v} disagrees with "
                 f"{FLAG.num_layers_per_virtual_pipeline_stage} {per_chunk}: {v} x {per_chunk} x PP {pp} != "
                 f"{FLAG.num_layers} {m.num_layers}")
    chunks = p.virtual_stages(m.num_layers)
    _require(m.num_layers % (pp * chunks) == 0,
             f"{FLAG.num_layers} {m.num_layers} is not divisible by {FLAG.pipeline_model_parallel_size} {pp} x "
             f"virtual stages {chunks} = {pp * chunks}")
    _require(chunks == 1 or pp > 1, f"virtual pipeline stages ({chunks}) need {FLAG.pipeline_model_parallel_size} > 1")
    _one_of("pipeline_schedule", p.pipeline_schedule, ("1f1b", "zero-bubble", "zbv"))
    if p.pipeline_schedule != "1f1b":
        _require(pp > 1, f"{FLAG.pipeline_schedule} {p.pipeline_schedule} needs {FLAG.pipeline_model_parallel_size} > 1")
        _require(cfg.optimizer.zero_stage != 3,
                 f"{FLAG.pipeline_schedule} {p.pipeline_schedule} defers weight gradients to later steps, which "
                 f"FSDP2's per-layer gradient reduction ({FLAG.zero_stage} 3) does not wait for: use "
                 f"{FLAG.pipeline_schedule} 1f1b with ZeRO-3")
    if p.pipeline_schedule == "zbv":
        _require(chunks == 2, f"{FLAG.pipeline_schedule} zbv places exactly 2 chunks on each pipeline rank, got "
                              f"{chunks} virtual stages")
    micro_batch_product = t.micro_batch_size * dp
    if chunks > 1 and p.pipeline_schedule != "zbv" and t.global_batch_size % micro_batch_product == 0:
        num_micro = t.global_batch_size // micro_batch_product
        _require(num_micro % pp == 0,
                 f"the interleaved schedule needs the number of micro-batches ({FLAG.global_batch_size} "
                 f"{t.global_batch_size} / ({FLAG.micro_batch_size} {t.micro_batch_size} x data-parallel size {dp}) = "
                 f"{num_micro}) to be a multiple of {FLAG.pipeline_model_parallel_size} {pp}: use a global batch size "
                 f"that is a multiple of {micro_batch_product * pp}, e.g. "
                 f"{micro_batch_product * pp * -(-num_micro // pp)}")


def _check_architecture(cfg: MegaliteConfig) -> None:
    """Positions, norms, grouped-query attention, sequence parallelism and recompute (heads already divide TP)."""
    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    _one_of("position_embedding_type", m.position_embedding_type, ("learned_absolute", "rope"))
    _require(m.position_embedding_type != "rope" or m.head_dim % 2 == 0,
             f"rope needs an even head dimension, got {FLAG.hidden_size} {m.hidden_size} / "
             f"{FLAG.num_attention_heads} {m.num_attention_heads} = {m.head_dim}")
    _at_least(1, [("rotary_base", m.rotary_base)])
    _one_of("normalization", m.normalization, ("LayerNorm", "RMSNorm"))
    if m.group_query_attention:
        g, heads = m.num_query_groups, m.num_attention_heads
        _at_least(1, [("num_query_groups", g)])
        _require(heads % g == 0,
                 f"{FLAG.num_attention_heads} {heads} is not divisible by {FLAG.num_query_groups} {g}")
        # G % TP == 0: each rank holds G/TP whole key/value heads. TP % G == 0: each key/value head is split over
        # the TP/G ranks of its query heads, which all-gather it (so its head dimension must split TP/G ways).
        works = ", ".join(str(t) for t in range(1, heads + 1) if heads % t == 0 and (g % t == 0 or t % g == 0)
                          and (t <= g or m.head_dim % (t // g) == 0))
        _require(g % tp == 0 or tp % g == 0,
                 f"{FLAG.num_query_groups} {g} is not divisible by {FLAG.tensor_model_parallel_size} {tp}, nor {tp} "
                 f"by {g}: one must divide the other; tensor-model-parallel sizes that work: {works}")
        _require(tp <= g or m.head_dim % (tp // g) == 0,
                 f"with {FLAG.num_query_groups} {g} over {FLAG.tensor_model_parallel_size} {tp}, each key/value head "
                 f"is split over {tp // g} ranks, which head dimension {m.head_dim} does not allow; "
                 f"tensor-model-parallel sizes that work: {works}")
    if p.sequence_parallel:
        _require(tp > 1, f"{FLAG.sequence_parallel} needs {FLAG.tensor_model_parallel_size} > 1")
        _require(m.seq_length % tp == 0,
                 f"with {FLAG.sequence_parallel}, {FLAG.seq_length} {m.seq_length} must be divisible by "
                 f"{FLAG.tensor_model_parallel_size} {tp}")
    _one_of("recompute_granularity", m.recompute_granularity, (None, "full", "selective"))
    _one_of("recompute_method", m.recompute_method, (None, "uniform", "block"))
    if m.recompute_granularity == "full":
        _require(m.recompute_method is not None,
                 f"{FLAG.recompute_granularity} full needs {FLAG.recompute_method} uniform|block")
        per_chunk = m.num_layers // (p.pipeline_model_parallel_size * p.virtual_stages(m.num_layers))
        _require(1 <= m.recompute_num_layers <= per_chunk,
                 f"{FLAG.recompute_num_layers} must be between 1 and the {per_chunk} layers of a model chunk, got "
                 f"{m.recompute_num_layers}")
    else:
        _require(m.recompute_method is None,
                 f"{FLAG.recompute_method} applies to {FLAG.recompute_granularity} full only")


def _check_optimizer(cfg: MegaliteConfig, dp: int) -> None:
    o, t = cfg.optimizer, cfg.training
    _one_of("lr_decay_style", o.lr_decay_style, ("cosine", "linear", "constant"))
    _require(o.lr >= 0 and o.min_lr >= 0 and o.min_lr <= o.lr,
             f"need 0 <= {FLAG.min_lr} <= {FLAG.lr}, got {FLAG.lr} {o.lr} and {FLAG.min_lr} {o.min_lr}")
    _at_least(0, [("lr_warmup_iters", o.lr_warmup_iters), ("lr_decay_iters", o.lr_decay_iters),
                  ("clip_grad", o.clip_grad)])
    _require(0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1,
             f"{FLAG.adam_beta1} and {FLAG.adam_beta2} must be in [0, 1), got {o.adam_beta1}, {o.adam_beta2}")
    _require(not (t.bf16 and t.fp16), f"{FLAG.bf16} and {FLAG.fp16} exclude each other")
    _one_of("zero_stage", o.zero_stage, (1, 2, 3))
    _require(o.zero_stage != 2 or o.use_distributed_optimizer,
             f"{FLAG.zero_stage} 2 needs {FLAG.use_distributed_optimizer}")
    _require(not o.overlap_param_gather or o.use_distributed_optimizer,
             f"{FLAG.overlap_param_gather} needs {FLAG.use_distributed_optimizer}")
    if o.zero_stage == 3:
        _check_fully_sharded(cfg, dp)
    _require(not o.offload_params or o.zero_stage == 3, f"{FLAG.offload_params} needs {FLAG.zero_stage} 3")
    _require(not o.offload_params or o.optimizer_cpu_offload,
             f"{FLAG.offload_params} needs {FLAG.optimizer_cpu_offload}: offloaded parameter shards are stepped on "
             f"the CPU")
    _at_least(1, [("ddp_bucket_size", o.ddp_bucket_size), ("loss_scale_window", o.loss_scale_window),
                  ("hysteresis", o.hysteresis)])
    _require(o.loss_scale is None or t.fp16, f"{FLAG.loss_scale} applies to {FLAG.fp16} only")
    _require(o.loss_scale is None or o.loss_scale > 0, f"{FLAG.loss_scale} must be > 0, got {o.loss_scale}")
    _require(0 < o.min_loss_scale <= o.initial_loss_scale,
             f"need 0 < {FLAG.min_loss_scale} <= {FLAG.initial_loss_scale}, got {o.min_loss_scale} and "
             f"{o.initial_loss_scale}")


def _check_fully_sharded(cfg: MegaliteConfig, dp: int) -> None:
    """ZeRO-3 runs on FSDP2, which owns gradient reduction and parameter gathering: the options of our own
    data-parallel engine do not apply, and there must be data-parallel ranks to shard over."""
    o = cfg.optimizer
    _require(not o.use_distributed_optimizer,
             f"{FLAG.zero_stage} 3 shards the optimizer itself (FSDP2): drop {FLAG.use_distributed_optimizer}")
    for name, value in [("overlap_grad_reduce", o.overlap_grad_reduce),
                        ("overlap_param_gather", o.overlap_param_gather)]:
        _require(not value, f"{getattr(FLAG, name)} is for stages 1-2: with {FLAG.zero_stage} 3, FSDP2 overlaps its "
                            f"own reductions and gathers")
    _require(dp > 1, f"{FLAG.zero_stage} 3 shards over data-parallel ranks and this layout has none (data-parallel "
                     f"size 1); for CPU offload on one data-parallel rank use {FLAG.optimizer_cpu_offload}")


def _check_checkpoint(cfg: MegaliteConfig) -> None:
    """The checkpoint options alone (the checkpoint itself is checked by megalite.checkpoint.check_checkpoint)."""
    c = cfg.checkpoint
    _at_least(1, [("save_interval", c.save_interval)])
    _require(c.save_interval is None or c.save is not None, f"{FLAG.save_interval} needs {FLAG.save}")
    _require(not c.finetune or c.load is not None, f"{FLAG.finetune} needs {FLAG.load}")


def _check_kernels(cfg: MegaliteConfig) -> None:
    """The fused-kernel mode; ``on`` needs a GPU here (whether the extension builds is checked when the model is)."""
    mode = cfg.kernels.use_fused_kernels
    _one_of("use_fused_kernels", mode, ("auto", "on", "off"))
    if mode == "on":
        import torch   # noqa: PLC0415 - only here: checking the other options needs no torch

        _require(torch.cuda.is_available(),
                 f"{FLAG.use_fused_kernels} on needs a CUDA device and none is visible: use auto (fused kernels "
                 f"where there is a GPU, torch ops elsewhere) or off")


def _check_data(cfg: MegaliteConfig) -> None:
    """The data options alone (no file is opened here: megalite.data.check_data_files does that)."""
    d = cfg.data
    d.split_fractions()
    _one_of("tokenizer_type", d.tokenizer_type, ("SentencePieceTokenizer", "NullTokenizer"))
    _at_least(0, [("eval_interval", d.eval_interval), ("eval_iters", d.eval_iters)])
    if d.mock_data:
        _require(d.data_path is None, f"{FLAG.mock_data} and {FLAG.data_path} exclude each other")
        return
    if d.data_path is None:  # the built-in corpus, which brings its own tokenizer
        _require(d.tokenizer_model is None and d.tokenizer_type == "SentencePieceTokenizer",
                 f"{FLAG.tokenizer_type}/{FLAG.tokenizer_model} need {FLAG.data_path} (the built-in corpus has its "
                 f"own tokenizer)")
        return
    d.blend()
    _require(d.tokenizer_type != "SentencePieceTokenizer" or d.tokenizer_model is not None,
             f"{FLAG.data_path} needs {FLAG.tokenizer_model} (or {FLAG.tokenizer_type} NullTokenizer)")
