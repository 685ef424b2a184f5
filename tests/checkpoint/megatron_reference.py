"""Megatron-LM's own checkpoints and models, as a reference for megalite's Megatron converter (tests only).

megatron-core 0.16.1 (``pip install megalite[megatron]``) holds Megatron's model (GPTModel), its process groups and
its checkpoint library (dist_checkpointing); Megatron-LM's training package (arguments, checkpointing.py, the model
builder) is not in the wheel. This module does what that package does when it writes and reads a checkpoint, on CPU
over gloo, so that a test can compare megalite's import and export against Megatron's own files and logits:

- ``megatron_args(style, ...)``: the Namespace Megatron-LM's parse_args would produce for one of five tiny models
  (gpt3, llama, qwen, mixtral, qwen_moe); this is what a checkpoint stores under "args".
- ``megatron_layout(args)``: Megatron's process groups for the args' TP/PP/VPP/EP over the current torch world (a
  1-rank gloo world of its own when none is initialized), Megatron's seeding, and the CPU stand-ins below; all
  undone on exit.
- ``build_models(args)``: the model chunks Megatron's gpt_builder builds on this rank (one per virtual stage).
- ``save_megatron`` / ``load_megatron``: save_checkpoint and ``--load DIR --use-checkpoint-args`` for the formats
  "torch_dist" (dist_checkpointing, reshards on load) and "torch" (legacy per-rank model_optim_rng.pt files).
- ``megatron_logits``: the full forward over pipeline stages, virtual chunks and tensor ranks, on every rank.

Tests using this module start with ``pytest.importorskip("megatron.core")``; nothing in megalite imports it.

CPU stand-ins (megatron-core assumes CUDA in a few places that these tiny models reach):
- ``torch.cuda.current_device`` answers "cpu" (tensors are made on "the current CUDA device"), and
  ``torch.cuda.synchronize`` does nothing;
- ``Tensor.cuda`` returns the tensor (the tied output weight of the last pipeline stage is moved to CUDA before the
  all-reduce that copies the first stage's embedding into it);
- the RNG tracker's ``fork`` is a null context (it saves and restores CUDA generator states); with dropout 0 and
  ``use_cpu_initialization`` (weights drawn from the CPU generator, then sliced per rank) nothing else uses it;
- ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is bound to None (0.16.1 reads the name, which only
  exists when Transformer Engine imports: NameError in the router otherwise);
- the MoE token dispatcher is "allgather" (the alltoall one makes CUDA streams).

dist_checkpointing's default save strategy writes with forked processes that need psutil (the ``megatron`` extra
installs it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=100,
            make_vocab_size_divisible_by=8)
STYLES = ("gpt3", "llama", "qwen", "mixtral", "qwen_moe")
# The model flags a Megatron-LM run loading a style's checkpoint must give beside --use-checkpoint-args (options
# load_args_from_checkpoint does not take from a checkpoint; megalite's export names them likewise).
LOAD_FLAGS = {"qwen_moe": ("--moe-shared-expert-gate",)}
ITERATION = 10
CHECKPOINT_VERSION = 3.0
# Collectives of Megatron's groups give up after this (a rank stranded by a failed peer raises instead of hanging).
GROUP_TIMEOUT_MINUTES = 2


def _style_options(style: str) -> dict:
    """The model flags of each style, as the Megatron-LM command line would set them."""
    gpt3 = dict(position_embedding_type="learned_absolute", add_position_embedding=True,
                use_rotary_position_embeddings=False, normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                add_qkv_bias=True, untie_embeddings_and_output_weights=False, ffn_hidden_size=256,
                group_query_attention=False, num_query_groups=None, rotary_base=10000)
    llama = dict(position_embedding_type="rope", add_position_embedding=False, use_rotary_position_embeddings=True,
                 rotary_base=10000, rotary_percent=1.0, normalization="RMSNorm", swiglu=True,
                 add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
                 ffn_hidden_size=128, group_query_attention=True, num_query_groups=2)
    qwen = dict(llama, add_qkv_bias=True, qk_layernorm=False, rotary_base=1000000,
                untie_embeddings_and_output_weights=False)
    mixtral = dict(llama, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_router_score_function="softmax",
                   moe_token_dispatcher_type="allgather", moe_layer_freq=1)
    qwen_moe = dict(mixtral, moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=True,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_topk_scaling_factor=1.0)
    styles = dict(gpt3=gpt3, llama=llama, qwen=qwen, mixtral=mixtral, qwen_moe=qwen_moe)
    if style not in styles:
        raise ValueError(f"unknown style {style!r}; one of {', '.join(STYLES)}")
    return styles[style]


def _transformer_config_defaults() -> dict:
    """Megatron-LM 0.16 makes most model flags from TransformerConfig's fields (same names, same defaults)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    defaults = {}
    for f in dataclasses.fields(TransformerConfig):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        if not callable(value) or isinstance(value, type):
            defaults[f.name] = value
    return defaults


def megatron_args(style: str | None, *, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
                  ckpt_format: str = "torch_dist", seed: int = 1234, **overrides) -> argparse.Namespace:
    """The args Namespace Megatron-LM's parse_args (after validate_args and the tokenizer's vocabulary padding)
    would give for a tiny model of ``style`` at this layout; ``overrides`` replace any attribute last."""
    if ckpt_format not in ("torch_dist", "torch"):
        raise ValueError(f"ckpt_format {ckpt_format!r}: torch_dist or torch")
    world = dist.get_world_size() if dist.is_initialized() else 1
    args = _transformer_config_defaults()
    args.update(TINY)
    args.update(
        # derived by validate_args
        kv_channels=TINY["hidden_size"] // TINY["num_attention_heads"], max_position_embeddings=TINY["seq_length"],
        world_size=world, rank=dist.get_rank() if dist.is_initialized() else 0,
        data_parallel_size=world // (tp * pp), params_dtype=torch.float32, fp16=False, bf16=False,
        # model
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, layernorm_epsilon=1e-5,
        rotary_percent=1.0, rotary_interleaved=False, use_rope_scaling=False, rope_scaling_factor=8.0,
        rope_type=None, apply_layernorm_1p=False, qk_layernorm=False, qk_l2_norm=False, squared_relu=False,
        quick_geglu=False, apply_query_key_layer_scaling=False, fp16_lm_cross_entropy=False,
        multi_latent_attention=False, experimental_attention_variant=None, heterogeneous_layers_config_path=None,
        heterogeneous_layers_config_encoded_json=None, mtp_num_layers=None, spec=None, use_legacy_models=False,
        transformer_impl="local", yaml_cfg=None, init_method_xavier_uniform=False,
        # MoE (off unless the style says)
        num_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2, moe_layer_freq=1,
        moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, moe_router_score_function="softmax",
        moe_router_pre_softmax=False, moe_router_enable_expert_bias=False, moe_router_topk_scaling_factor=None,
        moe_grouped_gemm=False, moe_use_legacy_grouped_gemm=False, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, moe_latent_size=None,
        # tokenizer
        tokenizer_type="NullTokenizer", tokenizer_model=None, tiktoken_pattern=None,
        # CPU: no fused kernels, initialization on the CPU generator
        use_cpu_initialization=True, bias_gelu_fusion=False, bias_swiglu_fusion=False, masked_softmax_fusion=False,
        no_persist_layer_norm=True, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, overlap_p2p_comm=False, cp_comm_type=["p2p"],
        decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None, fp8_param_gather=False,
        config_logger_dir="", te_precision_config_file=None, is_hybrid_model=False,
        # parallelism
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        num_layers_per_virtual_pipeline_stage=(TINY["num_layers"] // (pp * vpp) if vpp else None),
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp, context_parallel_size=1,
        sequence_parallel=False,
        # checkpointing (no optimizer and no RNG state: the CUDA RNG state has no CPU counterpart)
        ckpt_format=ckpt_format, use_dist_ckpt=ckpt_format != "torch", auto_detect_ckpt_format=False,
        no_save_optim=True, no_save_rng=True, no_load_optim=True, no_load_rng=True, finetune=False,
        use_distributed_optimizer=False, async_save=False, ckpt_fully_parallel_save=True,
        ckpt_fully_parallel_load=False, ckpt_assume_constant_structure=False, dist_ckpt_strictness="assume_ok_unexpected",
        use_checkpoint_args=False, use_mp_args_from_checkpoint_args=False,
        use_tokenizer_model_from_checkpoint_args=True, save=None, load=None,
        seed=seed, data_parallel_random_init=False, iteration=0, consumed_train_samples=0, consumed_valid_samples=0,
        skipped_train_samples=0, num_floating_point_operations_so_far=0,
    )
    if style is not None:   # None: the command line's defaults (a run that takes the model from --load)
        args.update(_style_options(style))
    args.update(overrides)
    multiple = args["make_vocab_size_divisible_by"] * tp
    args.setdefault("padded_vocab_size", None)
    if args["padded_vocab_size"] is None:
        args["padded_vocab_size"] = -(-args["vocab_size"] // multiple) * multiple
    if args["num_experts"] is None:
        args["moe_ffn_hidden_size"] = None
    return argparse.Namespace(**args)


def transformer_config(args: argparse.Namespace):
    """What core_transformer_config_from_args builds: every TransformerConfig field taken from the args of the same
    name, plus the few that Megatron-LM translates."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    kwargs = {name: getattr(args, name) for name in names if hasattr(args, name)}
    kwargs.update(persist_layer_norm=not args.no_persist_layer_norm, deallocate_pipeline_outputs=True,
                  pipeline_dtype=args.params_dtype, batch_p2p_comm=not args.overlap_p2p_comm,
                  num_moe_experts=args.num_experts, rotary_interleaved=args.rotary_interleaved,
                  num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
                  num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
                  fp8_param=args.fp8_param_gather, config_logger_dir=args.config_logger_dir,
                  inference_sampling_seed=args.seed, moe_latent_size=args.moe_latent_size,
                  num_query_groups=args.num_query_groups if args.group_query_attention else None,
                  cp_comm_type=args.cp_comm_type[0])
    if args.swiglu:
        kwargs.update(activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=args.bias_swiglu_fusion)
    else:
        kwargs.update(bias_activation_fusion=args.bias_gelu_fusion)
    kwargs.pop("rope_type", None) if args.rope_type is None else None
    return TransformerConfig(**kwargs)


# ---- layout -------------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _cpu_stand_ins():
    """Stand-ins for the CUDA calls megatron-core makes on these paths (module docstring); restored on exit."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    saved = [(torch.cuda, "current_device", torch.cuda.current_device),
             (torch.cuda, "synchronize", torch.cuda.synchronize),
             (torch.Tensor, "cuda", torch.Tensor.cuda)]
    had_fork = "fork" in vars(tracker)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    # 0.16.1's MoE router tests ``te_general_gemm is not None`` but only binds the name when Transformer Engine
    # imports (NameError without it); None selects its torch.mm path.
    from megatron.core.transformer.moe import moe_utils
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    if not had_gemm:
        moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        if not had_gemm:
            del moe_utils.te_general_gemm
        for owner, name, value in saved:
            setattr(owner, name, value)
        if not had_fork:
            vars(tracker).pop("fork", None)


@contextlib.contextmanager
def megatron_layout(args: argparse.Namespace):
    """Megatron's process groups for ``args``' layout over the current world (every rank of it must enter), seeded as
    Megatron seeds, with the CPU stand-ins installed; everything undone on exit. Without an initialized world, a
    1-rank gloo world of its own (megalite's single-process tests need none, so nothing is shared with them)."""
    from megatron.core import parallel_state as mpu

    own_world = not dist.is_initialized()
    if own_world:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    rng = torch.get_rng_state()
    created = []
    new_group = dist.new_group

    def recorded_new_group(*args, **kwargs):   # Megatron's groups, destroyed on exit: gloo keeps threads per group
        group = new_group(*args, **kwargs)
        created.append(group)
        return group

    try:
        with _cpu_stand_ins():
            dist.new_group = recorded_new_group
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                expert_model_parallel_size=args.expert_model_parallel_size,
                distributed_timeout_minutes=GROUP_TIMEOUT_MINUTES,
                create_gloo_process_groups=False)   # the world is gloo already: its groups would be duplicates
            try:
                # Megatron's _set_random_seed: one seed per pipeline stage, the same on every TP and DP rank; weights
                # come from this CPU generator (use_cpu_initialization), whole, then sliced per TP/EP rank.
                torch.manual_seed(args.seed + 100 * mpu.get_pipeline_model_parallel_rank())
                yield
            finally:
                mpu.destroy_model_parallel()
    finally:
        dist.new_group = new_group
        for group in created:
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        torch.set_rng_state(rng)
        if own_world:
            dist.destroy_process_group()


# ---- models -------------------------------------------------------------------------------------------------------

def build_models(args: argparse.Namespace, perturb: bool = True) -> list:
    """This rank's model chunks (one per virtual stage) as Megatron-LM's gpt_builder builds them (local spec, no
    Transformer Engine); then, unless ``perturb`` is False, every norm weight and bias, linear bias and router expert
    bias moved off its initial value (0 or 1) by a small seeded amount, so that they matter in logits comparisons."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    config = transformer_config(args)
    vpp = args.virtual_pipeline_model_parallel_size
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    models = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        if args.num_experts:
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                              qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
        else:
            spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                            args.multi_latent_attention, normalization=args.normalization)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                         max_sequence_length=args.max_position_embeddings,
                         pre_process=first and stage == 0, post_process=last and stage == (vpp or 1) - 1,
                         fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=False,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                         rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage)
        model.vp_stage = vp_stage
        if perturb:
            _perturb(model, args, stage)
        models.append(model)
    return models


def _perturb(model, args, stage: int) -> None:
    """Add seeded noise to norms, biases and expert biases. The noise depends on the tensor's name, pipeline stage and
    virtual stage (and EP rank for experts), never on the TP or DP rank: replicas stay identical."""
    from megatron.core import parallel_state as mpu

    pp_rank = mpu.get_pipeline_model_parallel_rank()
    ep_rank = mpu.get_expert_model_parallel_rank()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            leaf = name.rsplit(".", 1)[-1]
            if not ("norm" in name or leaf in ("bias", "expert_bias")):
                continue
            # A bias split over TP ranks (column-parallel) gets a different slice on each rank.
            split = getattr(tensor, "tensor_model_parallel", False) and getattr(tensor, "partition_dim", -1) == 0
            key = f"{args.seed}/{pp_rank}/{stage}/{ep_rank if 'experts' in name else 0}/{tp_rank if split else 0}/{name}"
            generator = torch.Generator().manual_seed(int(hashlib.sha256(key.encode()).hexdigest()[:15], 16))
            tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.dtype))


# ---- checkpoints --------------------------------------------------------------------------------------------------

def _model_keys(models) -> list[str]:
    return ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]


def _legacy_file(directory: Path, iteration: int, tp_rank: int, pp_rank: int | None, ep_rank: int | None) -> Path:
    """Megatron-LM's get_checkpoint_name: mp_rank_TT, _PPP when pipelined, _EEE with expert parallelism."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_rank is not None else "")
    name += f"_{ep_rank:03d}" if ep_rank is not None else ""
    return Path(directory) / f"iter_{iteration:07d}" / name / "model_optim_rng.pt"


def save_megatron(args: argparse.Namespace, models: list, save_dir, iteration: int = ITERATION) -> None:
    """save_checkpoint without optimizer and RNG state: every rank of the layout calls it."""
    from megatron.core import dist_checkpointing, parallel_state as mpu
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    save_dir = Path(save_dir)
    args = argparse.Namespace(**{**vars(args), "save": str(save_dir)})
    state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    with _cpu_stand_ins():
        if args.ckpt_format == "torch_dist":
            dp_cp = mpu.get_data_parallel_group(with_context_parallel=True)
            metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
            for key, model in zip(_model_keys(models), models):
                state[key] = model.sharded_state_dict(metadata={**metadata, "dp_cp_group": dp_cp})
            state["num_floating_point_operations_so_far"] = 0
            directory = save_dir / f"iter_{iteration:07d}"
            if dist.get_rank() == 0:
                directory.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            strategy = get_default_save_sharded_strategy(args.ckpt_format)
            if args.ckpt_fully_parallel_save:
                strategy = FullyParallelSaveStrategyWrapper(strategy, dp_cp, False)
            dist_checkpointing.save(state, str(directory), strategy, validate_access_integrity=True,
                                    content_metadata=metadata)
        else:
            # The first replica of each (TP, PP, EP) shard writes it.
            if mpu.get_expert_data_parallel_rank() == 0:
                for key, model in zip(_model_keys(models), models):
                    state[key] = model.state_dict_for_save_checkpoint()
                state["num_floating_point_operations_so_far"] = 0
                path = _legacy_file(
                    save_dir, iteration, mpu.get_tensor_model_parallel_rank(),
                    mpu.get_pipeline_model_parallel_rank() if mpu.get_pipeline_model_parallel_world_size() > 1 else None,
                    mpu.get_expert_model_parallel_rank() if mpu.get_expert_model_parallel_world_size() > 1 else None)
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()


def _checkpoint_directory(load_dir: Path) -> Path:
    iteration = int((load_dir / "latest_checkpointed_iteration.txt").read_text().strip())
    return load_dir / f"iter_{iteration:07d}"


def _rank0_legacy_file(directory: Path) -> Path:
    """find_checkpoint_rank_0: whichever of the four legacy names exists."""
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        if (directory / name / "model_optim_rng.pt").is_file():
            return directory / name / "model_optim_rng.pt"
    raise FileNotFoundError(f"no rank-0 legacy checkpoint under {directory}")


def checkpoint_format(load_dir) -> str:
    """Megatron-LM's _get_checkpoint_format for the latest iteration of ``load_dir``."""
    from megatron.core import dist_checkpointing

    directory = _checkpoint_directory(Path(load_dir))
    if dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        return "torch_dist"
    if any(p.name.startswith("mp_rank_0") for p in directory.iterdir()):
        return "torch"
    raise ValueError(f"unknown checkpoint format in {directory}")


def checkpoint_args(load_dir) -> argparse.Namespace:
    """The args a checkpoint stores (load_args_from_checkpoint's first step): the common state of a torch_dist
    checkpoint, rank 0's file of a legacy one."""
    from megatron.core import dist_checkpointing

    directory = _checkpoint_directory(Path(load_dir))
    if checkpoint_format(load_dir) == "torch_dist":
        return dist_checkpointing.load_common_state_dict(str(directory))["args"]
    return torch.load(_rank0_legacy_file(directory), map_location="cpu", weights_only=False)["args"]


# What load_args_from_checkpoint takes from the checkpoint's args (name, force), at core_v0.16.1: a forced one
# replaces the command line's value, the others fill it only where the command line left None.
USE_CHECKPOINT_ARGS = (
    ("num_layers", False), ("hidden_size", False), ("ffn_hidden_size", False), ("seq_length", False),
    ("num_attention_heads", False), ("num_query_groups", True), ("group_query_attention", True),
    ("kv_channels", False), ("max_position_embeddings", False), ("position_embedding_type", True),
    ("add_position_embedding", True), ("use_rotary_position_embeddings", True), ("rotary_base", True),
    ("rotary_percent", True), ("rotary_interleaved", True), ("add_bias_linear", True), ("add_qkv_bias", True),
    ("squared_relu", True), ("swiglu", True), ("untie_embeddings_and_output_weights", True),
    ("apply_layernorm_1p", True), ("normalization", True), ("apply_query_key_layer_scaling", True),
    ("attention_dropout", True), ("hidden_dropout", True), ("num_experts", True), ("moe_layer_freq", True),
    ("moe_ffn_hidden_size", True), ("moe_router_topk", True), ("moe_token_dispatcher_type", False),
    ("moe_router_pre_softmax", True), ("moe_grouped_gemm", True), ("moe_shared_expert_intermediate_size", True),
    ("moe_router_score_function", True), ("moe_router_enable_expert_bias", True),
    ("moe_router_topk_scaling_factor", True), ("tokenizer_model", True), ("tokenizer_type", True),
    ("padded_vocab_size", False), ("ckpt_format", False))
# Megatron flags whose attribute is not the flag's name (a switch's value: the attribute's value when given).
_FLAG_ATTRIBUTES = {"--norm-epsilon": "layernorm_epsilon", "--apply-layernorm-1p": "layernorm_zero_centered_gamma",
                    "--disable-bias-linear": ("add_bias_linear", False),
                    "--no-position-embedding": ("add_position_embedding", False)}


def flag_attributes(flags) -> dict:
    """Megatron command-line words (``["--qk-layernorm", "--norm-epsilon 1e-06"]``) as args attributes."""
    result = {}
    for words in flags:
        flag, *value = words.split()
        target = _FLAG_ATTRIBUTES.get(flag, flag[2:].replace("-", "_"))
        if isinstance(target, tuple):
            result[target[0]] = target[1]
        elif not value:
            result[target] = True
        else:
            text = value[0]
            result[target] = int(text) if text.lstrip("-").isdigit() else float(text) if any(
                c.isdigit() for c in text) else text
    return result


def _load_args(load_dir, tp, pp, vpp, ep, ckpt_format, flags=()) -> argparse.Namespace:
    """What Megatron-LM's ``--load DIR --use-checkpoint-args`` run has for args: its command line's (the defaults,
    then ``flags``), with what load_args_from_checkpoint takes from the checkpoint (USE_CHECKPOINT_ARGS), then the
    layout replaced where given (the command line's sizes; else the checkpoint's, as use_mp_args_from_checkpoint_args
    takes them)."""
    stored = checkpoint_args(load_dir)
    args = megatron_args(None, tp=stored.tensor_model_parallel_size, pp=stored.pipeline_model_parallel_size,
                         vpp=getattr(stored, "virtual_pipeline_model_parallel_size", None),
                         ep=getattr(stored, "expert_model_parallel_size", 1))
    args.padded_vocab_size = None   # computed from the tokenizer after parsing, unless the checkpoint gives it
    for key, value in flag_attributes(flags).items():
        setattr(args, key, value)
    for name, force in USE_CHECKPOINT_ARGS:
        value = getattr(stored, name, None)
        if value is not None and (force or getattr(args, name, None) is None):
            setattr(args, name, value)
    if args.num_experts is None:
        args.moe_ffn_hidden_size = None
    args.iteration = stored.iteration
    for name, value in dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep).items():
        if value is not None:
            setattr(args, name, value)
    if pp is not None and vpp is None:
        args.virtual_pipeline_model_parallel_size = None
    vpp = args.virtual_pipeline_model_parallel_size
    args.num_layers_per_virtual_pipeline_stage = args.num_layers // (args.pipeline_model_parallel_size * vpp) if vpp else None
    args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    args.world_size = dist.get_world_size() if dist.is_initialized() else 1
    args.data_parallel_size = args.world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    args.ckpt_format = ckpt_format or checkpoint_format(load_dir)
    args.use_dist_ckpt = args.ckpt_format != "torch"
    args.load, args.use_checkpoint_args = str(load_dir), True
    return args


def load_megatron(load_dir, *, tp=None, pp=None, vpp=None, ep=None, ckpt_format=None, flags=()):
    """``--load DIR --use-checkpoint-args``: (args, models), the checkpoint's args with the layout replaced where
    given and this rank's models built from them (unperturbed) and loaded strictly. Called inside
    ``megatron_layout`` of that layout (ValueError otherwise); see ``loaded_megatron`` for both at once."""
    args = _load_args(load_dir, tp, pp, vpp, ep, ckpt_format, flags)
    _check_layout_matches(args)
    models = build_models(args, perturb=False)
    args.iteration = _load_weights(args, models, Path(load_dir))
    return args, models


@contextlib.contextmanager
def loaded_megatron(load_dir, *, tp=None, pp=None, vpp=None, ep=None, ckpt_format=None, flags=()):
    """``load_megatron`` inside a ``megatron_layout`` of the layout it loads at; yields (args, models). ``flags``:
    the Megatron command line's model flags beside --use-checkpoint-args (e.g. what an export says it needs)."""
    with megatron_layout(_load_args(load_dir, tp, pp, vpp, ep, ckpt_format, flags)):
        yield load_megatron(load_dir, tp=tp, pp=pp, vpp=vpp, ep=ep, ckpt_format=ckpt_format, flags=flags)


def _check_layout_matches(args) -> None:
    from megatron.core import parallel_state as mpu

    actual = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(),
              mpu.get_virtual_pipeline_model_parallel_world_size(), mpu.get_expert_model_parallel_world_size())
    wanted = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
              args.virtual_pipeline_model_parallel_size, args.expert_model_parallel_size)
    if actual != wanted:
        raise ValueError(f"megatron_layout is (TP, PP, VPP, EP) = {actual}, the load asks for {wanted}")


def _load_weights(args, models, load_dir: Path) -> int:
    """load_checkpoint's model part, strict both ways: a missing, unexpected or mis-shaped tensor raises."""
    from megatron.core import dist_checkpointing, parallel_state as mpu
    from megatron.core.dist_checkpointing.validation import StrictHandling

    directory = _checkpoint_directory(load_dir)
    with _cpu_stand_ins():
        if args.ckpt_format == "torch_dist":
            dp_cp = mpu.get_data_parallel_group(with_context_parallel=True)
            metadata = dist_checkpointing.load_content_metadata(str(directory)) or {}
            sharded = {key: model.sharded_state_dict(metadata={**metadata, "dp_cp_group": dp_cp})
                       for key, model in zip(_model_keys(models), models)}
            state = dist_checkpointing.load(sharded, str(directory), strict=StrictHandling.RAISE_ALL)
            state.update({k: v for k, v in dist_checkpointing.load_common_state_dict(str(directory)).items()
                          if k not in state})
        else:
            path = _legacy_file(
                load_dir, int(directory.name.split("_")[1]), mpu.get_tensor_model_parallel_rank(),
                mpu.get_pipeline_model_parallel_rank() if mpu.get_pipeline_model_parallel_world_size() > 1 else None,
                mpu.get_expert_model_parallel_rank() if mpu.get_expert_model_parallel_world_size() > 1 else None)
            state = torch.load(path, map_location="cpu", weights_only=False)
        for key, model in zip(_model_keys(models), models):
            model.load_state_dict(state[key], strict=True)
    return state["iteration"]


# ---- forward ------------------------------------------------------------------------------------------------------

def _pipeline_source(stage: int) -> int:
    from megatron.core import parallel_state as mpu

    return dist.get_global_rank(mpu.get_pipeline_model_parallel_group(), stage)


@torch.no_grad()
def megatron_logits(args: argparse.Namespace, models: list, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, padded vocabulary] (fp32) of ``tokens`` [b, s] through every pipeline stage and virtual chunk
    (hidden states [s, b, h] handed on over Megatron's pipeline group, into each chunk with set_input_tensor as
    Megatron's schedule does), gathered over TP, on every rank of the layout."""
    from megatron.core import parallel_state as mpu

    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]   # True = masked (else it makes a CUDA one)
    pp_size, pp_rank = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    group = mpu.get_pipeline_model_parallel_group()
    for model in models:
        model.eval()
    hidden = None
    logits = torch.empty(b, s, args.padded_vocab_size, dtype=torch.float32)
    with _cpu_stand_ins():
        for chunk, model in enumerate(models):
            for stage in range(pp_size):
                if stage == pp_rank:
                    if not model.pre_process:
                        model.set_input_tensor(hidden)
                    output = model(tokens, positions, mask)
                    if model.post_process:
                        logits.copy_(output.float())
                    else:
                        hidden = output.contiguous()
                if pp_size > 1:
                    last = chunk == len(models) - 1 and stage == pp_size - 1
                    if last:
                        dist.broadcast(logits, _pipeline_source(stage), group=group)
                    else:
                        if hidden is None:
                            hidden = torch.empty(s, b, args.hidden_size, dtype=args.params_dtype)
                        dist.broadcast(hidden, _pipeline_source(stage), group=group)
    return logits
