"""megalite.config.cli: Megatron flags and Hydra overrides resolve into one typed MegaliteConfig; errors are
ConfigErrors."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from megalite.config import cli, flags
from megalite.config.cli import parse_args
from megalite.config import ConfigError, MegaliteConfig, sections, to_dict

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def all_fields():
    return [(section, field) for section, cls in sections() for field in dataclasses.fields(cls)]


def test_no_arguments_gives_dataclass_defaults_plus_default_groups():
    cfg = parse_args([])
    assert isinstance(cfg, MegaliteConfig)
    assert cfg == MegaliteConfig()  # the default data group (data/default) changes nothing: the built-in corpus
    assert parse_args(["data=mock"]).data.mock_data is True


def test_flags_set_their_fields():
    # One command line for many flags: each parse_args composes with Hydra (~50 ms), so tests share calls.
    cfg = parse_args(["--tensor-model-parallel-size", "2", "--lr", "1e-3", "--bf16", "--metrics-file", "x.jsonl",
                      "--ffn-hidden-size", "256", "--lr-decay-style", "linear",
                      "--min-lr", "-1"])  # validate() rejects a negative min-lr later; parsing must not
    for got, want in [(cfg.parallel.tensor_model_parallel_size, 2), (cfg.optimizer.lr, 1e-3), (cfg.training.bf16, True),
                      (cfg.logging.metrics_file, "x.jsonl"), (cfg.model.ffn_hidden_size, 256),
                      (cfg.optimizer.lr_decay_style, "linear"), (cfg.optimizer.min_lr, -1.0)]:
        assert got == want and type(got) is type(want)
    untouched = MegaliteConfig()
    assert cfg.model.num_layers == untouched.model.num_layers and cfg.optimizer.adam_eps == untouched.optimizer.adam_eps


def test_flag_equals_form():
    cfg = parse_args(["--tensor-model-parallel-size=2", "--metrics-file=a=b.jsonl"])
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.logging.metrics_file == "a=b.jsonl"


def test_hydra_override():
    cfg = parse_args(["optimizer.lr=3e-3", "model.num_layers=3", "training.bf16=true"])
    assert (cfg.optimizer.lr, cfg.model.num_layers, cfg.training.bf16) == (3e-3, 3, True)


def test_group_choice():
    model = parse_args(["model=gpt_tiny"]).model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.seq_length, model.vocab_size) == \
        (2, 64, 4, 32, 500)
    assert model.init_method_std == 0.02  # untouched fields keep the dataclass default
    cfg = parse_args(["model=gpt2_small", "parallel=tp2"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.vocab_size) == (12, 768, 50257)
    assert cfg.parallel.tensor_model_parallel_size == 2


def test_flags_and_hydra_overrides_mix():
    cfg = parse_args(["model=gpt_tiny", "--tensor-model-parallel-size", "2", "optimizer.lr=0.5", "--bf16",
                      "model.num_layers=3", "--metrics-file=m.jsonl"])
    assert cfg.model.hidden_size == 64 and cfg.model.num_layers == 3
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.optimizer.lr == 0.5
    assert cfg.training.bf16 and cfg.logging.metrics_file == "m.jsonl"


@pytest.mark.parametrize("argv", [["optimizer.lr=0.5", "--lr", "2"], ["--lr", "2", "optimizer.lr=0.5"]])
def test_flag_beats_hydra_override_of_same_key(argv):
    assert parse_args(argv).optimizer.lr == 2.0


def test_flag_beats_group_file():
    assert parse_args(["model=gpt_tiny", "--num-layers", "6"]).model.num_layers == 6


@pytest.mark.parametrize("texts", [("a b,c=d", "1", "true"), ("null", "", "é %s"), ("it's", 'say "hi"', "back\\slash\\"),
                                   ("${oc.env:HOME}", "\\${x}", "[1, 2]")])
def test_string_flag_values_round_trip(texts):
    # Strings reach Hydra quoted and with "${" escaped, so none is read as a number, bool, null, list or
    # interpolation. Three string fields per call: every parse_args composes with Hydra (~50 ms).
    cfg = parse_args(["--metrics-file", texts[0], "--tensorboard-dir", texts[1], "--lr-decay-style", texts[2]])
    assert (cfg.logging.metrics_file, cfg.logging.tensorboard_dir, cfg.optimizer.lr_decay_style) == texts


def test_optional_field_accepts_null_override():
    assert parse_args(["--ffn-hidden-size", "256", "model.ffn_hidden_size=null"]).model.ffn_hidden_size == 256
    assert parse_args(["model.ffn_hidden_size=null"]).model.ffn_hidden_size is None


@pytest.mark.parametrize("argv, fragment", [
    (["--no-such-flag"], "--no-such-flag"),
    (["--no-such-flag=3"], "--no-such-flag"),
    (["--tensor", "2"], "--tensor"),  # no abbreviations
    (["--num-layers", "abc"], "abc"),
    (["--num-layers"], "--num-layers"),
    (["--bf16=yes"], "--bf16"),
    (["model.num_layers=abc"], "abc"),
    (["model.no_such_key=1"], "no_such_key"),
    (["nosection.x=1"], "nosection"),
    (["+model.no_such_key=1"], "model.no_such_key"),  # '+' bypasses Hydra's struct check; caught by us
    (["model=no_such_model"], "gpt_tiny"),  # lists the available options
    (["optimizer.lr=[1"], "bad override"),
])
def test_errors_are_one_line_config_errors(argv, fragment):
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    message = str(info.value)
    assert fragment in message and "\n" not in message


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    for section, field in all_fields():
        assert "--" + field.name.replace("_", "-") in text
        assert f"(hydra: {section}.{field.name}; default: {field.default})" in text
    assert "wins over a Hydra override" in text


def test_group_files_only_set_values_that_differ_from_the_dataclasses():
    defaults = {section: cls() for section, cls in sections()}
    files = [p for p in CONFIGS.glob("*/*.yaml")]
    assert {p.parent.name for p in files} == set(defaults)
    for path in files:
        values = yaml.safe_load(path.read_text()) or {}
        for name, value in values.items():
            assert value != getattr(defaults[path.parent.name], name), f"{path}: {name} repeats the default"


def test_config_dir_env_var(tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text("defaults:\n  - megalite_schema\n  - _self_\nmodel:\n  num_layers: 7\n")
    monkeypatch.setenv(flags.CONFIG_DIR_ENV, str(tmp_path))
    assert parse_args([]).model.num_layers == 7
    monkeypatch.setenv(flags.CONFIG_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(ConfigError):
        parse_args([])


def test_config_to_dict_is_plain_and_nested():
    d = to_dict(parse_args(["--lr", "0.5"]))
    assert type(d) is dict and type(d["optimizer"]) is dict
    assert d["optimizer"]["lr"] == 0.5 and d["data"]["mock_data"] is False
    assert set(d) == {section for section, _ in sections()}


@pytest.mark.parametrize("argv, data_path, lr", [
    (["--data-path", "0.3", "a/b", "0.7", "c"], "0.3 a/b 0.7 c", None),                # Megatron's spelling
    (["--data-path", "A", "B", "model=gpt_tiny", "--lr", "2"], "A B", 2.0),           # stops at an override or flag
    (["--data-path=A", "B", "--lr=2"], "A B", 2.0),
    (["--data-path", "0.5 a=b 0.5 c"], "0.5 a=b 0.5 c", None),                         # '=' inside one quoted word
    (["data.data_path='0.3 A 0.7 B'"], "0.3 A 0.7 B", None),                           # the Hydra key: one string
    (["--lr", "2", "--data-path", "single"], "single", 2.0),
])
def test_data_path_takes_several_words(argv, data_path, lr):
    cfg = parse_args(argv)
    assert cfg.data.data_path == data_path
    assert lr is None or cfg.optimizer.lr == lr
    if "model=gpt_tiny" in argv:
        assert cfg.model.hidden_size == 64


def test_data_path_without_words_is_an_error():
    with pytest.raises(ConfigError, match="--data-path"):
        parse_args(["--data-path", "--lr", "1"])


def test_architecture_and_memory_flags():
    cfg = parse_args(["--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm",
                      "--swiglu", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
                      "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "2"])
    m = cfg.model
    assert (m.position_embedding_type, m.rotary_base, m.normalization, m.swiglu, m.group_query_attention,
            m.num_query_groups, m.disable_bias_linear) == ("rope", 500000, "RMSNorm", True, True, 2, True)
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "uniform", 2)
    assert cfg.parallel.sequence_parallel is True
    tiny = parse_args(["model=llama_tiny", "parallel.sequence_parallel=true", "model.recompute_granularity=selective"])
    assert (tiny.model.swiglu, tiny.model.query_groups, tiny.model.recompute_granularity) == (True, 2, "selective")
    assert tiny.parallel.sequence_parallel


def test_without_a_deepspeed_config_nothing_is_described(capsys):
    command_line = cli.parse_command_line(["--lr", "2"], world_size=4)
    assert command_line.deepspeed is None and command_line.deepspeed_settings() == []
    assert command_line.config == parse_args(["--lr", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "group YAML files < --deepspeed-config JSON < Hydra overrides < --flags" in help_text


def test_deepspeed_config_sits_between_yaml_and_overrides(tmp_path):
    # (the mapping itself is tested in tests/config/test_deepspeed.py)
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": 0.25, "steps_per_print": 3}')
    cfg = parse_args(["training.deepspeed_config=" + str(path), "optimizer.clip_grad=0.5"])
    assert (cfg.optimizer.clip_grad, cfg.logging.log_interval) == (0.5, 3)


def test_tool_errors_are_one_line(capsys):
    """A tool's OSError (an output its early checks could not foresee) is one line naming the file."""
    from megalite.config.tool import run_tool

    def work():
        open("/proc/no-such-dir/out", "w")

    assert run_tool("tool", work) == 2
    assert capsys.readouterr().err == "tool: error: /proc/no-such-dir/out: No such file or directory\n"
