"""megalite.config.flags: the one spelling of every option, Hydra quoting, YAML composition, and a config turned back
into a command line."""

from __future__ import annotations

import dataclasses

import pytest

from megalite.config import ConfigError, MegaliteConfig, OptimizerConfig, sections
from megalite.config import flags
from megalite.config.cli import parse_args

from ..helpers import launch


def all_fields():
    return [(section, field) for section, cls in sections() for field in dataclasses.fields(cls)]


def test_every_field_has_a_flag_and_help():
    table = {f.key: f for f in flags.FLAGS}
    assert len(table) == len(all_fields())
    for section, field in all_fields():
        flag = table[f"{section}.{field.name}"]
        assert flag.flag == "--" + field.name.replace("_", "-")
        assert field.metadata["help"].strip() and flag.help == field.metadata["help"]
    assert len({f.flag for f in flags.FLAGS}) == len(flags.FLAGS)


def test_flag_names_come_from_the_fields_and_a_typo_fails():
    assert flags.FLAG.tensor_model_parallel_size == "--tensor-model-parallel-size"
    with pytest.raises(AttributeError, match="no option named 'num_layer'"):
        flags.FLAG.num_layer


@pytest.mark.parametrize("value", ["plain", "1", "true", "a,b", "x=y", "it's", "back\\slash", "${oops}", "a b"])
def test_hydra_quoting_reads_back_the_same_string(value):
    assert parse_args([flags.override("data.split", value)]).data.split == value


def test_a_config_turns_back_into_its_command_line():
    cfg = parse_args(["model=gpt_tiny", "--tensor-model-parallel-size", "2", "--bf16", "--data-path", "0.3 a 0.7 b",
                      "--tokenizer-model", "t.model", "model.max_position_embeddings=null"])
    base = parse_args(["model=gpt_tiny"])
    settings = flags.differences(cfg, base)
    assert parse_args(["model=gpt_tiny", *flags.argv(settings)]) == cfg
    assert parse_args(["model=gpt_tiny", *(flags.override(k, v) for k, v in settings.items())]) == cfg
    # A switch turned off, or an option reset to None, has no flag: it is spelled as its Hydra override.
    off = dataclasses.replace(base, model=dataclasses.replace(base.model, seq_length=base.model.seq_length))
    on = dataclasses.replace(base, training=dataclasses.replace(base.training, bf16=True))
    assert flags.argv(flags.differences(off, on)) == ["training.bf16=false"]


def test_zero_level_and_its_settings_are_inverse():
    for level in range(4):
        assert OptimizerConfig(**OptimizerConfig.zero_settings(level)).zero_level == level
    assert OptimizerConfig(zero_stage=2).zero_level == 0   # stage 2 without the distributed optimizer shards nothing


def test_importing_the_config_leaves_hydra_unloaded():
    code = ("import sys, megalite.config, megalite.config.flags; "
            "print(any(m.split('.')[0] in ('hydra', 'omegaconf') for m in sys.modules))")
    result = launch(["-c", code])
    assert result.returncode == 0 and result.stdout == "False\n", result.stderr


def test_composition_errors_are_one_line():
    with pytest.raises(ConfigError, match="options: .*gpt_tiny"):
        flags.compose(["model=nope"])
    assert isinstance(flags.compose([]), MegaliteConfig)
