"""Choose the parallelism: rank the layouts that fit a model on a cluster, say why the first wins, print its command.

    python tools/plan_parallelism.py --model gpt2_medium --gpus 8 --global-batch-size 512
    python tools/plan_parallelism.py --model llama2_70b --gpus 64 --global-batch-size 1024
    python tools/plan_parallelism.py --model llama2_70b --gpus 64 --global-batch-size 1024 --intra-node-link pcie
    python tools/plan_parallelism.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --vocab-size 50257 \
        --seq-length 2048 --gpus 16 --global-batch-size 256 --json
    python tools/plan_parallelism.py --model llama2_7b --gpus 8 --deepspeed-config ds_config.json

Defaults describe H100-80GB nodes: 80 GiB, 989 dense bf16 TFLOP/s, 8 GPUs per node on NVLink (450 GB/s), nodes on
InfiniBand (400 Gb/s per GPU). Other ModelConfig fields go as key=value words (normalization=RMSNorm swiglu=true).
Every number comes from megalite.planner, where each formula is written out with its source.

With --deepspeed-config the file is read as pretrain_gpt.py reads it (megalite.config.deepspeed, its table printed
first): the plan takes its global batch and precision, and begins with what the file itself implies on these GPUs,
data parallelism over all of them as DeepSpeed runs it, with the file's ZeRO stage, offload, micro-batch and recompute.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from megalite.config import ConfigError, MegaliteConfig, ModelConfig, TrainingConfig, validate  # noqa: E402
from megalite.config.tool import check_writable, run_tool  # noqa: E402
from megalite.config.deepspeed import translate  # noqa: E402
from megalite.config.flags import BY_KEY  # noqa: E402
from megalite.planner import (  # noqa: E402
    Estimate,
    Hardware,
    Layout,
    format_plan,
    load_model_config,
    memory_per_stage,
    model_names,
    search,
    step_time,
    to_json,
)
from megalite.planner.dry_run import dtype_bytes  # noqa: E402
from megalite.planner.hardware import (  # noqa: E402
    INTER_NODE_BANDWIDTH_GBITPS,
    INTRA_NODE_BANDWIDTH_GBPS,
)
from megalite.planner.models import with_seq_length  # noqa: E402
from megalite.planner.report import estimate_json, estimate_lines  # noqa: E402
from megalite.visual.figures import check_output, save  # noqa: E402

_SIZES = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size", "num_query_groups"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plan_parallelism", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    model = parser.add_argument_group("model")
    model.add_argument("--model", metavar="NAME",
                       help=f"A configs/model file: {', '.join(model_names())} (sizes below override it).")
    for name in _SIZES:
        model.add_argument(BY_KEY[f"model.{name}"].flag, type=int, dest=name)
    model.add_argument("--swiglu", action="store_true", default=None, help="SwiGLU MLP (Llama).")
    model.add_argument("--seq-length", type=int, help="Tokens per sample (default: the model config's).")
    model.add_argument("overrides", nargs="*", metavar="key=value", help="Any other ModelConfig field.")
    run = parser.add_argument_group("run")
    run.add_argument("--global-batch-size", type=int, help="Samples per step (default 512, or the DeepSpeed "
                                                             "config's).")
    run.add_argument("--fp32", action="store_true", help="Plan fp32 training (default bf16, or the DeepSpeed "
                                                         "config's).")
    run.add_argument("--deepspeed-config", metavar="JSON",
                     help="A DeepSpeed config: plan with its batch and precision, after the memory its own ZeRO "
                          "stage, offload, micro-batch and recompute need at data parallelism over every GPU.")
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--gpus", type=int, default=8, help="Number of GPUs (default 8).")
    hw.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8).")
    hw.add_argument("--gpu-memory-gib", type=float, default=80.0, help="Memory per GPU (default 80).")
    hw.add_argument("--peak-tflops", type=float, default=Hardware.peak_tflops,
                    help=f"Dense bf16 peak per GPU (default {Hardware.peak_tflops:g}, H100 SXM).")
    hw.add_argument("--efficiency", type=float, default=0.5,
                    help="Fraction of the peak the kernels achieve (default 0.5).")
    hw.add_argument("--memory-headroom", type=float, default=0.10,
                    help="Fraction of GPU memory kept free for the CUDA context, NCCL and fragmentation (0.10).")
    hw.add_argument("--intra-node-link", choices=sorted(INTRA_NODE_BANDWIDTH_GBPS), default="nvlink",
                    help="GPU-to-GPU link inside a node (nvlink 450 GB/s, pcie 32 GB/s per direction by default).")
    hw.add_argument("--intra-node-gbps", type=float, help="Override its bandwidth, GB/s per GPU per direction.")
    hw.add_argument("--inter-node-network", choices=sorted(INTER_NODE_BANDWIDTH_GBITPS), default="infiniband",
                    help="Network between nodes (infiniband 400, roce 200, ethernet 100 Gb/s per GPU by default).")
    hw.add_argument("--inter-node-gbitps", type=float, help="Override its bandwidth, Gb/s per GPU.")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="Rows of the table (default 10).")
    out.add_argument("--json", action="store_true", help="Print the plan as JSON instead.")
    out.add_argument("--plot", metavar="FILE", help="Also draw the memory per GPU of the --top layouts as stacked bars "
                                                    "(.png, .svg or .pdf; needs matplotlib: pip install -e \".[plot]\").")
    return parser.parse_args(argv)


def _overrides(args: argparse.Namespace) -> dict:
    values = {name: getattr(args, name) for name in _SIZES + ["swiglu"]}
    if args.num_query_groups is not None:
        values["group_query_attention"] = True
    for word in args.overrides:
        key, sep, value = word.partition("=")
        if not sep:
            raise ConfigError(f"expected key=value, got {word!r}")
        values[key.removeprefix("model.")] = value
    return values


def _deepspeed(args: argparse.Namespace, model: ModelConfig, hardware: Hardware) -> tuple[list[str], MegaliteConfig]:
    """The DeepSpeed file's table and the run it describes: at TP = PP = 1 over every GPU, as DeepSpeed runs it."""
    user_keys = {"training.global_batch_size"} if args.global_batch_size is not None else set()
    if args.fp32:
        user_keys.add("training.bf16")
    base = MegaliteConfig(model=model, training=TrainingConfig(global_batch_size=args.global_batch_size or 512,
                                                               bf16=not args.fp32))
    translation = translate(args.deepspeed_config, hardware.num_gpus, base, user_keys)
    cfg = translation.apply(base)
    return translation.settings_lines(cfg), cfg


def _as_written(cfg: MegaliteConfig, hardware: Hardware) -> tuple[Optional[Estimate], str]:
    """The estimate of the DeepSpeed file's own layout, or why it cannot run."""
    try:
        validate(cfg, hardware.num_gpus)
    except ConfigError as error:
        return None, f"as written it cannot run on {hardware.num_gpus} GPUs: {error}"
    layout = Layout.from_config(cfg, hardware.num_gpus)
    o, gbs = cfg.optimizer, cfg.training.global_batch_size
    memory = memory_per_stage(cfg.model, layout, gbs, dtype_bytes=dtype_bytes(cfg), bucket_size=o.ddp_bucket_size,
                              prefetch_bucket_size=o.zero3_prefetch_bucket_size)
    time = step_time(cfg.model, layout, hardware, gbs, dtype_bytes(cfg))
    e = Estimate(layout, tuple(memory), time, hardware.usable_memory_bytes, gbs, cfg.model.seq_length)
    host = f", plus {e.peak.host / 2**30:.1f} GiB on the host" if e.peak.host else ""
    verdict = "fits" if e.fits else "does NOT fit"
    return e, (f"as written ({layout.describe()}): {e.peak.total / 2**30:.1f} GiB per GPU{host}; {verdict} in "
               f"{hardware.usable_memory_bytes / 2**30:.1f} GiB")


def _plot(plan, args: argparse.Namespace) -> None:
    """--plot FILE: the memory of the top layouts as stacked bars, the chosen one in bold."""
    if not args.plot:
        return
    if not plan.ranked:
        print(f"no layout fits: nothing to draw in {args.plot}", file=sys.stderr)
        return
    from megalite.visual.memory import plan_figure   # matplotlib: only when drawing
    print(f"wrote {save(plan_figure(plan, args.top), args.plot)}", file=sys.stderr)


def main(argv: list[str]) -> int:
    args = parse(argv)
    return run_tool("plan_parallelism", lambda: plan_layouts(args))


def plan_layouts(args: argparse.Namespace) -> int:
    """The work; run_tool reports the errors it does not (an unwritable --plot, a closed stdout)."""
    try:
        model = with_seq_length(load_model_config(args.model, **_overrides(args)), args.seq_length)
        hardware = Hardware(num_gpus=args.gpus, gpus_per_node=min(args.gpus_per_node, args.gpus),
                            gpu_memory_gib=args.gpu_memory_gib, peak_tflops=args.peak_tflops,
                            intra_node_link=args.intra_node_link, intra_node_gbps=args.intra_node_gbps,
                            inter_node_network=args.inter_node_network, inter_node_gbitps=args.inter_node_gbitps,
                            efficiency=args.efficiency, memory_headroom=args.memory_headroom)
        deepspeed = _deepspeed(args, model, hardware) if args.deepspeed_config else None
        if args.plot:
            check_writable(check_output(args.plot))
    except (ConfigError, ValueError) as error:
        for line in getattr(error, "table", ()):   # a refused DeepSpeed config: what was refused, in its table
            print(line)
        print(f"plan_parallelism: error: {error}", file=sys.stderr)
        return 2
    global_batch = args.global_batch_size or 512
    nbytes = 4 if args.fp32 else 2
    if deepspeed is not None:
        global_batch, nbytes = deepspeed[1].training.global_batch_size, dtype_bytes(deepspeed[1])
    plan = search(model, hardware, global_batch, model_name=args.model, dtype_bytes=nbytes)
    if deepspeed is None:
        print(json.dumps(to_json(plan), indent=2) if args.json else format_plan(plan, top=args.top))
        _plot(plan, args)
        return 0 if plan.winner is not None else 1
    table, cfg = deepspeed
    written, verdict = _as_written(cfg, hardware)
    if args.json:
        data = to_json(plan)
        data["deepspeed_config"] = {"path": args.deepspeed_config, "table": table, "verdict": verdict,
                                    "as_written": estimate_json(written, plan) if written else None}
        print(json.dumps(data, indent=2))
    else:
        lines = table + ["", f"deepspeed config {args.deepspeed_config}: {verdict}"]
        if written is not None:
            lines += estimate_lines([written], plan)
        print("\n".join(lines + ["", "Alternatives for the same model, batch and precision:", format_plan(plan,
                                                                                                   top=args.top)]))
    _plot(plan, args)
    return 0 if plan.winner is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
