"""One config standard (trainer/config_checks.py) for both configs and every way they are built: a table of fields x
bad values x entry paths (Python, YAML through TrlParser and the recipe, command line), a check that no field of
either config goes around the standard, and the refusals the configs add themselves (unknown loss types)."""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from trl import TrlParser

from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayGRPOConfig
from trl_moe_replay.trainer.config_checks import (
    ConfigTypeError,
    ConfigValueError,
    check_config_file,
    field_types,
    understood,
)
from trl_moe_replay.trainer.grpo_config import MOE_LOSS_TYPES, TRL_LOSS_TYPES

from .helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
SYNC, ASYNC = MoEReplayGRPOConfig, MoEReplayAsyncGRPOConfig
BOTH = (SYNC, ASYNC)
BASE = dict(use_cpu=True, bf16=False, report_to="none")


@pytest.fixture(scope="module")
def recipe():
    return load_script(ROOT / "recipes" / "grpo_r3.py", "grpo_r3_recipe")


@dataclasses.dataclass(frozen=True)
class Case:
    """A bad value for ``name`` in each of ``configs``; ``cli``: how the command line spells the same mistake (None:
    the command line's text cannot carry it, e.g. ``"yes"`` is a bool there, as HfArgumentParser reads it)."""

    name: str
    value: object
    error: type
    configs: tuple = BOTH
    cli: str | None = None

    def __str__(self):
        return f"{self.name}={self.value!r}"


CASES = [
    # ints stay ints: no float, no bool, no numeric text
    Case("max_steps", 2.5, ConfigTypeError, cli="2.5"),
    Case("max_steps", "3", ConfigTypeError),
    Case("per_device_train_batch_size", True, ConfigTypeError, cli="True"),
    Case("pr2_cached_tokens_per_sequence", 1.5, ConfigTypeError, configs=(SYNC,), cli="1.5"),
    Case("vllm_request_attempts", 1.5, ConfigTypeError, configs=(ASYNC,), cli="1.5"),
    Case("vllm_request_attempts", True, ConfigTypeError, configs=(ASYNC,), cli="True"),
    Case("max_staleness", "3", ConfigTypeError, configs=(ASYNC,)),
    Case("weight_sync_steps", "2", ConfigTypeError, configs=(ASYNC,)),
    # bools stay bools: "no" would be truthy
    Case("routing_metrics", "yes", ConfigTypeError, cli="maybe"),
    Case("vllm_sync_check", "no", ConfigTypeError, cli="maybe"),
    Case("replay_reference_model", "no", ConfigTypeError, configs=(SYNC,)),
    Case("log_completions", "no", ConfigTypeError),  # TRL's field
    Case("routing_metrics", 1, ConfigTypeError),
    # None only where optional; text only where a str is meant
    Case("extreme_token_threshold", None, ConfigTypeError),
    Case("vllm_sync_dir", 5, ConfigTypeError),
    Case("learning_rate", "fast", ConfigTypeError, cli="fast"),
    # finite floats
    Case("learning_rate", math.nan, ConfigValueError, cli="nan"),
    Case("learning_rate", math.inf, ConfigValueError, cli="inf"),
    Case("temperature", -math.inf, ConfigValueError, cli="-inf"),
    Case("extreme_token_threshold", math.nan, ConfigValueError, cli="nan"),
    Case("epsilon_high", math.inf, ConfigValueError, cli="inf"),
    Case("sync_check_tolerance", math.nan, ConfigValueError, configs=(ASYNC,), cli="nan"),
    Case("sync_check_tolerance", math.inf, ConfigValueError, configs=(ASYNC,), cli="inf"),
    Case("minirl_is_cap", math.inf, ConfigValueError, configs=(SYNC,), cli="inf"),
    # ranges where zero or a negative breaks the run or switches a check off
    Case("max_steps", 0, ConfigValueError, cli="0"),
    Case("max_steps", -2, ConfigValueError, cli="-2"),
    Case("learning_rate", -1e-5, ConfigValueError, cli="-1e-5"),
    Case("temperature", 0.0, ConfigValueError, cli="0"),
    Case("epsilon", -0.1, ConfigValueError, cli="-0.1"),
    Case("epsilon_high", -0.1, ConfigValueError, cli="-0.1"),
    Case("max_staleness", -1, ConfigValueError, configs=(ASYNC,), cli="-1"),
    Case("weight_sync_steps", 0, ConfigValueError, configs=(ASYNC,), cli="0"),
    Case("sync_check_tolerance", -0.01, ConfigValueError, configs=(ASYNC,), cli="-0.01"),
    Case("vllm_request_attempts", 0, ConfigValueError, configs=(ASYNC,), cli="0"),
    Case("num_generations", 0, ConfigValueError, cli="0"),
    Case("vllm_server_timeout", 0.0, ConfigValueError, cli="0"),
    Case("weight_sync_timeout", -5, ConfigValueError, configs=(ASYNC,), cli="-5"),
    Case("extreme_token_threshold", 1.0, ConfigValueError, cli="1.0"),
    Case("router_shift_gamma_min", 0.0, ConfigValueError, configs=(SYNC,), cli="0"),
    # choices
    Case("routing_replay", "r9", ValueError, cli="r9"),
    Case("dtype", "float64", ConfigValueError, configs=(ASYNC,)),  # HfArgumentParser's choices refuse it on the CLI
]
TABLE = [pytest.param(config, case, id=f"{config.__name__}-{case}") for case in CASES for config in case.configs]


def build(config, **kwargs):
    return config(**{"output_dir": "unused", **BASE, **kwargs})


def assert_one_line_naming(error, name):
    message = str(error)
    assert name in message and "\n" not in message, message


@pytest.mark.parametrize("config, case", TABLE)
def test_python_constructor_refuses(config, case):
    with pytest.raises(case.error) as error:
        build(config, **{case.name: case.value})
    assert_one_line_naming(error.value, case.name)


@pytest.mark.parametrize("config, case", [p for p in TABLE if not isinstance(p.values[1].value, str)])
def test_yaml_through_trl_parser_refuses(config, case, tmp_path):
    # a value that is no text reaches the config as YAML typed it (TrlParser hands it over as an argparse default)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), **BASE, case.name: case.value}))
    with pytest.raises(case.error) as error:
        TrlParser((config,)).parse_args_and_config(["--config", str(path)])
    assert_one_line_naming(error.value, case.name)


@pytest.mark.parametrize("config, case", [p for p in TABLE if p.values[1].cli is not None])
def test_command_line_refuses(config, case, tmp_path, capsys):
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", f"--{case.name}", case.cli]
    try:
        TrlParser((config,)).parse_args_and_config(argv)
    except case.error as error:  # text of the right type, a value out of range: the config's check
        assert_one_line_naming(error, case.name)
    except SystemExit as exit_:  # text HfArgumentParser cannot type (int("2.5")): argparse's own error
        assert exit_.code == 2 and f"--{case.name}" in capsys.readouterr().err
    else:
        pytest.fail(f"--{case.name} {case.cli} was accepted")


@pytest.mark.parametrize("case", [case for case in CASES if SYNC in case.configs], ids=str)
def test_the_recipe_refuses_yaml_and_command_line_in_one_line_before_any_work(recipe, case, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.setattr(recipe, "main", lambda *args: pytest.fail("the recipe went past parsing"))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({case.name: case.value}))
    for argv in (["--config", str(path)], None if case.cli is None else [f"--{case.name}", case.cli]):
        if argv is None:
            continue
        with pytest.raises(SystemExit) as exit_:
            recipe.run(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and case.name in lines[0], (argv, lines)


def test_yaml_text_reads_as_the_command_line_reads_it_outside_the_recipe(tmp_path):
    # plain TrlParser types a YAML string as command-line text: "no" is False there, never a truthy string
    path = tmp_path / "config.yaml"
    path.write_text("output_dir: out\nuse_cpu: true\nbf16: false\nvllm_sync_check: 'no'\nmax_staleness: '3'\n")
    (args,) = TrlParser((ASYNC,)).parse_args_and_config(["--config", str(path)])
    assert args.vllm_sync_check is False and args.max_staleness == 3


def test_the_recipe_takes_a_float_that_yaml_reads_as_text(recipe, tmp_path):
    # YAML 1.1 reads 1e-5 (no dot) as a string; TRL reads it as the float it means, and so does the recipe
    path = tmp_path / "config.yaml"
    path.write_text("learning_rate: 1e-5\nmax_steps: 3\nrouting_metrics: false\n")
    assert isinstance(yaml.safe_load(path.read_text())["learning_rate"], str)
    _, args, _ = recipe.parse_args(["--config", str(path)])
    assert (args.learning_rate, args.max_steps, args.routing_metrics) == (1e-5, 3, False)


def test_the_recipe_takes_one_text_for_a_list_field_as_trl_does(recipe, tmp_path):
    # TRL's ModelConfig takes `lora_target_modules: all-linear` (PEFT's keyword) as well as a list
    path = tmp_path / "config.yaml"
    path.write_text("use_peft: true\nlora_target_modules: all-linear\n")
    _, _, model_args = recipe.parse_args(["--config", str(path)])
    assert model_args.lora_target_modules == "all-linear"


def test_every_shipped_config_file_meets_the_standard(recipe):
    paths = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
    assert any("async" in path.stem for path in paths) and len(paths) > 4
    for path in paths:
        values = yaml.safe_load(path.read_text())
        if "async" in path.stem:  # examples/async_r3_cpu.py passes the file's values to the constructor
            check_config_file((ASYNC,), values, str(path))
            assert build(ASYNC, **{**values, "output_dir": "unused"}).routing_replay == values["routing_replay"]
        else:  # bf16 configs are for GPUs; --use_cpu lets TrainingArguments validate them here
            _, args, _ = recipe.parse_args(["--config", str(path), "--use_cpu", "true"])
            assert args.max_steps == values.get("max_steps", args.max_steps)


# ------------------------------------------------------------------------------------------- no field goes around
class NotAValue:
    """A value no annotation admits."""

    def __repr__(self):
        return "NotAValue()"


@pytest.mark.parametrize("config", BOTH, ids=lambda c: c.__name__)
def test_every_field_of_both_configs_is_checked(config):
    annotations = field_types(config)
    names = [spec.name for spec in dataclasses.fields(config) if spec.init]
    assert set(annotations) == set(names) and len(names) > 140  # ours and TRL's/transformers' inherited ones
    not_understood = {name: annotation for name, annotation in annotations.items() if not understood(annotation)}
    assert not not_understood  # an annotation the check cannot read would let its field through unchecked
    for name in names:
        with pytest.raises(ConfigTypeError, match=f"^{name} must be .*, got NotAValue NotAValue()"):
            build(config, **{name: NotAValue()})


@pytest.mark.parametrize("config", BOTH, ids=lambda c: c.__name__)
def test_defaults_and_numpy_scalars_are_accepted(config):
    built = build(config, max_steps=np.int64(3), learning_rate=np.float32(0.5), max_grad_norm=math.inf,
                  routing_metrics=np.bool_(True))
    assert type(built.max_steps) is int and type(built.learning_rate) is float and built.routing_metrics is True
    assert built.max_grad_norm == math.inf  # transformers logs the gradient norm without clipping it


def test_epsilon_high_below_the_loss_types_default_epsilon_is_refused():
    with pytest.raises(ConfigValueError, match=r"epsilon_high must be >= epsilon .* epsilon=0.0003 \(loss_type='gspo'"):
        build(SYNC, loss_type="gspo", epsilon_high=1e-4)
    assert build(SYNC, epsilon=0.2, epsilon_high=0.28).epsilon_high == 0.28
    with pytest.raises(ConfigValueError, match="epsilon_high must be >= epsilon"):
        build(ASYNC, epsilon=0.3, epsilon_high=0.2)


@pytest.mark.parametrize("config", BOTH, ids=lambda c: c.__name__)
def test_vllm_sync_dir_must_be_a_folder(config, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigValueError, match="vllm_sync_dir must be a folder .* which is a file"):
        build(config, vllm_sync_dir=str(tmp_path / "file"))
    assert build(config, vllm_sync_dir=str(tmp_path / "new")).vllm_sync_dir == str(tmp_path / "new")


# ------------------------------------------------------------------------------------------- loss types
def test_unknown_loss_type_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="loss_type must be one of") as error:
        build(SYNC, loss_type="bogus")
    for name in (*TRL_LOSS_TYPES, *MOE_LOSS_TYPES):
        assert repr(name) in str(error.value)
    for name in (*TRL_LOSS_TYPES, *MOE_LOSS_TYPES):  # and every valid name is accepted
        assert build(SYNC, loss_type=name).loss_type == name


def test_trl_loss_types_are_the_ones_trl_documents():
    # TRL exposes no list; its GRPOConfig.loss_type help names them. Fails when a TRL upgrade adds or drops one.
    from trl import GRPOConfig

    help_text = next(f.metadata["help"] for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type")
    documented = help_text.split("Supported values are ", 1)[1].split(". ", 1)[0]
    names = [part.strip().removeprefix("and ").strip("'") for part in documented.split(",")]
    assert sorted(names) == sorted(TRL_LOSS_TYPES)
