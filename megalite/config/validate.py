"""Cross-field rules, checked before any process group exists, so that a bad value stops every rank with one line
instead of hanging in a collective. Messages name options by their flags (``FLAG.num_layers`` is ``--num-layers``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Optional

from megalite.config.batches import batch_schedule
from megalite.config.dims import ParallelDims
from megalite.config.flags import FLAG
from megalite.config.schema import TOKENIZER_TYPES, ConfigError, MegaliteConfig, ModelConfig, OptimizerConfig, sections


# Megatron's tokenizer names that megalite.data.tokenizer serves beside its SentencePiece and Null tokenizers.
MEGATRON_TOKENIZERS = ("Llama2Tokenizer", "GPTSentencePieceTokenizer", "TikTokenizer")


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
    _check_finite(cfg)
    _at_least(1, [("num_layers", m.num_layers), ("hidden_size", m.hidden_size),
                  ("num_attention_heads", m.num_attention_heads), ("seq_length", m.seq_length),
                  ("vocab_size", m.vocab_size), ("make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
                  ("tensor_model_parallel_size", p.tensor_model_parallel_size),
                  ("pipeline_model_parallel_size", p.pipeline_model_parallel_size),
                  ("context_parallel_size", p.context_parallel_size),
                  ("micro_batch_size", t.micro_batch_size), ("global_batch_size", t.global_batch_size),
                  ("log_interval", cfg.logging.log_interval), ("exit_interval", t.exit_interval)])
    _at_least(0, [("train_iters", t.train_iters)])
    _check_training_length(cfg)
    _one_of("timing_log_level", cfg.logging.timing_log_level, (0, 1, 2))
    _one_of("distributed_backend", t.distributed_backend, ("nccl", "gloo"))
    _require(t.plot is None or t.dry_run, f"{FLAG.plot} draws the memory estimate of {FLAG.dry_run}: add it")
    for name, value in [("exit_duration_in_mins", t.exit_duration_in_mins),
                        ("distributed_timeout_minutes", t.distributed_timeout_minutes)]:
        _require(value is None or value > 0, f"{getattr(FLAG, name)} must be > 0, got {value}")
    dims = ParallelDims.of(p, world_size)
    tp, dp = dims.tp, dims.dp
    _check_pipeline(cfg, dims)
    _at_least(1, [("kv_channels", m.kv_channels)])
    _require(m.kv_channels is not None or m.hidden_size % m.num_attention_heads == 0,
             f"{FLAG.hidden_size} {m.hidden_size} is not divisible by {FLAG.num_attention_heads} "
             f"{m.num_attention_heads} (or give the head dimension: {FLAG.kv_channels})")
    for name, value in [("num_attention_heads", m.num_attention_heads), ("ffn_hidden_size", m.ffn_size)]:
        _require(value % tp == 0,
                 f"{getattr(FLAG, name)} {value} is not divisible by {FLAG.tensor_model_parallel_size} {tp}")
    _check_architecture(cfg)
    _check_multi_token_prediction(cfg)
    _check_fp8(cfg, dims)
    _check_context_parallel(cfg)
    _check_experts(cfg, dims)
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"{FLAG.global_batch_size} {t.global_batch_size} is not divisible by {FLAG.micro_batch_size} "
             f"{t.micro_batch_size} x data-parallel size {dp} = {t.micro_batch_size * dp}")
    _check_batch_ramp(cfg, dims)
    _require(m.max_positions >= m.seq_length,
             f"{FLAG.max_position_embeddings} {m.max_positions} is smaller than {FLAG.seq_length} {m.seq_length}")
    for name, value in [("hidden_dropout", m.hidden_dropout), ("attention_dropout", m.attention_dropout)]:
        _require(0.0 <= value < 1.0, f"{getattr(FLAG, name)} must be in [0, 1), got {value}")
    _at_least(0, [("init_method_std", m.init_method_std), ("layernorm_epsilon", m.layernorm_epsilon)])
    _check_optimizer(cfg, dims)
    _check_instances(cfg, dims)
    _check_data(cfg)
    _check_logging(cfg, world_size)
    _check_checkpoint(cfg)
    _check_kernels(cfg)
    _check_simulation(cfg)


def _check_finite(cfg: MegaliteConfig) -> None:
    """No float option may be an infinity or a NaN, and none needs one: where "never" or "no limit" makes sense, None
    or 0 says it. An infinity passes every lower bound below (a NaN, any rule written as a refusal of the bad range)
    and poisons the weights later: an inf learning rate, init std or loss scale, a NaN epsilon. Checked by value over
    every section, so that an option added later is covered too."""
    for section, _ in sections():
        values = getattr(cfg, section)
        for field in dataclasses.fields(values):
            value = getattr(values, field.name)
            _require(not isinstance(value, float) or math.isfinite(value),
                     f"{getattr(FLAG, field.name)} must be a finite number, got {value}")


def _check_simulation(cfg: MegaliteConfig) -> None:
    t = cfg.training
    if not t.simulate_gpus:
        return
    _one_of("simulate_device", t.simulate_device, ("h100", "h200", "a100", "b200"))
    ranks = t.simulate_rank.split(",")
    _require(t.simulate_rank == "all" or all(r.isdigit() and int(r) < t.simulate_gpus for r in ranks),
             f"{FLAG.simulate_rank} must be ranks below {FLAG.simulate_gpus} {t.simulate_gpus} (separated by commas) "
             f"or 'all', got {t.simulate_rank!r}")
    _require(not t.dry_run, f"{FLAG.simulate_gpus} and {FLAG.dry_run} are two ways to check a job: choose one")
    _require(not cfg.optimizer.optimizer_cpu_offload,
             f"{FLAG.simulate_gpus} does not simulate {FLAG.optimizer_cpu_offload}: the simulated GPUs' tensors hold "
             f"no values to copy to the host ({FLAG.dry_run} estimates its memory)")


def _check_training_length(cfg: MegaliteConfig) -> None:
    """Iteration-based or sample-based training, with the schedule options of one kind only (Megatron's rules)."""
    t, o = cfg.training, cfg.optimizer
    _at_least(1, [("train_samples", t.train_samples), ("lr_decay_samples", o.lr_decay_samples)])
    _at_least(0, [("lr_warmup_samples", o.lr_warmup_samples)])
    _require(o.lr_warmup_fraction is None or 0 <= o.lr_warmup_fraction <= 1,
             f"{FLAG.lr_warmup_fraction} must be in [0, 1], got {o.lr_warmup_fraction}")
    if t.train_samples is None:
        for name, value in [("lr_decay_samples", o.lr_decay_samples), ("lr_warmup_samples", o.lr_warmup_samples)]:
            _require(not value, f"{getattr(FLAG, name)} is for sample-based training: it needs {FLAG.train_samples} "
                                f"(use the _iters form with {FLAG.train_iters})")
        _require(o.lr_warmup_fraction is None or o.lr_warmup_iters == 0,
                 f"give one of {FLAG.lr_warmup_fraction} and {FLAG.lr_warmup_iters}")
        return
    _require(t.train_iters is None, f"give one of {FLAG.train_iters} and {FLAG.train_samples}")
    for name, value in [("lr_decay_iters", o.lr_decay_iters), ("lr_warmup_iters", o.lr_warmup_iters)]:
        _require(not value, f"with {FLAG.train_samples} the schedule is in samples: {getattr(FLAG, name)} becomes "
                            f"{getattr(FLAG, name.replace('_iters', '_samples'))}")
    _require(o.lr_warmup_fraction is None or o.lr_warmup_samples == 0,
             f"give one of {FLAG.lr_warmup_fraction} and {FLAG.lr_warmup_samples}")


def _check_batch_ramp(cfg: MegaliteConfig, dims: ParallelDims) -> None:
    """Every global batch a ramp takes runs on this layout: whole micro-batches on every DP rank, and with the
    interleaved schedule a multiple of PP of them (Megatron finds out when the batch grows; this finds out now)."""
    t, p = cfg.training, cfg.parallel
    schedule = batch_schedule(t, cfg.model.seq_length)
    if not schedule.ramps:
        return
    flag = FLAG.rampup_batch_size if t.rampup_batch_size is not None else FLAG.step_batch_size_schedule
    _require(schedule.largest == t.global_batch_size,
             f"the largest batch of {flag} is {schedule.largest}: {FLAG.global_batch_size} must be that "
             f"(got {t.global_batch_size})")
    dp = dims.dp
    step = t.micro_batch_size * dp
    pp, chunks = p.pipeline_model_parallel_size, p.virtual_stages(cfg.model.num_layers)
    for size in schedule.sizes():
        _require(size % step == 0,
                 f"{flag} reaches global batch {size}, which is not divisible by {FLAG.micro_batch_size} "
                 f"{t.micro_batch_size} x data-parallel size {dp} = {step}")
        _require(chunks == 1 or size // step % pp == 0,
                 f"{flag} reaches global batch {size}: {size // step} micro-batches, which the interleaved schedule "
                 f"needs to be a multiple of {FLAG.pipeline_model_parallel_size} {pp}")


def _check_uneven_pipeline(cfg: MegaliteConfig) -> Optional[tuple[int, ...]]:
    """Megatron's uneven-pipeline options, one way at a time, and the split they give (None: none of them)."""
    p, m = cfg.parallel, cfg.model
    ways = [flags for flags, given in (
        ((FLAG.pipeline_model_parallel_layout,), p.pipeline_model_parallel_layout is not None),
        ((FLAG.decoder_first_pipeline_num_layers, FLAG.decoder_last_pipeline_num_layers),
         p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None),
        ((FLAG.account_for_embedding_in_pipeline_split, FLAG.account_for_loss_in_pipeline_split),
         p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split)) if given]
    if not ways:
        return None
    if len(ways) > 1:
        raise ConfigError(f"{' / '.join(ways[0])} and {' / '.join(ways[1])} both split the pipeline: give one")
    _at_least(0, [("decoder_first_pipeline_num_layers", p.decoder_first_pipeline_num_layers),
                  ("decoder_last_pipeline_num_layers", p.decoder_last_pipeline_num_layers)])
    if p.pipeline_model_parallel_layout is None:
        _require(p.num_layers_per_virtual_pipeline_stage is None,
                 f"with {' / '.join(ways[0])} give V with {FLAG.num_virtual_stages_per_pipeline_rank}, not "
                 f"{FLAG.num_layers_per_virtual_pipeline_stage}")
        _require(ways[0][0] != FLAG.decoder_first_pipeline_num_layers or p.pipeline_schedule != "zbv",
                 f"{FLAG.pipeline_schedule} zbv puts the first and last virtual stages on rank 0: split it with "
                 f"{FLAG.pipeline_model_parallel_layout} instead of {FLAG.decoder_first_pipeline_num_layers}/"
                 f"{FLAG.decoder_last_pipeline_num_layers}")
        return p.pipeline_split(m)
    _require(p.num_layers_per_virtual_pipeline_stage is None,
             f"{FLAG.pipeline_model_parallel_layout} sets each virtual stage's layers: drop "
             f"{FLAG.num_layers_per_virtual_pipeline_stage}")
    split = p.pipeline_split(m)
    v = p.virtual_stages(m.num_layers)
    _require(p.num_virtual_stages_per_pipeline_rank in (None, v),
             f"{FLAG.pipeline_model_parallel_layout} has {v} virtual stage(s) per rank, "
             f"{FLAG.num_virtual_stages_per_pipeline_rank} says {p.num_virtual_stages_per_pipeline_rank}")
    return split


def _check_pipeline(cfg: MegaliteConfig, dims: ParallelDims) -> None:
    """Layers split evenly over PP x V chunks; the interleaved schedules need micro-batches in multiples of PP; the
    schedule's name, its PP > 1, its chunks (zbv: 2) and its engine (W steps: not FSDP2)."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    pp, per_chunk, v = (p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage,
                        p.num_virtual_stages_per_pipeline_rank)
    _at_least(1, [("num_layers_per_virtual_pipeline_stage", per_chunk), ("num_virtual_stages_per_pipeline_rank", v)])
    uneven = _check_uneven_pipeline(cfg)
    if per_chunk is not None:
        _require(m.num_layers % (per_chunk * pp) == 0,
                 f"{FLAG.num_layers} {m.num_layers} is not divisible by {FLAG.num_layers_per_virtual_pipeline_stage} "
                 f"{per_chunk} x {FLAG.pipeline_model_parallel_size} {pp} = {per_chunk * pp}")
        _require(v is None or v * per_chunk * pp == m.num_layers,
                 f"{FLAG.num_virtual_stages_per_pipeline_rank} {v} disagrees with "
                 f"{FLAG.num_layers_per_virtual_pipeline_stage} {per_chunk}: {v} x {per_chunk} x PP {pp} != "
                 f"{FLAG.num_layers} {m.num_layers}")
    chunks = p.virtual_stages(m.num_layers)
    if uneven is None:
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
    dp = dims.dp
    micro_batch_product = t.micro_batch_size * dp
    if chunks > 1 and p.pipeline_schedule != "zbv" and t.global_batch_size % micro_batch_product == 0:
        num_micro = dims.micro_batches(t.global_batch_size, t.micro_batch_size)
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
    _one_of("position_embedding_type", m.position_embedding_type, ("learned_absolute", "rope", "none"))
    _require(0 < m.rotary_percent <= 1, f"{FLAG.rotary_percent} must be in (0, 1], got {m.rotary_percent}")
    head_dim = (f"{FLAG.kv_channels} {m.kv_channels}" if m.kv_channels else
                f"{FLAG.hidden_size} {m.hidden_size} / {FLAG.num_attention_heads} {m.num_attention_heads} = {m.head_dim}")
    _require(m.position_embedding_type != "rope" or m.rotary_percent < 1 or m.head_dim % 2 == 0,
             f"rope needs an even head dimension, got {head_dim}")
    _require(m.position_embedding_type != "rope" or m.rotary_percent == 1 or (m.rotary_dim >= 2
                                                                              and m.rotary_dim % 2 == 0),
             f"rope rotates channel pairs: it needs an even number of rotated channels, got head dimension "
             f"{m.head_dim} x {FLAG.rotary_percent} {m.rotary_percent:g} = {m.rotary_dim}")
    _at_least(1, [("rotary_base", m.rotary_base)])
    _require(m.rope_scaling_type != "dynamic",
             f"{FLAG.rope_scaling_type} dynamic is not supported: dynamic NTK scaling changes the frequencies "
             f"with the length of the sequence generated, which training does not do")
    _require(m.use_rope_scaling or m.rope_scaling_type == "llama3",
             f"{FLAG.rope_scaling_type} {m.rope_scaling_type} needs {FLAG.use_rope_scaling}")
    if m.use_rope_scaling:
        _require(m.position_embedding_type == "rope",
                 f"{FLAG.use_rope_scaling} needs {FLAG.position_embedding_type} rope")
        _one_of("rope_scaling_type", m.rope_scaling_type, ("llama3", "linear", "yarn"))
        _require(m.rope_scaling_factor >= 1, f"{FLAG.rope_scaling_factor} must be >= 1, got {m.rope_scaling_factor}")
        low, high = m.rope_scaling_low_freq_factor, m.rope_scaling_high_freq_factor
        _require(m.rope_scaling_type != "llama3" or 0 < low < high,
                 f"need 0 < {FLAG.rope_scaling_low_freq_factor} < {FLAG.rope_scaling_high_freq_factor}, got "
                 f"{low} and {high}")
        _at_least(1, [("rope_scaling_original_max_position_embeddings",
                       m.rope_scaling_original_max_position_embeddings)])
    if m.use_rope_scaling and m.rope_scaling_type == "yarn":
        _require(0 < m.beta_slow < m.beta_fast,
                 f"need 0 < {FLAG.beta_slow} < {FLAG.beta_fast}, got {m.beta_slow} and {m.beta_fast}")
        _require(m.mscale > 0 and m.mscale_all_dim >= 0,
                 f"need {FLAG.mscale} > 0 and {FLAG.mscale_all_dim} >= 0, got {m.mscale} and {m.mscale_all_dim}")
        # Hugging Face ignores mscale without mscale_all_dim, Megatron does not: allow only where both agree.
        _require(m.mscale_all_dim > 0 or m.mscale == 1,
                 f"{FLAG.mscale} {m.mscale} needs {FLAG.mscale_all_dim} (without it the attention factor is "
                 f"0.1 ln factor + 1)")
        _require(m.rope_scaling_attention_factor is None or m.rope_scaling_attention_factor > 0,
                 f"{FLAG.rope_scaling_attention_factor} must be > 0, got {m.rope_scaling_attention_factor}")
    _require(not m.openai_gelu or not (m.swiglu or m.quick_geglu),
             f"{FLAG.openai_gelu} is for the GeLU MLPs, not {FLAG.swiglu if m.swiglu else FLAG.quick_geglu}")
    gated = [flag for flag, on in ((FLAG.swiglu, m.swiglu), (FLAG.quick_geglu, m.quick_geglu),
                                   (FLAG.gated_linear_unit, m.gated_linear_unit)) if on]
    _require(len(gated) <= 1, f"{' and '.join(gated)} are {len(gated)} gated MLPs: give one")
    for name, value, unset in (("glu_linear_offset", m.glu_linear_offset, 0.0),
                               ("activation_func_clamp_value", m.activation_func_clamp_value, None)):
        _require(value == unset or m.gated_mlp,
                 f"{getattr(FLAG, name)} is for a gated MLP ({FLAG.swiglu}, {FLAG.quick_geglu} or "
                 f"{FLAG.gated_linear_unit})")
    _require(m.activation_func_clamp_value is None or m.activation_func_clamp_value > 0,
             f"{FLAG.activation_func_clamp_value} must be > 0, got {m.activation_func_clamp_value}")
    _require(not m.yarn_unrounded_correction_range or (m.use_rope_scaling and m.rope_scaling_type == "yarn"),
             f"{FLAG.yarn_unrounded_correction_range} needs {FLAG.use_rope_scaling} with {FLAG.rope_scaling_type} "
             f"yarn")
    _require(m.softmax_scale is None or m.softmax_scale > 0, f"{FLAG.softmax_scale} must be > 0, got {m.softmax_scale}")
    _require(m.softmax_scale is None or not m.multi_latent_attention,
             f"{FLAG.softmax_scale} is not supported with {FLAG.multi_latent_attention} (its scale follows its "
             f"head dimensions and yarn's mscale)")
    if m.local_rotary_base is not None:
        _require(m.position_embedding_type == "rope" and m.window_size is not None,
                 f"{FLAG.local_rotary_base} is the rotary base of the windowed layers: it needs "
                 f"{FLAG.position_embedding_type} rope and {FLAG.window_size}")
        _at_least(1, [("local_rotary_base", m.local_rotary_base)])
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
        cp = p.context_parallel_size
        _require(tp > 1, f"{FLAG.sequence_parallel} needs {FLAG.tensor_model_parallel_size} > 1")
        _require(m.seq_length % (tp * cp) == 0,
                 f"with {FLAG.sequence_parallel}, {FLAG.seq_length} {m.seq_length} must be divisible by "
                 f"{FLAG.tensor_model_parallel_size} {tp}" + (f" x {FLAG.context_parallel_size} {cp}" if cp > 1
                                                               else ""))
    if m.multi_latent_attention:
        _check_latent_attention(m)
    else:
        defaults = ModelConfig()
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            _require(getattr(m, name) == getattr(defaults, name),
                     f"{getattr(FLAG, name)} needs {FLAG.multi_latent_attention}")
    m.attention_windows()   # raises on a bad --window-size or --window-attn-skip-freq
    _one_of("softmax_type", m.softmax_type, ("vanilla", "off-by-one", "learnable"))
    _one_of("recompute_granularity", m.recompute_granularity, (None, "full", "selective"))
    _one_of("recompute_method", m.recompute_method, (None, "uniform", "block"))
    if m.recompute_granularity == "full":
        _require(m.recompute_method is not None,
                 f"{FLAG.recompute_granularity} full needs {FLAG.recompute_method} uniform|block")
        per_chunk = max(p.pipeline_split(m) or
                        [m.num_layers // (p.pipeline_model_parallel_size * p.virtual_stages(m.num_layers))])
        _require(1 <= m.recompute_num_layers <= per_chunk,
                 f"{FLAG.recompute_num_layers} must be between 1 and the {per_chunk} layers of the largest model "
                 f"chunk, got "
                 f"{m.recompute_num_layers}")
    else:
        _require(m.recompute_method is None,
                 f"{FLAG.recompute_method} applies to {FLAG.recompute_granularity} full only")
    _check_recompute_modules(m)
    _check_offload_modules(m)


RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts", "layernorm", "moe_act", "mla_up_proj")


def _check_recompute_modules(m: ModelConfig) -> None:
    """--recompute-modules: Megatron's names, with selective granularity, each for a part the model has."""
    if m.recompute_modules is None:
        return
    _require(m.recompute_granularity == "selective",
             f"{FLAG.recompute_modules} applies to {FLAG.recompute_granularity} selective")
    modules = m.recomputed_modules()
    unknown = sorted(modules - set(RECOMPUTE_MODULES))
    _require(not unknown, f"{FLAG.recompute_modules}: unknown {' '.join(unknown)} (choose from "
                          f"{', '.join(RECOMPUTE_MODULES)})")
    needs = {"moe": (m.num_experts is not None, FLAG.num_experts),
             "moe_act": (m.num_experts is not None, FLAG.num_experts),
             "shared_experts": (bool(m.moe_shared_expert_intermediate_size),
                                FLAG.moe_shared_expert_intermediate_size),
             "mla_up_proj": (m.multi_latent_attention, FLAG.multi_latent_attention)}
    for module in sorted(modules & set(needs)):
        present, flag = needs[module]
        _require(present, f"{FLAG.recompute_modules} {module} needs {flag}: the model has no such part")
    _require(not {"moe", "shared_experts"} <= modules and not {"moe", "moe_act"} <= modules,
             f"{FLAG.recompute_modules} moe already reruns the whole MoE layer: drop shared_experts and moe_act")


OFFLOAD_MODULES = ("attn_norm", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")


def _check_offload_modules(m: ModelConfig) -> None:
    """--fine-grained-activation-offloading with --offload-modules (Megatron's names), each for a part the model has
    that keeps something in the forward: a part rerun in backward keeps only its inputs, and a fully recomputed layer
    or MoE layer keeps nothing of its parts (their rerun happens in backward, where nothing is offloaded)."""
    offloading = FLAG.fine_grained_activation_offloading
    if not m.fine_grained_activation_offloading:
        _require(m.offload_modules is None, f"{FLAG.offload_modules} needs {offloading}")
        return
    _require(bool(m.offload_modules), f"{offloading} needs {FLAG.offload_modules} (choose from "
                                      f"{', '.join(OFFLOAD_MODULES)})")
    modules = m.offloaded_modules()
    unknown = sorted(modules - set(OFFLOAD_MODULES))
    _require(not unknown, f"{FLAG.offload_modules}: unknown {' '.join(unknown)} (choose from "
                          f"{', '.join(OFFLOAD_MODULES)})")
    experts = sorted(modules & {"expert_fc1", "moe_act"})
    _require(not experts or m.num_experts is not None,
             f"{FLAG.offload_modules} {' '.join(experts)} needs {FLAG.num_experts}: the model has no such part")
    _require("attn_proj" not in modules or "core_attn" in modules,
             f"{FLAG.offload_modules} attn_proj needs core_attn: the attention core keeps the output projection's "
             f"input too")
    _require(m.recompute_granularity != "full",
             f"{offloading} does not apply to {FLAG.recompute_granularity} full: a recomputed layer keeps only its "
             f"input, and its parts save what they keep while backward reruns them")
    _require(not experts or "moe" not in m.recomputed_modules(),
             f"{FLAG.offload_modules} {' '.join(experts)} does not apply with {FLAG.recompute_modules} moe: the "
             f"MoE layer keeps only its input, the experts save what they keep while backward reruns them")


def _check_latent_attention(m: ModelConfig) -> None:
    """What multi-latent attention replaces (its own q/k/v shapes and rotary channels) cannot be set beside it."""
    mla = FLAG.multi_latent_attention
    _require(m.position_embedding_type == "rope", f"{mla} needs {FLAG.position_embedding_type} rope (its decoupled "
                                                  f"rotary channels)")
    for flag, given in ((FLAG.group_query_attention, m.group_query_attention), (FLAG.kv_channels, m.kv_channels),
                        (FLAG.qk_layernorm, m.qk_layernorm), (FLAG.add_qkv_bias, m.add_qkv_bias),
                        (FLAG.rotary_percent, m.rotary_percent != 1), (FLAG.fp8_format, m.fp8_format)):
        _require(not given, f"{flag} is not supported with {mla} (which has its own query, key and value shapes)"
                 if flag != FLAG.fp8_format else f"{flag} is not supported with {mla}")
    _require(m.disable_bias_linear, f"{mla} needs {FLAG.disable_bias_linear} (DeepSeek's attention has no biases)")
    _at_least(1, [("kv_lora_rank", m.kv_lora_rank), ("qk_head_dim", m.qk_head_dim), ("v_head_dim", m.v_head_dim)])
    _require(m.q_lora_rank is None or m.q_lora_rank >= 1, f"{FLAG.q_lora_rank} must be >= 1, got {m.q_lora_rank}")
    _require(m.qk_pos_emb_head_dim >= 2 and m.qk_pos_emb_head_dim % 2 == 0,
             f"{FLAG.qk_pos_emb_head_dim} must be even and >= 2 (rope rotates channel pairs), got "
             f"{m.qk_pos_emb_head_dim}")


def _check_multi_token_prediction(cfg: MegaliteConfig) -> None:
    """MTP's depth and loss weight; positions the shifted tokens' embedding can take (Megatron's rule)."""
    m = cfg.model
    _require(m.mtp_loss_scaling_factor >= 0,
             f"{FLAG.mtp_loss_scaling_factor} must be >= 0, got {m.mtp_loss_scaling_factor}")
    if m.mtp_num_layers is None:
        return
    _at_least(1, [("mtp_num_layers", m.mtp_num_layers)])
    _require(m.mtp_num_layers < m.seq_length,
             f"{FLAG.mtp_num_layers} {m.mtp_num_layers} leaves no token to predict in {FLAG.seq_length} "
             f"{m.seq_length}")
    _require(not m.learned_positions,
             f"{FLAG.mtp_num_layers} needs {FLAG.position_embedding_type} rope or none (Megatron's rule: the "
             f"multi-token prediction modules embed shifted tokens, and learned absolute positions are not supported)")


# FP8 matrix products (torch._scaled_mm on Hopper) take dimensions that are multiples of this.
FP8_MULTIPLE = 16


def _check_fp8(cfg: MegaliteConfig, dims: ParallelDims) -> None:
    """The FP8 recipe's options, bf16 around it, and every dimension of the FP8 products a multiple of 16: each
    rank's slice of the attention and MLP weights, and its tokens per micro-batch (the weight gradient's inner
    dimension)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    _one_of("fp8_format", m.fp8_format, (None, "e4m3", "hybrid"))
    _one_of("fp8_recipe", m.fp8_recipe, ("tensorwise", "delayed", "rowwise"))
    _one_of("fp8_amax_compute_algo", m.fp8_amax_compute_algo, ("max", "most_recent"))
    _at_least(1, [("fp8_amax_history_len", m.fp8_amax_history_len)])
    _at_least(0, [("fp8_margin", m.fp8_margin)])
    _require(not m.fp8_param_gather or m.fp8_format is not None, f"{FLAG.fp8_param_gather} needs {FLAG.fp8_format}")
    if m.fp8_format is None:
        return
    _check_fp8_param_gather(cfg, dims)
    _require(t.bf16, f"{FLAG.fp8_format} needs {FLAG.bf16}: FP8 products take bf16 activations and master weights")
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    fc1 = 2 * m.ffn_size if m.gated_mlp else m.ffn_size
    dims = [(f"{FLAG.hidden_size} {m.hidden_size}", m.hidden_size),
            (f"the query/key/value projection's {m.query_size + 2 * m.query_groups * m.head_dim} outputs / TP {tp}",
             (m.query_size + 2 * m.query_groups * m.head_dim) // tp),
            (f"the query width {m.query_size} (heads x head dimension) / TP {tp}", m.query_size // tp),
            (f"the MLP's first {fc1} outputs / TP {tp}", fc1 // tp),
            (f"{FLAG.ffn_hidden_size} {m.ffn_size} / TP {tp}", m.ffn_size // tp),
            (f"{FLAG.micro_batch_size} {t.micro_batch_size} x {FLAG.seq_length} {m.seq_length}"
             + (f" / {FLAG.context_parallel_size} {cp}" if cp > 1 else "") + " tokens",
             t.micro_batch_size * m.seq_length // cp)]
    for what, value in dims:
        _require(value % FP8_MULTIPLE == 0,
                 f"{FLAG.fp8_format} needs every dimension of the FP8 matrix products to be a multiple of "
                 f"{FP8_MULTIPLE}: {what} = {value} is not")


def _check_fp8_param_gather(cfg: MegaliteConfig, dims: ParallelDims) -> None:
    """--fp8-param-gather is the distributed optimizer's or ZeRO-3's parameter gather in FP8, one scale a weight."""
    m, o = cfg.model, cfg.optimizer
    if not m.fp8_param_gather:
        return
    _require(m.fp8_recipe != "rowwise",
             f"{FLAG.fp8_param_gather} needs {FLAG.fp8_recipe} tensorwise or delayed: rowwise scales a weight per row "
             f"forward and per column backward, so no one FP8 copy serves both")
    if o.zero_level == 3:
        _require(not o.offload_params, f"{FLAG.fp8_param_gather} does not take {FLAG.offload_params}")
        # FSDP2 moves an FP8 weight's shard to new storage when its rows do not split evenly.
        tp, replicas = dims.tp, dims.dp_cp
        fc1 = 2 * m.ffn_size if m.gated_mlp else m.ffn_size
        for what, rows in [(f"the query/key/value projection's {m.query_size + 2 * m.query_groups * m.head_dim} "
                            f"rows / TP {tp}", (m.query_size + 2 * m.query_groups * m.head_dim) // tp),
                           (f"the MLP's first {fc1} rows / TP {tp}", fc1 // tp),
                           (f"{FLAG.hidden_size} {m.hidden_size}", m.hidden_size)]:
            _require(rows % replicas == 0,
                     f"{FLAG.fp8_param_gather} with {FLAG.zero_stage} 3 needs each FP8 weight's rows to split evenly "
                     f"over the {replicas} data-parallel ranks: {what} = {rows} does not")
        return
    _require(o.use_distributed_optimizer,
             f"{FLAG.fp8_param_gather} needs {FLAG.use_distributed_optimizer} or {FLAG.zero_stage} 3: it is their "
             f"parameter all-gather that travels in FP8")


def _check_context_parallel(cfg: MegaliteConfig) -> None:
    """The sequence splits into the chunks the comm type needs, a2a's heads split over CP, and no option that the
    context-parallel attention does not honour."""
    m, p, k = cfg.model, cfg.parallel, cfg.kernels
    cp, tp, kind = p.context_parallel_size, p.tensor_model_parallel_size, p.cp_comm_type
    _one_of("cp_comm_type", kind, ("p2p", "a2a", "allgather", "a2a+p2p"))
    levels = p.hierarchical_context_parallel()
    _require(levels is None or kind == "a2a+p2p",
             f"{FLAG.hierarchical_context_parallel_sizes} applies to {FLAG.cp_comm_type} a2a+p2p")
    if kind == "a2a+p2p":
        _require(levels is not None, f"{FLAG.cp_comm_type} a2a+p2p needs {FLAG.hierarchical_context_parallel_sizes} "
                                     f"A2A P2P (e.g. 2 {max(cp // 2, 1)})")
        _require(levels[0] * levels[1] == cp and min(levels) > 1,
                 f"{FLAG.hierarchical_context_parallel_sizes} {levels[0]} {levels[1]} must be two sizes > 1 whose "
                 f"product is {FLAG.context_parallel_size} {cp}")
    if cp == 1:
        return
    _require(m.softmax_type == "vanilla",
             f"{FLAG.softmax_type} {m.softmax_type} is not supported with {FLAG.context_parallel_size} {cp} (the "
             f"context-parallel attention has no sink)")
    chunks = cp if kind == "a2a" else 2 * cp   # a2a: contiguous shards; p2p and allgather: the load-balanced halves
    _require(m.seq_length % chunks == 0,
             f"{FLAG.seq_length} {m.seq_length} is not divisible by " +
             (f"{FLAG.context_parallel_size} {cp}" if kind == "a2a" else
              f"2 x {FLAG.context_parallel_size} {cp} = {chunks} (with {FLAG.cp_comm_type} {kind} each rank holds "
              f"two chunks of the sequence, for causal load balance)"))
    if kind in ("a2a", "a2a+p2p"):
        heads, over = m.num_attention_heads // tp, cp if kind == "a2a" else levels[0]
        where = (f"{FLAG.context_parallel_size} {cp}" if kind == "a2a" else
                 f"the a2a level's {over} ranks ({FLAG.hierarchical_context_parallel_sizes})")
        _require(heads % over == 0,
                 f"{FLAG.cp_comm_type} {kind} splits each tensor-parallel rank's {heads} attention heads "
                 f"({FLAG.num_attention_heads} {m.num_attention_heads} / {FLAG.tensor_model_parallel_size} {tp}) over "
                 f"{where}, which does not divide them: use p2p or allgather")
    if kind in ("p2p", "a2a+p2p"):
        _require(m.attention_dropout == 0.0,
                 f"{FLAG.cp_comm_type} {kind} computes attention blockwise without dropout: set "
                 f"{FLAG.attention_dropout} 0 (or use {FLAG.cp_comm_type} a2a or allgather)")
    _require(k.use_fused_kernels != "on" or k.no_masked_softmax_fusion,
             f"{FLAG.use_fused_kernels} on replaces the attention core by the fused causal softmax, which context "
             f"parallelism does not use: add {FLAG.no_masked_softmax_fusion}")


def _check_experts(cfg: MegaliteConfig, dims: ParallelDims) -> None:
    """Mixture of experts: the router's choices, the experts' split over EP (carved from DP x CP) and over TP, and
    capacity (token dropping) only where the dispatcher honours it."""
    m, p = cfg.model, cfg.parallel
    tp, ep, etp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_tensor_parallel_size
    _at_least(1, [("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)])
    if m.num_experts is None:
        defaults = ModelConfig()
        given = [getattr(FLAG, f.name) for f in dataclasses.fields(ModelConfig)
                 if f.name.startswith("moe_") and getattr(m, f.name) != getattr(defaults, f.name)]
        given += [getattr(FLAG, name) for name, value in [("expert_model_parallel_size", ep != 1),
                                                           ("expert_tensor_parallel_size", etp is not None)] if value]
        _require(not given, f"{given[0] if given else ''} needs {FLAG.num_experts} (a mixture-of-experts model)")
        return
    _require(not m.gated_linear_unit, f"{FLAG.gated_linear_unit} is not supported with {FLAG.num_experts} (the "
                                      f"experts are SwiGLU or GeLU MLPs)")
    experts, k = m.num_experts, m.moe_router_topk
    _at_least(1, [("num_experts", experts), ("moe_router_topk", k), ("moe_ffn_hidden_size", m.moe_ffn_hidden_size),
                  ("moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size)])
    _require(k <= experts, f"{FLAG.moe_router_topk} {k} is more than {FLAG.num_experts} {experts}")
    m.moe_layers()   # raises on a bad --moe-layer-freq
    _one_of("moe_router_score_function", m.moe_router_score_function, ("softmax", "sigmoid"))
    _one_of("moe_router_load_balancing_type", m.moe_router_load_balancing_type, ("aux_loss", "seq_aux_loss", "none"))
    _one_of("moe_token_drop_policy", m.moe_token_drop_policy, ("probs", "position"))
    _one_of("moe_token_dispatcher_type", m.moe_token_dispatcher_type, ("alltoall", "allgather"))
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        value = getattr(m, name)
        _require(value is None or value >= 0, f"{getattr(FLAG, name)} must be >= 0, got {value}")
    for name in ("moe_router_topk_scaling_factor", "moe_expert_capacity_factor", "moe_router_bias_update_rate"):
        value = getattr(m, name)
        _require(value is None or value > 0, f"{getattr(FLAG, name)} must be > 0, got {value}")
    _require(not m.moe_router_pre_softmax or m.moe_router_score_function == "softmax",
             f"{FLAG.moe_router_pre_softmax} applies to {FLAG.moe_router_score_function} softmax")
    _require(not m.moe_router_enable_expert_bias or m.moe_router_score_function == "sigmoid",
             f"{FLAG.moe_router_enable_expert_bias} biases sigmoid scores: it needs "
             f"{FLAG.moe_router_score_function} sigmoid")
    _check_group_limited_routing(m)
    _require(not m.moe_shared_expert_gate or m.moe_shared_expert_intermediate_size is not None,
             f"{FLAG.moe_shared_expert_gate} needs {FLAG.moe_shared_expert_intermediate_size}")
    _require(m.moe_expert_capacity_factor is None or m.moe_token_dispatcher_type == "alltoall",
             f"{FLAG.moe_expert_capacity_factor} (token dropping) needs {FLAG.moe_token_dispatcher_type} alltoall")
    replicas = dims.dp_cp
    _require(experts % ep == 0, f"{FLAG.num_experts} {experts} is not divisible by "
                                f"{FLAG.expert_model_parallel_size} {ep}")
    _require(replicas % ep == 0,
             f"{FLAG.expert_model_parallel_size} {ep} does not divide the data-parallel x context-parallel size "
             f"{replicas} (expert-parallel ranks are carved from them)")
    _require(etp in (None, tp, 1), f"{FLAG.expert_tensor_parallel_size} {etp} must be "
                                   f"{FLAG.tensor_model_parallel_size} {tp} or 1")
    experts_tp = dims.expert_tp
    _require(m.expert_ffn_size % experts_tp == 0,
             f"the experts' hidden size {m.expert_ffn_size} is not divisible by the expert tensor-parallel size "
             f"{experts_tp}")
    shared = m.moe_shared_expert_intermediate_size
    _require(shared is None or shared % tp == 0,
             f"{FLAG.moe_shared_expert_intermediate_size} {shared} is not divisible by "
             f"{FLAG.tensor_model_parallel_size} {tp}")
    _require(cfg.optimizer.zero_stage != 3 or dims.expert_dp > 1,
             f"{FLAG.zero_stage} 3 shards expert parameters over the ranks holding the same experts, and "
             f"{FLAG.expert_model_parallel_size} {ep} leaves none (data-parallel x context-parallel size {replicas})")


def _check_group_limited_routing(m: ModelConfig) -> None:
    """Groups of whole experts, enough eligible experts for the top k, and at least one expert scoring each group."""
    groups, chosen, k = m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk
    _require((groups is None) == (chosen is None),
             f"{FLAG.moe_router_num_groups} and {FLAG.moe_router_group_topk} go together (group-limited routing)")
    if groups is None:
        return
    _at_least(1, [("moe_router_num_groups", groups), ("moe_router_group_topk", chosen)])
    _require(m.num_experts % groups == 0,
             f"{FLAG.num_experts} {m.num_experts} is not divisible by {FLAG.moe_router_num_groups} {groups}")
    _require(chosen <= groups, f"{FLAG.moe_router_group_topk} {chosen} is more than {FLAG.moe_router_num_groups} "
                               f"{groups}")
    eligible = chosen * (m.num_experts // groups)
    _require(k <= eligible, f"{FLAG.moe_router_topk} {k} is more than the {eligible} experts of "
                            f"{FLAG.moe_router_group_topk} {chosen} groups of {m.num_experts // groups}")
    _require(k >= chosen, f"{FLAG.moe_router_topk} {k} is less than {FLAG.moe_router_group_topk} {chosen} (a group "
                          f"is scored by the sum of its top k / group-topk experts)")


def _check_optimizer(cfg: MegaliteConfig, dims: ParallelDims) -> None:
    o, t = cfg.optimizer, cfg.training
    _one_of("lr_decay_style", o.lr_decay_style, ("cosine", "linear", "constant"))
    _require(o.lr >= 0 and o.min_lr >= 0 and o.min_lr <= o.lr,
             f"need 0 <= {FLAG.min_lr} <= {FLAG.lr}, got {FLAG.lr} {o.lr} and {FLAG.min_lr} {o.min_lr}")
    _at_least(0, [("lr_warmup_iters", o.lr_warmup_iters), ("lr_decay_iters", o.lr_decay_iters),
                  ("clip_grad", o.clip_grad)])
    if o.decoupled_lr is not None or o.decoupled_min_lr is not None:
        _require(o.decoupled_lr is not None, f"{FLAG.decoupled_min_lr} needs {FLAG.decoupled_lr}")
        floor = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
        _require(0 <= floor <= o.decoupled_lr,
                 f"need 0 <= {FLAG.decoupled_min_lr} <= {FLAG.decoupled_lr}, got {o.decoupled_lr} and {floor}"
                 + ("" if o.decoupled_min_lr is not None else f" (the default, {FLAG.min_lr})"))
    _require(not o.grad_reduce_in_bf16 or t.bf16,
             f"{FLAG.grad_reduce_in_bf16} needs {FLAG.bf16} (gradients are kept in the parameters' dtype)")
    _require(0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1,
             f"{FLAG.adam_beta1} and {FLAG.adam_beta2} must be in [0, 1), got {o.adam_beta1}, {o.adam_beta2}")
    # Adam divides by sqrt(second moment) + eps: with eps 0, a parameter whose gradients are all zero steps by 0/0.
    _require(o.adam_eps > 0, f"{FLAG.adam_eps} must be > 0, got {o.adam_eps}")
    _at_least(0, [("weight_decay", o.weight_decay)])
    _require(not (t.bf16 and t.fp16), f"{FLAG.bf16} and {FLAG.fp16} exclude each other")
    _one_of("zero_stage", o.zero_stage, (1, 2, 3))
    _check_muon(o)
    _require(o.zero_stage != 2 or o.use_distributed_optimizer,
             f"{FLAG.zero_stage} 2 needs {FLAG.use_distributed_optimizer}")
    _require(not o.overlap_param_gather or o.use_distributed_optimizer,
             f"{FLAG.overlap_param_gather} needs {FLAG.use_distributed_optimizer}")
    if o.zero_stage == 3:
        _check_fully_sharded(cfg, dims)
    _require(not o.offload_params or o.zero_stage == 3, f"{FLAG.offload_params} needs {FLAG.zero_stage} 3")
    _require(not o.offload_params or o.optimizer_cpu_offload,
             f"{FLAG.offload_params} needs {FLAG.optimizer_cpu_offload}: offloaded parameter shards are stepped on "
             f"the CPU")
    _require(o.zero3_prefetch_bucket_size is None or o.zero_stage == 3,
             f"{FLAG.zero3_prefetch_bucket_size} needs {FLAG.zero_stage} 3")
    _at_least(1, [("ddp_bucket_size", o.ddp_bucket_size), ("zero3_prefetch_bucket_size", o.zero3_prefetch_bucket_size),
                  ("loss_scale_window", o.loss_scale_window),
                  ("hysteresis", o.hysteresis)])
    _require(o.loss_scale is None or t.fp16, f"{FLAG.loss_scale} applies to {FLAG.fp16} only")
    _require(o.loss_scale is None or o.loss_scale > 0, f"{FLAG.loss_scale} must be > 0, got {o.loss_scale}")
    _require(0 < o.min_loss_scale <= o.initial_loss_scale,
             f"need 0 < {FLAG.min_loss_scale} <= {FLAG.initial_loss_scale}, got {o.min_loss_scale} and "
             f"{o.initial_loss_scale}")


def _check_instances(cfg: MegaliteConfig, dims: ParallelDims) -> None:
    """HSDP (--num-distributed-optimizer-instances N > 1; N dividing DP x CP is ParallelDims' rule): something
    sharded to replicate, and what does not split into instances yet refused."""
    n, flag, o = dims.instances, FLAG.num_distributed_optimizer_instances, cfg.optimizer
    if n == 1:
        return
    _require(o.zero_level > 0, f"{flag} {n} needs {FLAG.use_distributed_optimizer} or {FLAG.zero_stage} 3: the "
                               f"instances shard optimizer states, which plain data parallelism does not")
    _require(o.zero_level != 3 or dims.shard_dp > 1,
             f"{flag} {n} with {FLAG.zero_stage} 3 leaves one rank per instance (data-parallel x context-parallel "
             f"size {dims.dp_cp}): nothing to shard")
    _require(cfg.model.num_experts is None, f"{flag} {n} does not split the expert-data-parallel group into "
                                            f"instances yet: not with {FLAG.num_experts}")
    _require(not cfg.model.fp8_param_gather, f"{flag} {n} does not run with {FLAG.fp8_param_gather} yet")
    _require(o.optimizer != "muon" or o.zero_level != 3,
             f"{flag} {n} with {FLAG.zero_stage} 3 does not run with {FLAG.optimizer} muon yet (its matrices are "
             f"owned over a one-dimensional data-parallel mesh)")


def _check_muon(o: OptimizerConfig) -> None:
    _one_of("optimizer", o.optimizer, ("adam", "muon"))
    _one_of("muon_scale_mode", o.muon_scale_mode, ("spectral", "shape_scaling", "unit_rms_norm"))
    _one_of("muon_tp_mode", o.muon_tp_mode, ("duplicated", "distributed", "blockwise"))
    _require(0 <= o.muon_momentum < 1, f"{FLAG.muon_momentum} must be in [0, 1), got {o.muon_momentum}")
    _at_least(1, [("muon_num_ns_steps", o.muon_num_ns_steps)])
    _require(o.muon_extra_scale_factor > 0,
             f"{FLAG.muon_extra_scale_factor} must be > 0, got {o.muon_extra_scale_factor}")
    if o.optimizer != "muon":
        return
    _require(not o.optimizer_cpu_offload,
             f"{FLAG.optimizer} muon does not run with {FLAG.optimizer_cpu_offload} (the CPU optimizer is AdamW only)")


def _check_fully_sharded(cfg: MegaliteConfig, dims: ParallelDims) -> None:
    """ZeRO-3 runs on FSDP2, which owns gradient reduction and parameter gathering: the options of our own
    data-parallel engine do not apply, and there must be data-parallel ranks to shard over."""
    o = cfg.optimizer
    _require(not o.use_distributed_optimizer,
             f"{FLAG.zero_stage} 3 shards the optimizer itself (FSDP2): drop {FLAG.use_distributed_optimizer}")
    for name, value in [("overlap_grad_reduce", o.overlap_grad_reduce),
                        ("overlap_param_gather", o.overlap_param_gather)]:
        _require(not value, f"{getattr(FLAG, name)} is for stages 1-2: with {FLAG.zero_stage} 3, FSDP2 overlaps its "
                            f"own reductions and gathers")
    _require(dims.dp_cp > 1,   # the parameters are sharded over DP x CP
             f"{FLAG.zero_stage} 3 shards over data-parallel ranks and this layout has none "
             f"(data-parallel size 1); for CPU offload on one data-parallel rank use {FLAG.optimizer_cpu_offload}")


def _check_checkpoint(cfg: MegaliteConfig) -> None:
    """The checkpoint options alone (the checkpoint itself is checked by megalite.checkpoint.check_checkpoint)."""
    c = cfg.checkpoint
    _at_least(1, [("save_interval", c.save_interval)])
    _require(c.save_interval is None or c.save is not None, f"{FLAG.save_interval} needs {FLAG.save}")
    _require(not c.finetune or c.load is not None, f"{FLAG.finetune} needs {FLAG.load}")
    _require(not c.use_checkpoint_args or c.load is not None, f"{FLAG.use_checkpoint_args} needs {FLAG.load}")
    _require(not c.async_save or c.save is not None, f"{FLAG.async_save} needs {FLAG.save}")
    _require(not c.break_save_lock or c.save is not None, f"{FLAG.break_save_lock} needs {FLAG.save}")
    _require(not c.override_newer_checkpoint or c.save is not None,
             f"{FLAG.override_newer_checkpoint} needs {FLAG.save}")


def _check_kernels(cfg: MegaliteConfig) -> None:
    """The fused-kernel mode; ``on`` needs a GPU here (whether the extension builds is checked when the model is)."""
    mode = cfg.kernels.use_fused_kernels
    _one_of("use_fused_kernels", mode, ("auto", "on", "off"))
    if mode == "on":
        import torch   # noqa: PLC0415 - only here: checking the other options needs no torch

        _require(torch.cuda.is_available(),
                 f"{FLAG.use_fused_kernels} on needs a CUDA device and none is visible: use auto (fused kernels "
                 f"where there is a GPU, torch ops elsewhere) or off")
    if cfg.kernels.torch_compile:
        import torch._dynamo   # noqa: PLC0415 - as above

        _require(mode != "on", f"{FLAG.use_fused_kernels} on would swap the attention core for a fused kernel, which "
                               f"{FLAG.torch_compile} cannot trace: use auto (the compiler fuses the layers' ops)")
        _require(cfg.parallel.pipeline_schedule == "1f1b",
                 f"{FLAG.torch_compile} compiles each layer's backward whole, and {FLAG.pipeline_schedule} "
                 f"{cfg.parallel.pipeline_schedule} defers its weight gradients out of it: use 1f1b")
        backends = torch._dynamo.list_backends(exclude_tags=())
        _require(cfg.kernels.torch_compile_backend in backends,
                 f"{FLAG.torch_compile_backend} {cfg.kernels.torch_compile_backend} is not a torch.compile backend; "
                 f"one of: {', '.join(backends)}")


def _check_megatron_tokenizer(cfg: MegaliteConfig) -> None:
    """Megatron's tokenizer names (megalite.data.tokenizer): each reads --tokenizer-model; TikTokenizer a pattern."""
    d = cfg.data
    _require(d.tokenizer_type not in MEGATRON_TOKENIZERS or d.mock_data or d.tokenizer_model is not None,
             f"{FLAG.tokenizer_type} {d.tokenizer_type} needs {FLAG.tokenizer_model}")
    _one_of("tiktoken_pattern", d.tiktoken_pattern, (None, "v1", "v2"))
    _at_least(3, [("tiktoken_num_special_tokens", d.tiktoken_num_special_tokens)])
    if d.tokenizer_type == "TikTokenizer" and not d.mock_data:
        _require(d.tiktoken_pattern is not None, f"{FLAG.tokenizer_type} TikTokenizer needs {FLAG.tiktoken_pattern} "
                                                 f"v1 or v2")


def _check_logging(cfg: MegaliteConfig, world_size: int) -> None:
    """Profiling, Weights & Biases, and the memory-housekeeping options."""
    g, t = cfg.logging, cfg.training
    _at_least(0, [("profile_step_start", g.profile_step_start), ("manual_gc_interval", t.manual_gc_interval)])
    _one_of("empty_unused_memory_level", t.empty_unused_memory_level, (0, 1, 2))
    if g.profile:
        _require(g.profile_step_end > g.profile_step_start,
                 f"{FLAG.profile_step_end} {g.profile_step_end} must be greater than {FLAG.profile_step_start} "
                 f"{g.profile_step_start}")
    try:
        ranks = g.profile_rank_list()
    except ValueError:
        ranks = [-1]
    _require(all(0 <= r < world_size for r in ranks),
             f"{FLAG.profile_ranks} {g.profile_ranks!r} must be ranks in [0, {world_size})")
    for name in ("wandb_exp_name", "wandb_save_dir"):
        _require(getattr(g, name) is None or g.wandb_project is not None,
                 f"{getattr(FLAG, name)} needs {FLAG.wandb_project}")


def _check_data(cfg: MegaliteConfig) -> None:
    """The data options alone (no file is opened here: megalite.data.check_data_files does that)."""
    d = cfg.data
    d.split_fractions()
    _one_of("tokenizer_type", d.tokenizer_type, TOKENIZER_TYPES)
    _check_megatron_tokenizer(cfg)
    _at_least(0, [("eval_interval", d.eval_interval), ("eval_iters", d.eval_iters)])
    _require(not d.sft or d.data_path is not None,
             f"{FLAG.sft} needs {FLAG.data_path} (the conversations: JSONL, Parquet, Arrow, a datasets directory "
             f"or a prefix from tools/preprocess_data.py --sft)")
    if d.mock_data:
        _require(d.data_path is None, f"{FLAG.mock_data} and {FLAG.data_path} exclude each other")
        packing = [getattr(FLAG, name) for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
                   if getattr(d, name)]
        _require(not packing, f"{'/'.join(packing)} need documents, which {FLAG.mock_data} does not have (its "
                              f"samples hold no end-of-document token)")
        return
    if d.data_path is None:  # the built-in corpus, which brings its own tokenizer
        _require(not d.tokenizer_given(),
                 f"{FLAG.tokenizer_type}/{FLAG.tokenizer_model}/{FLAG.vocab_file}/{FLAG.merge_file} need "
                 f"{FLAG.data_path} (the built-in corpus has its own tokenizer)")
        return
    d.blend()
    if not d.tokenizer_given():
        _require(cfg.checkpoint.load is not None,
                 f"{FLAG.data_path} needs {FLAG.tokenizer_model} (or {FLAG.tokenizer_type} NullTokenizer, or a "
                 f"{FLAG.load} checkpoint that holds a tokenizer)")
        return
    files = {"SentencePieceTokenizer": ["tokenizer_model"], "HuggingFaceTokenizer": ["tokenizer_model"],
             "GPT2BPETokenizer": ["vocab_file", "merge_file"]}.get(d.tokenizer_type, [])
    for name in files:
        _require(getattr(d, name) is not None, f"{FLAG.tokenizer_type} {d.tokenizer_type} needs {getattr(FLAG, name)}")
