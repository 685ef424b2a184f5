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

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

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
        1, "With the distributed optimizer: 1 shards optimizer states, 2 also keeps only this rank's gradient shard.")
    overlap_grad_reduce: bool = option(
        False, "Start each gradient bucket's reduction as soon as backward has produced all of its gradients.")
    overlap_param_gather: bool = option(
        False, "With the distributed optimizer: gather updated parameters asynchronously, waiting only when the "
               "next forward needs them.")
    ddp_bucket_size: Optional[int] = option(
        None, "Elements per gradient-reduction bucket; default max(40M, 1M x data-parallel size).")
    optimizer_cpu_offload: bool = option(
        False, "Keep fp32 main parameters and Adam states on the CPU and step them there (fused C++ Adam).")
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


@dataclass
class LoggingConfig:
    log_interval: int = option(1, "Print (and record) metrics every this many iterations.")
    metrics_file: Optional[str] = option(None, "Rank 0 appends one JSON object per logged iteration to this file.")
    tensorboard_dir: Optional[str] = option(None, "Write TensorBoard scalars to this directory (rank 0).")


@dataclass
class MegaliteConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)


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
    _check_optimizer(cfg)
    _require(0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1,
             f"Adam betas must be in [0, 1), got {o.adam_beta1}, {o.adam_beta2}")
    _check_data(cfg)


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


def _check_optimizer(cfg: MegaliteConfig) -> None:
    o, t = cfg.optimizer, cfg.training
    _require(not (t.bf16 and t.fp16), "--bf16 and --fp16 exclude each other")
    _require(o.zero_stage in (1, 2), f"--zero-stage must be 1 or 2, got {o.zero_stage}")
    _require(o.zero_stage == 1 or o.use_distributed_optimizer,
             f"--zero-stage {o.zero_stage} needs --use-distributed-optimizer")
    _require(not o.overlap_param_gather or o.use_distributed_optimizer,
             "--overlap-param-gather needs --use-distributed-optimizer")
    _require(o.ddp_bucket_size is None or o.ddp_bucket_size >= 1,
             f"--ddp-bucket-size must be >= 1, got {o.ddp_bucket_size}")
    _require(o.loss_scale is None or t.fp16, "--loss-scale applies to --fp16 only")
    _require(o.loss_scale is None or o.loss_scale > 0, f"--loss-scale must be > 0, got {o.loss_scale}")
    _require(0 < o.min_loss_scale <= o.initial_loss_scale,
             f"need 0 < min-loss-scale <= initial-loss-scale, got {o.min_loss_scale} and {o.initial_loss_scale}")
    _require(o.loss_scale_window >= 1 and o.hysteresis >= 1,
             f"--loss-scale-window and --hysteresis must be >= 1, got {o.loss_scale_window} and {o.hysteresis}")


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
