"""Megatron-LM's own example scripts run unchanged: the training flags of three of its scripts, given to
``pretrain_gpt.py --dry-run`` at the world size each launches, plan the run (exit 0) instead of stopping at a flag.

The flags are written out below as the scripts pass them (Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh,
examples/llama/train_llama3_8b_h100_fp8.sh and examples/mixtral/train_mixtral_8x7b_distributed.sh), with the paths
replaced: the data by --mock-data (Megatron's own Llama script does the same in its MOCK branch), the checkpoint,
TensorBoard and cache directories by temporary ones, the tokenizer model by a small SentencePiece model.
"""

from __future__ import annotations

import re

import pytest

import pretrain_gpt
from megalite.config.batches import batch_schedule
from megalite.config.schema import TrainingConfig


def gpt3_175b(paths: dict) -> list[str]:
    """examples/gpt3/train_gpt3_175b_distributed.sh: TP 8 x PP 16, a batch ramp-up from 16 to 1536 over 5,859,375
    samples, the warm-up a fraction of the decay."""
    return [
        # GPT_MODEL_ARGS
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
        "--max-position-embeddings", "2048", "--attention-backend", "auto",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size", "16", "16", "5859375",
        "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
        "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        # DATA_ARGS (--data-path $DATA_PATH -> --mock-data)
        "--mock-data", "--vocab-file", paths["vocab"], "--merge-file", paths["merges"], "--split", "949,50,1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", paths["checkpoint"],
        "--load", paths["checkpoint"], "--eval-iters", "10", "--tensorboard-dir", paths["tensorboard"],
    ]


def gpt3_175b_step_schedule(paths: dict) -> list[str]:
    """The same script in the form Megatron-LM converted its ramp-ups to (--step-batch-size-schedule, thresholds in
    tokens): the same batch at every step, written as the schedule of sample counts x 2048 tokens."""
    words = gpt3_175b(paths)
    at = words.index("--rampup-batch-size")
    ramp = batch_schedule(TrainingConfig(global_batch_size=1536, rampup_batch_size="16 16 5859375"), 2048)
    schedule = " ".join(f"{first * 2048}:{batch}" for first, batch in ramp.steps)
    return words[:at] + ["--step-batch-size-schedule", schedule] + words[at + 4:]


def llama3_8b_fp8(paths: dict) -> list[str]:
    """examples/llama/train_llama3_8b_h100_fp8.sh, its MOCK data branch: 8 GPUs, sample-based training, FP8."""
    return [
        # MODEL_ARGS
        "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
        "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
        "--seq-length", "8192", "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
        "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr", "0.00001",
        "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
        "--exit-duration-in-mins", "235",
        # DDP_ARGS
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        # DTYPE_ARGS
        "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
        "--fp8-param-gather",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
        # DATA_ARGS_LIST (MOCK)
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--data-cache-path",
        paths["cache"], "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files", "--num-workers", "1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
        "torch_dist", "--distributed-timeout-minutes", "60", "--save", paths["checkpoint"], "--load",
        paths["checkpoint"], "--tensorboard-dir", paths["tensorboard"],
    ]


def mixtral_8x7b(paths: dict) -> list[str]:
    """examples/mixtral/train_mixtral_8x7b_distributed.sh: PP 4, 8 experts over EP 8, --sequence-parallel at TP 1."""
    return [
        # MODEL_ARGS
        "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096", "--max-position-embeddings", "32768",
        "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
        "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization",
        "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
        "--group-query-attention", "--num-query-groups", "8", "--no-masked-softmax-fusion", "--no-position-embedding",
        "--rotary-base", "1000000",
        # MOE_ARGS
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
        "--overlap-param-gather", "--overlap-grad-reduce",
        # DATA_ARGS (--data-path $DATA_PATH -> --mock-data)
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", paths["tokenizer"], "--mock-data", "--split",
        "99990,8,2",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4", "--train-iters", "500000",
        "--lr-decay-iters", "320000", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
        "--lr-warmup-iters", "500", "--clip-grad", "1.0", "--bf16",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size",
        "8", "--use-distributed-optimizer", "--sequence-parallel",
        # LOGGING_ARGS (with WANDB_API_KEY set, as the script adds them then)
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10", "--save",
        paths["checkpoint"], "--load", paths["checkpoint"], "--tensorboard-dir", paths["tensorboard"],
        "--no-load-optim", "--no-load-rng", "--wandb-project", "Mixtral", "--wandb-exp-name", "Mixtral_8x7B",
    ]


@pytest.fixture
def paths(tmp_path, corpus):
    (tmp_path / "gpt2-vocab.json").write_text('{"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}')
    (tmp_path / "gpt2-merges.txt").write_text("#version: 0.2\na b\n")
    return {"checkpoint": str(tmp_path / "checkpoints"), "tensorboard": str(tmp_path / "tensorboard"),
            "cache": str(tmp_path / "cache"), "vocab": str(tmp_path / "gpt2-vocab.json"),
            "merges": str(tmp_path / "gpt2-merges.txt"), "tokenizer": str(corpus.tokenizer_model)}


@pytest.mark.parametrize("script, world_size, layout, parameters, notes", [
    # 128 GPUs: TP 8 x PP 16 (its 8 GPUs per node on 16 nodes; one node cannot hold the layout).
    (gpt3_175b, 128, "TP=8 x PP=16 x DP=1", (173.5e9, 175.5e9), ["at the largest global batch 16 -> 1536 (96 sizes)"]),
    (gpt3_175b_step_schedule, 128, "TP=8 x PP=16 x DP=1", (173.5e9, 175.5e9),
     ["at the largest global batch 16 -> 1536 (96 sizes)"]),
    (llama3_8b_fp8, 8, "TP=1 x PP=1 x DP=8", (8.02e9, 8.04e9),
     ["--sequence-parallel turned off", "accepted without effect here (README: Coming from Megatron-LM): "
      "--attention-backend fused, --num-workers 1, --no-mmap-bin-files, --no-create-attention-mask-in-dataloader, "
      "--calculate-per-token-loss, --use-mcore-models, --log-throughput, --ckpt-format torch_dist, "
      "--cross-entropy-loss-fusion, "
      "--tiktoken-pattern v2 (the tokenizer is NullTokenizer)"]),
    # 32 GPUs: expert parallelism 8 needs 8 data-parallel ranks at PP 4 (the script's 8 GPUs per node on 4 nodes).
    (mixtral_8x7b, 32, "TP=1 x PP=4 x DP=8", None,
     ["--sequence-parallel turned off", "--no-position-embedding (positions are rope)"]),
])
def test_megatron_example_scripts_dry_run(script, world_size, layout, parameters, notes, paths, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    words = script(paths)
    code = pretrain_gpt.main(words + ["--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"megalite: dry run: {layout}" in out, out
    for note in notes:
        assert note in out, out
    if parameters is not None:
        count = float(re.search(r"; ([\d,.]+)M parameters", out).group(1).replace(",", "")) * 1e6
        assert parameters[0] < count < parameters[1], count
