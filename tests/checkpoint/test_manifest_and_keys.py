"""The manifest (JSON table of contents) and the DCP key namespace, on their own."""

from __future__ import annotations

import json
import warnings

import pytest

from megalite.checkpoint import CheckpointError, Manifest, SavedLayout, TensorSpec
from megalite.checkpoint.keys import model_key, optimizer_key, optimizer_pieces, rng_key, slice_of
from megalite.checkpoint.manifest import config_from_dict
from megalite.config import to_dict
from megalite.config import MegaliteConfig
from megalite.tensor_parallel import Partition

from ..helpers import tiny_config


def _manifest() -> Manifest:
    params = {"embedding.word.weight": TensorSpec((301, 64), Partition(dim=0, padded_size=512), 2, "float32"),
              "layers.0.self_attention.linear_qkv.weight": TensorSpec((192, 64), Partition(dim=0, fused=3), 2,
                                                                       "bfloat16"),
              "layers.0.gqa.weight": TensorSpec((96, 64), Partition(dim=0, fused=(64, 16, 16)), 2, "float32"),
              "final_norm.weight": TensorSpec((64,), Partition(), 1, "float32")}
    return Manifest(iteration=5, consumed_samples=40, layout=SavedLayout(2, 2, 1, 2, zero=1),
                    config=to_dict(tiny_config()), params=params, adam_step=5,
                    loss_scaler={"scale": 1024.0, "clean_steps": 3, "hysteresis_left": 2},
                    rng_streams=["cpu", "tensor_parallel"], tokenizer=None)


def test_round_trip(tmp_path):
    manifest = _manifest()
    (tmp_path / "manifest.json").write_text(manifest.to_json())
    back = Manifest.read(tmp_path)
    assert back == manifest
    assert back.megalite_config() == tiny_config()
    assert back.layout.describe() == "TP=2 x PP=2 x DP=2, distributed optimizer (ZeRO-1)"
    assert len(back.layout.ranks()) == 8


def test_slice_shapes_follow_shard():
    specs = _manifest().params
    assert specs["embedding.word.weight"].slice_shapes() == [(256, 64), (256, 64)]   # 301 padded to 512
    assert specs["layers.0.self_attention.linear_qkv.weight"].slice_shapes() == [(96, 64), (96, 64)]
    assert specs["layers.0.gqa.weight"].slice_shapes() == [(48, 64), (48, 64)]
    assert specs["final_norm.weight"].slice_shapes() == [(64,)]


@pytest.mark.parametrize("content, message", [
    (None, "manifest.json is missing"),
    ("{not json", "unreadable"),
    ('{"format": "other"}', "not a megalite checkpoint manifest"),
    ('{"format": "megalite-checkpoint", "version": 99}', "format version 99"),
    ('{"format": "megalite-checkpoint", "version": 1, "iteration": 3}', "malformed manifest (KeyError"),
])
def test_bad_manifests_are_one_line_errors(tmp_path, content, message):
    if content is not None:
        (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(CheckpointError) as error:
        Manifest.read(tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_config_from_dict_drops_unknown_options_and_defaults_missing_ones():
    data = to_dict(tiny_config())
    data["model"]["from_the_future"] = 1
    del data["training"]["seed"]
    with pytest.warns(UserWarning, match="model.from_the_future"):
        cfg = config_from_dict(data)
    assert cfg.training.seed == MegaliteConfig().training.seed and cfg.model.hidden_size == 64


def test_megatron_flags_older_manifests_saved_as_options_read_back_quietly():
    """Megatron's flags accepted without effect were options once: their keys in an older manifest are no news."""
    data = to_dict(tiny_config())
    data["model"]["attention_backend"], data["checkpoint"]["ckpt_format"] = "auto", "torch_dist"
    data["training"]["use_mcore_models"], data["data"]["num_workers"] = True, 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_from_dict(data) == tiny_config()


def test_keys_are_unique_per_piece_and_parse_back():
    assert slice_of(Partition(dim=0), 1, 4) == (4, 1) and slice_of(Partition(), 3, 4) == (1, 0)
    keys = [optimizer_key("layers.0.mlp.linear_fc1.weight", 2, 1, lo, hi, "exp_avg") for lo, hi in [(64, 128), (0, 64)]]
    keys += [model_key("final_norm.bias", 1, 0), rng_key(1, 0, 1, "cpu")]
    assert optimizer_pieces(keys) == {("layers.0.mlp.linear_fc1.weight", 2, 1, "exp_avg"): [(0, 64), (64, 128)]}
    assert json.dumps(keys)   # plain strings


def test_a_layout_written_before_the_zero_level_reads_as_its_level():
    old = {"tp": 1, "pp": 1, "virtual_stages": 1, "dp": 4}
    assert SavedLayout.from_json({**old, "distributed_optimizer": True, "zero_stage": 2}).zero == 2
    assert SavedLayout.from_json({**old, "distributed_optimizer": False, "zero_stage": 3}).zero == 3
    assert SavedLayout.from_json({**old, "distributed_optimizer": False, "zero_stage": 1}).zero == 0
