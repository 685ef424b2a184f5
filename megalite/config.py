"""Typed configuration: the one source of truth for every option.

Each option is one dataclass field whose ``help`` metadata is its one-line docstring. The Megatron-style flag
(``--tensor-model-parallel-size``) is derived from the field name by ``megalite.cli``, and the Hydra key
(``parallel.tensor_model_parallel_size``) is the section name plus the field name, so neither is written twice.

Cross-field rules live in :func:`validate`, which runs before any process group exists so that a bad layout fails
on every rank with one line instead of hanging in a collective.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Optional


class ConfigError(ValueError):
    """A bad option value or combination; reported as one line on every rank, exit code 2."""


def option(default, help: str, **kwargs):
    """A dataclass field with its one-line description (shown by ``--help``)."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


@dataclass
class ModelConfig:
    num_layers: int = option(4, "Number of transformer layers.")
    hidden_size: int = option(128, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = option(None, "MLP hidden size; default 4 x hidden size.")
    num_attention_heads: int = option(4, "Number of attention heads.")
    seq_length: int = option(64, "Tokens per training sample.")
    max_position_embeddings: Optional[int] = option(None, "Size of the position table; default seq length.")
    vocab_size: int = option(1000, "Vocabulary size (of the tokenizer, or of the mock data).")
    make_vocab_size_divisible_by: int = option(
        128, "Pad the vocabulary to a multiple of this times the tensor-parallel size.")
    init_method_std: float = option(0.02, "Std of the normal initialization of weights.")
    hidden_dropout: float = option(0.1, "Dropout after attention/MLP outputs and on embeddings.")
    attention_dropout: float = option(0.1, "Dropout on attention probabilities.")
    layernorm_epsilon: float = option(1e-5, "Epsilon of the LayerNorms.")
    untie_embeddings_and_output_weights: bool = option(
        False, "Give the output layer its own weight instead of reusing the word embedding.")
    position_embedding_type: str = option(
        "learned_absolute", "learned_absolute (a learned position table added to the embeddings) or rope (rotary "
                            "embeddings applied to queries and keys in every layer, rotate-half convention).")
    rotary_base: int = option(10000, "With rope: base of the rotary frequencies (Llama 2: 10000, Llama 3: 500000).")
    normalization: str = option("LayerNorm", "LayerNorm or RMSNorm (a learned scale only: no bias, no centering).")
    swiglu: bool = option(
        False, "SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up each of --ffn-hidden-size (Llama's MLP).")
    group_query_attention: bool = option(
        False, "Grouped-query attention: the query heads share --num-query-groups key/value heads.")
    num_query_groups: int = option(1, "With --group-query-attention: number of key/value heads (1: multi-query).")
    disable_bias_linear: bool = option(False, "No biases in the attention and MLP linear layers.")
    recompute_granularity: Optional[str] = option(
        None, "Activation recompute: full (keep each recomputed group's input only, rerun it in backward) or "
              "selective (rerun only the attention core: softmax, dropout and the two attention products).")
    recompute_method: Optional[str] = option(
        None, "With full recompute: uniform (every model chunk's layers in groups of --recompute-num-layers) or block "
              "(only the first --recompute-num-layers layers of each model chunk, one by one).")
    recompute_num_layers: int = option(
        1, "With full recompute: layers per recomputed group (uniform) or recomputed layers per chunk (block).")

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Number of key/value heads: num_query_groups with grouped-query attention, else one per query head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by x TP (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = option(1, "Tensor-parallel size (ranks splitting each layer's matrices).")
    pipeline_model_parallel_size: int = option(1, "Pipeline-parallel size (ranks splitting the layer stack).")
    sequence_parallel: bool = option(
        False, "Split norms, dropout and the residual stream along the sequence over the tensor-parallel ranks "
               "(activation memory / TP there too; needs TP > 1).")
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, "Layers per model chunk for the interleaved schedule (alternative to the next option).")
    num_virtual_stages_per_pipeline_rank: Optional[int] = option(
        None, "Model chunks per pipeline rank (V); V > 1 selects the interleaved 1F1B schedule.")

    def virtual_stages(self, num_layers: int) -> int:
        """V, the number of model chunks per pipeline rank (1 unless an interleaving option is set)."""
        if self.num_virtual_stages_per_pipeline_rank is not None:
            return self.num_virtual_stages_per_pipeline_rank
        if self.num_layers_per_virtual_pipeline_stage is not None:
            return num_layers // (self.num_layers_per_virtual_pipeline_stage * self.pipeline_model_parallel_size)
        return 1


@dataclass
class OptimizerConfig:
    lr: float = option(3e-4, "Peak learning rate.")
    min_lr: float = option(0.0, "Learning rate at the end of the decay.")
    lr_decay_style: str = option("cosine", "Decay after warm-up: cosine, linear or constant.")
    lr_warmup_iters: int = option(0, "Iterations of linear warm-up from 0 to lr.")
    lr_decay_iters: Optional[int] = option(None, "Iteration at which the decay reaches min_lr; default train iters.")
    weight_decay: float = option(0.01, "AdamW weight decay (not applied to biases and norm weights).")
    clip_grad: float = option(1.0, "Clip gradients to this global L2 norm; 0 disables clipping.")
    adam_beta1: float = option(0.9, "Adam beta1.")
    adam_beta2: float = option(0.999, "Adam beta2.")
    adam_eps: float = option(1e-8, "Adam epsilon.")
    use_distributed_optimizer: bool = option(
        False, "Shard fp32 main parameters and Adam states over data-parallel ranks (ZeRO-1; see zero_stage).")
    zero_stage: int = option(
        1, "ZeRO stage. With --use-distributed-optimizer: 1 shards optimizer states, 2 also keeps only this rank's "
           "gradient shard. 3 (on its own) shards parameters, gradients and optimizer states over the data-parallel "
           "ranks with PyTorch FSDP2, gathering each layer's parameters just for its forward and backward.")
    overlap_grad_reduce: bool = option(
        False, "Start each gradient bucket's reduction as soon as backward has produced all of its gradients.")
    overlap_param_gather: bool = option(
        False, "With the distributed optimizer: gather updated parameters asynchronously, waiting only when the "
               "next forward needs them.")
    ddp_bucket_size: Optional[int] = option(
        None, "Elements per gradient-reduction bucket; default max(40M, 1M x data-parallel size).")
    optimizer_cpu_offload: bool = option(
        False, "Keep fp32 main parameters and Adam states on the CPU and step them there (fused C++ Adam).")
    offload_params: bool = option(
        False, "With --zero-stage 3 and --optimizer-cpu-offload: keep the parameter and gradient shards on the CPU "
               "too, copying each layer's shard to the device only to gather it (FSDP2's CPUOffloadPolicy).")
    loss_scale: Optional[float] = option(None, "With --fp16: a constant loss scale instead of dynamic scaling.")
    initial_loss_scale: float = option(2.0**32, "With --fp16: the starting dynamic loss scale.")
    min_loss_scale: float = option(1.0, "With --fp16: the dynamic loss scale never goes below this.")
    loss_scale_window: int = option(1000, "With --fp16: steps without overflow before the scale doubles.")
    hysteresis: int = option(2, "With --fp16: overflowing steps tolerated before the scale halves.")


@dataclass
class DataConfig:
    mock_data: bool = option(False, "Train on deterministic synthetic sequences (no data files needed).")
    data_path: Optional[str] = option(
        None, "Dataset prefixes (PREFIX.bin + PREFIX.idx), or weighted 'W1 PREFIX1 W2 PREFIX2 ...' blended by weight; "
              "default: the built-in corpus (the Python standard library's sources, built once and cached).",
        nargs="+", metavar="[WEIGHT] PREFIX")
    split: str = option("969,30,1", "Train,valid,test proportions of each dataset's documents.")
    data_cache_path: Optional[str] = option(
        None, "Directory for the cached sample/shuffle/blending indices; default megalite-cache/ beside the data.")
    tokenizer_type: str = option(
        "SentencePieceTokenizer", "SentencePieceTokenizer (needs --tokenizer-model) or NullTokenizer (token ids "
                                  "below --vocab-size, EOD = vocab size - 1).")
    tokenizer_model: Optional[str] = option(None, "SentencePiece model file of the data given by --data-path.")
    eval_interval: int = option(1000, "Compute the validation loss every this many iterations; 0 disables it.")
    eval_iters: int = option(100, "Global batches per validation-loss evaluation.")

    def blend(self) -> tuple[list[str], Optional[list[float]]]:
        """(prefixes, weights) of data_path: 'A B' -> ([A, B], None), '0.3 A 0.7 B' -> ([A, B], [0.3, 0.7])."""
        words = (self.data_path or "").split()
        if not words:
            raise ConfigError("--data-path is empty")
        try:
            float(words[0])
        except ValueError:  # the first word is a prefix: no weights
            return words, None
        if len(words) % 2:
            raise ConfigError(f"--data-path {self.data_path!r}: weights and prefixes must come in pairs")
        weights, prefixes = words[0::2], words[1::2]
        try:
            values = [float(w) for w in weights]
        except ValueError as error:
            raise ConfigError(f"--data-path {self.data_path!r}: bad weight ({error})") from None
        if any(not math.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
            raise ConfigError(f"--data-path {self.data_path!r}: weights must be >= 0 with a positive sum")
        return prefixes, values

    def split_fractions(self) -> list[float]:
        """The three split proportions normalized to sum 1 ('99,1' means '99,1,0'; '/' separates like ',')."""
        try:
            parts = [float(x) for x in self.split.replace("/", ",").split(",")]
        except ValueError:
            parts = []
        if not 1 <= len(parts) <= 3 or any(not math.isfinite(x) or x < 0 for x in parts) or sum(parts) <= 0:
            raise ConfigError(f"--split {self.split!r} must be up to three proportions >= 0 with a positive sum, "
                              f"e.g. 969,30,1")
        parts += [0.0] * (3 - len(parts))
        return [x / sum(parts) for x in parts]


@dataclass
class TrainingConfig:
    micro_batch_size: int = option(2, "Samples per micro-batch on one data-parallel rank.")
    global_batch_size: int = option(8, "Samples per optimizer step over all data-parallel ranks.")
    train_iters: int = option(20, "Number of optimizer steps.")
    seed: int = option(1234, "Seed for initialization, data order and dropout.")
    bf16: bool = option(False, "bfloat16 parameters and compute; fp32 gradients, main parameters and Adam states.")
    fp16: bool = option(False, "float16 parameters and compute with loss scaling; fp32 gradients and main parameters.")
    distributed_timeout_minutes: float = option(
        10.0, "A collective waiting longer than this (a dead or stalled rank) fails with an error instead of hanging.")
    exit_signal_handler: bool = option(
        False, "On SIGTERM (what cluster schedulers send), every rank saves a checkpoint (with --save) and exits 0.")
    exit_interval: Optional[int] = option(
        None, "Stop cleanly (after a checkpoint, with --save) once the iteration is a multiple of this.")
    exit_duration_in_mins: Optional[float] = option(
        None, "Stop cleanly (after a checkpoint, with --save) once training has run this many minutes.")
    no_check_for_nan_in_loss_and_grad: bool = option(
        False, "Do not stop on a NaN/Inf loss or gradient (by default training stops naming the iteration and "
               "ranks; with --fp16 such a step is skipped instead).")
    deepspeed_config: Optional[str] = option(
        None, "A DeepSpeed JSON config (batch sizes, ZeRO stage and offload, bf16/fp16, clipping, Adam, LR "
              "scheduler) mapped onto megalite's options; flags and overrides given beside it win; keys megalite "
              "cannot honour are refused by name (see docs/zero_and_deepspeed.md).")
    dry_run: bool = option(
        False, "Print the planner's per-GPU memory estimate for this layout (weights, gradients, optimizer states, "
               "activations of each pipeline stage) and exit without training.")


@dataclass
class LoggingConfig:
    log_interval: int = option(1, "Print (and record) metrics every this many iterations.")
    metrics_file: Optional[str] = option(None, "Rank 0 appends one JSON object per logged iteration to this file.")
    tensorboard_dir: Optional[str] = option(None, "Write TensorBoard scalars to this directory (rank 0).")
    timing_log_level: int = option(
        0, "Per-phase timers in the log and metrics (min/max over ranks): 0 none, 1 forward-backward, gradient "
           "reduction and optimizer step, 2 also the pipeline's wait for its neighbours.")
    peak_tflops: Optional[float] = option(
        None, "The device's peak TFLOP/s for MFU; default: known for A100/H100/H200 (bf16 dense), else no MFU.")


@dataclass
class CheckpointConfig:
    save: Optional[str] = option(
        None, "Write checkpoints to this directory (one subdirectory per saved iteration; each rank writes its own "
              "shards).")
    save_interval: Optional[int] = option(
        None, "With --save: save every this many iterations, and at the end; default: only at the end.")
    load: Optional[str] = option(
        None, "Resume from the latest complete checkpoint in this directory (or from this checkpoint directory), "
              "whatever layout it was saved at; a --load equal to --save with nothing saved yet starts afresh.")
    no_load_optim: bool = option(
        False, "With --load: do not restore optimizer state (Adam moments, fp32 main parameters, loss scale).")
    no_load_rng: bool = option(False, "With --load: do not restore the random-number generators' states.")
    finetune: bool = option(
        False, "With --load: load the model weights only and start at iteration 0 (fresh optimizer, data position "
               "and random state).")


@dataclass
class KernelConfig:
    use_fused_kernels: str = option(
        "auto", "auto (fused CUDA kernels for LayerNorm/RMSNorm, bias + GeLU, rotary embeddings and the cross entropy "
                "where the input is on a GPU and the extension builds, torch ops elsewhere), on (also the fused "
                "masked-softmax attention core instead of scaled_dot_product_attention; a failed build is an error) "
                "or off (torch ops only).")
    no_masked_softmax_fusion: bool = option(
        False, "With --use-fused-kernels on: keep scaled_dot_product_attention instead of the fused causal softmax.")
    no_bias_gelu_fusion: bool = option(False, "Add the MLP's first bias and apply GeLU with torch ops, not fused.")
    no_layernorm_fusion: bool = option(False, "Run LayerNorm and RMSNorm with torch ops, not the fused kernels.")
    no_rope_fusion: bool = option(False, "Apply rotary embeddings with torch ops, not the fused kernel.")
    no_cross_entropy_loss_fusion: bool = option(
        False, "Compute the vocab-parallel cross entropy with torch ops, not the fused per-shard kernels (fused by "
               "default here, where Megatron's --cross-entropy-loss-fusion is opt-in).")


@dataclass
class MegaliteConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)


def sections() -> list[tuple[str, type]]:
    """(section name, section dataclass) pairs of MegaliteConfig, in declaration order."""
    hints = typing.get_type_hints(MegaliteConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(MegaliteConfig)]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(cfg: MegaliteConfig, world_size: int) -> None:
    """Check every cross-field rule; raise ConfigError naming the offending values."""
    m, p, o, t = cfg.model, cfg.parallel, cfg.optimizer, cfg.training
    for name, value in [("num-layers", m.num_layers), ("hidden-size", m.hidden_size),
                        ("num-attention-heads", m.num_attention_heads), ("seq-length", m.seq_length),
                        ("vocab-size", m.vocab_size), ("make-vocab-size-divisible-by", m.make_vocab_size_divisible_by),
                        ("tensor-model-parallel-size", p.tensor_model_parallel_size),
                        ("pipeline-model-parallel-size", p.pipeline_model_parallel_size),
                        ("micro-batch-size", t.micro_batch_size), ("global-batch-size", t.global_batch_size),
                        ("log-interval", cfg.logging.log_interval)]:
        _require(value >= 1, f"--{name} must be >= 1, got {value}")
    _require(t.train_iters >= 0, f"--train-iters must be >= 0, got {t.train_iters}")
    _require(cfg.logging.timing_log_level in (0, 1, 2),
             f"--timing-log-level must be 0, 1 or 2, got {cfg.logging.timing_log_level}")
    _require(t.exit_interval is None or t.exit_interval >= 1, f"--exit-interval must be >= 1, got {t.exit_interval}")
    _require(t.exit_duration_in_mins is None or t.exit_duration_in_mins > 0,
             f"--exit-duration-in-mins must be > 0, got {t.exit_duration_in_mins}")
    _require(t.distributed_timeout_minutes > 0,
             f"--distributed-timeout-minutes must be > 0, got {t.distributed_timeout_minutes}")
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by tensor-model-parallel-size {tp} x "
             f"pipeline-model-parallel-size {pp} = {tp * pp}")
    dp = world_size // (tp * pp)
    _check_pipeline(cfg, dp)
    _require(m.hidden_size % m.num_attention_heads == 0,
             f"hidden-size {m.hidden_size} is not divisible by num-attention-heads {m.num_attention_heads}")
    _require(m.num_attention_heads % tp == 0,
             f"num-attention-heads {m.num_attention_heads} is not divisible by tensor-model-parallel-size {tp}")
    _require(m.ffn_size % tp == 0,
             f"ffn-hidden-size {m.ffn_size} is not divisible by tensor-model-parallel-size {tp}")
    _check_architecture(cfg)
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"global-batch-size {t.global_batch_size} is not divisible by micro-batch-size {t.micro_batch_size} x "
             f"data-parallel size {dp} = {t.micro_batch_size * dp}")
    _require(m.max_positions >= m.seq_length,
             f"max-position-embeddings {m.max_positions} is smaller than seq-length {m.seq_length}")
    for name, value in [("hidden-dropout", m.hidden_dropout), ("attention-dropout", m.attention_dropout)]:
        _require(0.0 <= value < 1.0, f"--{name} must be in [0, 1), got {value}")
    _require(o.lr_decay_style in ("cosine", "linear", "constant"),
             f"--lr-decay-style must be cosine, linear or constant, got {o.lr_decay_style!r}")
    _require(o.lr >= 0 and o.min_lr >= 0 and o.min_lr <= o.lr,
             f"need 0 <= min-lr <= lr, got lr {o.lr} and min-lr {o.min_lr}")
    _require(o.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {o.lr_warmup_iters}")
    _require(o.lr_decay_iters is None or o.lr_decay_iters >= 0,
             f"--lr-decay-iters must be >= 0, got {o.lr_decay_iters}")
    _require(o.clip_grad >= 0, f"--clip-grad must be >= 0, got {o.clip_grad}")
    _check_optimizer(cfg, dp)
    _require(0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1,
             f"Adam betas must be in [0, 1), got {o.adam_beta1}, {o.adam_beta2}")
    _check_data(cfg)
    _check_checkpoint(cfg)
    _check_kernels(cfg)


def _check_pipeline(cfg: MegaliteConfig, dp: int) -> None:
    """Layers split evenly over PP x V chunks; the interleaved schedule needs micro-batches in multiples of PP."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    pp, per_chunk, v = (p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage,
                        p.num_virtual_stages_per_pipeline_rank)
    _require(per_chunk is None or per_chunk >= 1,
             f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {per_chunk}")
    _require(v is None or v >= 1, f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {v}")
    if per_chunk is not None:
        _require(m.num_layers % (per_chunk * pp) == 0,
                 f"num-layers {m.num_layers} is not divisible by num-layers-per-virtual-pipeline-stage {per_chunk} "
                 f"x pipeline-model-parallel-size {pp} = {per_chunk * pp}")
        _require(v is None or v * per_chunk * pp == m.num_layers,
                 f"num-virtual-stages-per-pipeline-rank {v} disagrees with num-layers-per-virtual-pipeline-stage "
                 f"{per_chunk}: {v} x {per_chunk} x PP {pp} != num-layers {m.num_layers}")
    chunks = p.virtual_stages(m.num_layers)
    _require(m.num_layers % (pp * chunks) == 0,
             f"num-layers {m.num_layers} is not divisible by pipeline-model-parallel-size {pp} x virtual stages "
             f"{chunks} = {pp * chunks}")
    _require(chunks == 1 or pp > 1,
             f"virtual pipeline stages ({chunks}) need --pipeline-model-parallel-size > 1")
    micro_batch_product = t.micro_batch_size * dp
    if chunks > 1 and t.global_batch_size % micro_batch_product == 0:
        num_micro = t.global_batch_size // micro_batch_product
        _require(num_micro % pp == 0,
                 f"the interleaved schedule needs the number of micro-batches (global-batch-size "
                 f"{t.global_batch_size} / (micro-batch-size {t.micro_batch_size} x data-parallel size {dp}) = "
                 f"{num_micro}) to be a multiple of pipeline-model-parallel-size {pp}: use a global batch size that "
                 f"is a multiple of {micro_batch_product * pp}, e.g. {micro_batch_product * pp * -(-num_micro // pp)}")


def _check_architecture(cfg: MegaliteConfig) -> None:
    """Positions, norms, grouped-query attention, sequence parallelism and recompute (heads already divide TP)."""
    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    _require(m.position_embedding_type in ("learned_absolute", "rope"),
             f"--position-embedding-type must be learned_absolute or rope, got {m.position_embedding_type!r}")
    _require(m.position_embedding_type != "rope" or m.head_dim % 2 == 0,
             f"rope needs an even head dimension, got hidden-size {m.hidden_size} / num-attention-heads "
             f"{m.num_attention_heads} = {m.head_dim}")
    _require(m.rotary_base >= 1, f"--rotary-base must be >= 1, got {m.rotary_base}")
    _require(m.normalization in ("LayerNorm", "RMSNorm"),
             f"--normalization must be LayerNorm or RMSNorm, got {m.normalization!r}")
    if m.group_query_attention:
        g, heads = m.num_query_groups, m.num_attention_heads
        _require(g >= 1, f"--num-query-groups must be >= 1, got {g}")
        _require(heads % g == 0, f"num-attention-heads {heads} is not divisible by num-query-groups {g}")
        # G % TP == 0: each rank holds G/TP whole key/value heads. TP % G == 0: each key/value head is split over
        # the TP/G ranks of its query heads, which all-gather it (so its head dimension must split TP/G ways).
        works = [t for t in range(1, heads + 1) if heads % t == 0 and (g % t == 0 or t % g == 0)
                 and (t <= g or m.head_dim % (t // g) == 0)]
        _require(g % tp == 0 or tp % g == 0,
                 f"num-query-groups {g} is not divisible by tensor-model-parallel-size {tp}, nor {tp} by {g}: one "
                 f"must divide the other; tensor-model-parallel sizes that work: {', '.join(map(str, works))}")
        _require(tp <= g or m.head_dim % (tp // g) == 0,
                 f"with num-query-groups {g} over tensor-model-parallel-size {tp}, each key/value head is split over "
                 f"{tp // g} ranks, which head dimension {m.head_dim} does not allow; tensor-model-parallel sizes that "
                 f"work: {', '.join(map(str, works))}")
    if p.sequence_parallel:
        _require(tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
        _require(m.seq_length % tp == 0,
                 f"with --sequence-parallel, seq-length {m.seq_length} must be divisible by "
                 f"tensor-model-parallel-size {tp}")
    _require(m.recompute_granularity in (None, "full", "selective"),
             f"--recompute-granularity must be full or selective, got {m.recompute_granularity!r}")
    _require(m.recompute_method in (None, "uniform", "block"),
             f"--recompute-method must be uniform or block, got {m.recompute_method!r}")
    if m.recompute_granularity == "full":
        _require(m.recompute_method is not None, "--recompute-granularity full needs --recompute-method uniform|block")
        per_chunk = m.num_layers // (p.pipeline_model_parallel_size * p.virtual_stages(m.num_layers))
        _require(1 <= m.recompute_num_layers <= per_chunk,
                 f"--recompute-num-layers must be between 1 and the {per_chunk} layers of a model chunk, got "
                 f"{m.recompute_num_layers}")
    else:
        _require(m.recompute_method is None, "--recompute-method applies to --recompute-granularity full only")


def _check_optimizer(cfg: MegaliteConfig, dp: int) -> None:
    o, t = cfg.optimizer, cfg.training
    _require(not (t.bf16 and t.fp16), "--bf16 and --fp16 exclude each other")
    _require(o.zero_stage in (1, 2, 3), f"--zero-stage must be 1, 2 or 3, got {o.zero_stage}")
    _require(o.zero_stage != 2 or o.use_distributed_optimizer, "--zero-stage 2 needs --use-distributed-optimizer")
    _require(not o.overlap_param_gather or o.use_distributed_optimizer,
             "--overlap-param-gather needs --use-distributed-optimizer")
    if o.zero_stage == 3:
        _check_fully_sharded(cfg, dp)
    _require(not o.offload_params or o.zero_stage == 3, "--offload-params needs --zero-stage 3")
    _require(not o.offload_params or o.optimizer_cpu_offload,
             "--offload-params needs --optimizer-cpu-offload: offloaded parameter shards are stepped on the CPU")
    _require(o.ddp_bucket_size is None or o.ddp_bucket_size >= 1,
             f"--ddp-bucket-size must be >= 1, got {o.ddp_bucket_size}")
    _require(o.loss_scale is None or t.fp16, "--loss-scale applies to --fp16 only")
    _require(o.loss_scale is None or o.loss_scale > 0, f"--loss-scale must be > 0, got {o.loss_scale}")
    _require(0 < o.min_loss_scale <= o.initial_loss_scale,
             f"need 0 < min-loss-scale <= initial-loss-scale, got {o.min_loss_scale} and {o.initial_loss_scale}")
    _require(o.loss_scale_window >= 1 and o.hysteresis >= 1,
             f"--loss-scale-window and --hysteresis must be >= 1, got {o.loss_scale_window} and {o.hysteresis}")


def _check_fully_sharded(cfg: MegaliteConfig, dp: int) -> None:
    """ZeRO-3 runs on FSDP2, which owns gradient reduction and parameter gathering: the options of our own
    data-parallel engine do not apply, and there must be data-parallel ranks to shard over."""
    o = cfg.optimizer
    _require(not o.use_distributed_optimizer,
             "--zero-stage 3 shards the optimizer itself (FSDP2): drop --use-distributed-optimizer")
    for name, value in [("overlap-grad-reduce", o.overlap_grad_reduce),
                        ("overlap-param-gather", o.overlap_param_gather)]:
        _require(not value, f"--{name} is for stages 1-2: with --zero-stage 3, FSDP2 overlaps its own reductions "
                            f"and gathers")
    _require(dp > 1, "--zero-stage 3 shards over data-parallel ranks and this layout has none (data-parallel size "
                     "1); for CPU offload on one data-parallel rank use --optimizer-cpu-offload")


def _check_checkpoint(cfg: MegaliteConfig) -> None:
    """The checkpoint options alone (the checkpoint itself is checked by megalite.checkpoint.check_checkpoint)."""
    c = cfg.checkpoint
    _require(c.save_interval is None or c.save_interval >= 1, f"--save-interval must be >= 1, got {c.save_interval}")
    _require(c.save_interval is None or c.save is not None, "--save-interval needs --save")
    _require(not c.finetune or c.load is not None, "--finetune needs --load")


def _check_kernels(cfg: MegaliteConfig) -> None:
    """The fused-kernel mode; ``on`` needs a GPU here (whether the extension builds is checked when the model is)."""
    mode = cfg.kernels.use_fused_kernels
    _require(mode in ("auto", "on", "off"), f"--use-fused-kernels must be auto, on or off, got {mode!r}")
    if mode == "on":
        import torch   # only here: checking the other options needs no torch

        _require(torch.cuda.is_available(),
                 "--use-fused-kernels on needs a CUDA device and none is visible: use auto (fused kernels where "
                 "there is a GPU, torch ops elsewhere) or off")


def _check_data(cfg: MegaliteConfig) -> None:
    """The data options alone (no file is opened here: megalite.data.check_data_files does that)."""
    d = cfg.data
    d.split_fractions()
    _require(d.tokenizer_type in ("SentencePieceTokenizer", "NullTokenizer"),
             f"--tokenizer-type must be SentencePieceTokenizer or NullTokenizer, got {d.tokenizer_type!r}")
    _require(d.eval_interval >= 0 and d.eval_iters >= 0,
             f"--eval-interval and --eval-iters must be >= 0, got {d.eval_interval} and {d.eval_iters}")
    if d.mock_data:
        _require(d.data_path is None, "--mock-data and --data-path exclude each other")
        return
    if d.data_path is None:  # the built-in corpus, which brings its own tokenizer
        _require(d.tokenizer_model is None and d.tokenizer_type == "SentencePieceTokenizer",
                 "--tokenizer-type/--tokenizer-model need --data-path (the built-in corpus has its own tokenizer)")
        return
    d.blend()
    _require(d.tokenizer_type != "SentencePieceTokenizer" or d.tokenizer_model is not None,
             "--data-path needs --tokenizer-model (or --tokenizer-type NullTokenizer)")
