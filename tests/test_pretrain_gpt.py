"""The entry point as users run it: flags + Hydra overrides, the metrics-file contract, fail-fast errors."""

from __future__ import annotations

import json
import math

import pytest

import pretrain_gpt

from .helpers import launch, losses, read_metrics

METRIC_KEYS = {"iteration", "loss", "grad_norm", "lr", "consumed_samples", "elapsed_ms", "tokens_per_sec"}


def test_single_process_run_writes_the_metrics_contract(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    code = pretrain_gpt.main(["model=gpt_tiny", "--train-iters", "4", "--log-interval", "2", "--eval-interval", "2",
                              "--eval-iters", "1", "--metrics-file", str(metrics), "optimizer.lr=1e-3"])
    assert code == 0
    lines = read_metrics(metrics)
    records = [r for r in lines if "loss" in r]
    evaluations = [r for r in lines if "eval_loss" in r]
    assert [r["iteration"] for r in records] == [2, 4]
    assert [r["iteration"] for r in evaluations] == [2, 4] and evaluations[1]["eval_loss"] > 0
    assert all(METRIC_KEYS <= r.keys() for r in records)
    assert records[-1]["consumed_samples"] == 4 * 8
    assert "iteration      2/4" in capsys.readouterr().out


def test_deepspeed_config_stage_1_bf16_trains_and_prints_its_settings(tmp_path, capsys, monkeypatch):
    for name in ("WORLD_SIZE", "RANK"):   # one process: data-parallel size 1
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    metrics = tmp_path / "metrics.jsonl"
    code = pretrain_gpt.main(["model=gpt_tiny", "data=mock", "--deepspeed-config", str(config), "--train-iters", "2",
                              "--eval-interval", "0", "--metrics-file", str(metrics), "--lr", "2e-3"])
    assert code == 0
    out = capsys.readouterr().out
    assert f"deepspeed config {config}: 7 keys: 7 mapped, 0 ignored, 0 refused" in out
    table = [" ".join(line.split()) for line in out.splitlines() if line.startswith("  ")]
    for line in ["zero_optimization.stage 1 mapped --use-distributed-optimizer --zero-stage 1",
                 "bf16.enabled true mapped --bf16", "train_batch_size 4 mapped --global-batch-size 4",
                 "optimizer.params.lr 0.001 mapped --lr 0.001; the command line's --lr 0.002 wins"]:
        assert line in table, out
    assert "bfloat16" in out and "2 micro-batches per step" in out   # 4 = 2 x GA 2 x DP 1
    records = read_metrics(metrics)
    assert [r["iteration"] for r in records] == [1, 2] and records[-1]["consumed_samples"] == 8
    assert all(math.isfinite(r["loss"]) for r in records)


def test_deepspeed_config_refusal_fails_with_one_line_after_its_table(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"},
                                                        "sub_group_size": 1e9}}))
    assert pretrain_gpt.main(["--deepspeed-config", str(config)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("megalite: error: --deepspeed-config") and "\n" not in err
    assert "zero_optimization.offload_param.device=nvme" in err and "sub_group_size" not in err
    assert "3 keys: 1 mapped, 1 ignored, 1 refused" in captured.out   # the table says what else the file holds
    assert "zero_optimization.offload_param.device  nvme" in captured.out


@pytest.mark.parametrize("argv, message", [
    (["--num-attention-heads", "3", "--hidden-size", "64"], "--hidden-size 64 is not divisible by --num-attention-heads 3"),
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--no-such-flag", "1"], "unknown flag --no-such-flag"),
    (["--num-layers", "two"], "argument --num-layers: invalid int value: 'two'"),
    (["model.num_layer=2"], "bad override"),
])
def test_bad_options_fail_with_one_line(argv, message, capsys):
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("megalite: error:") and "\n" not in err


def test_torchrun_tensor_parallel_run_and_bad_layout_on_every_rank(tmp_path):
    metrics = tmp_path / "m.jsonl"
    good = launch(["pretrain_gpt.py", "--tensor-model-parallel-size", "2", "model=gpt_tiny", "--train-iters", "6",
                   "--eval-iters", "1", "--lr", "2e-3", "--metrics-file", str(metrics)], nproc=2, timeout=120)
    assert good.returncode == 0, good.stderr[-2000:]
    good_losses = losses(read_metrics(metrics))
    assert len(good_losses) == 6 and good_losses[-1] < good_losses[0]

    bad = launch(["pretrain_gpt.py", "--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
                  "--hidden-size", "96"], nproc=2, timeout=60)
    assert bad.returncode != 0
    lines = [l for l in bad.stderr.splitlines() if "megalite: error:" in l]
    assert len(lines) == 2   # one per rank
    assert all("--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2" in l for l in lines)


def test_negative_number_parses_and_validation_refuses_it(capsys):
    # argparse took "-1e-3" for a flag ("expected one argument"); now the number arrives, and is refused for what it is.
    assert pretrain_gpt.main(["model=gpt_tiny", "data=mock", "--lr", "-1e-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megalite: error: need 0 <= --min-lr <= --lr") and "--lr -0.001" in err and "\n" not in err


def test_data_path_with_a_space_is_one_prefix(tmp_path):
    from megalite.config.cli import parse_args
    from megalite.config.flags import argv

    prefix = str(tmp_path / "my corpus" / "text_document")
    data = parse_args(["--data-path", prefix]).data
    assert data.blend() == ([prefix], None)
    data = parse_args(["--data-path", "0.3", prefix, "0.7", "other"]).data
    assert data.blend() == ([prefix, "other"], [0.3, 0.7])
    assert parse_args(argv({"data.data_path": data.data_path})).data.data_path == data.data_path   # round trip
    assert parse_args(["--data-path", "0.3 A 0.7 B"]).data.blend() == (["A", "B"], [0.3, 0.7])   # "$BLEND" in quotes


def test_train_iters_below_the_checkpoint_is_refused(tmp_path, capsys):
    argv = ["model=gpt_tiny", "data=mock", "--eval-interval", "0", "--save", str(tmp_path), "--load", str(tmp_path)]
    assert pretrain_gpt.main([*argv, "--train-iters", "2"]) == 0
    capsys.readouterr()
    assert pretrain_gpt.main([*argv, "--train-iters", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the checkpoint is at iteration 2, past the run's last (--train-iters 1 = iteration 1)" in err
    assert "\n" not in err
    assert pretrain_gpt.main([*argv, "--train-iters", "2"]) == 0
    assert "the checkpoint is at iteration 2, the run's last (--train-iters 2): nothing left to train" in \
        capsys.readouterr().out


def test_empty_validation_split_warns_once(corpus, capsys):
    assert pretrain_gpt.main(["model=gpt_tiny", "--data-path", str(corpus.prefix), "--tokenizer-model",
                              str(corpus.tokenizer_model), "--split", "100,0,0", "--train-iters", "1",
                              "--eval-interval", "1", "--eval-iters", "1", "--vocab-size", "301"]) == 0
    out = capsys.readouterr().out
    assert out.count("megalite: warning: --split 100,0,0 leaves the validation split no documents") == 1
