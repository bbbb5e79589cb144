"""The config checks (core/config_checks.py) for both configs and every way they are built: a table of fields x bad
values x entry paths (Python, YAML through TrlParser and the recipe, command line) -- our own fields held to their
type and range, TRL's only by UPSTREAM_REFUSALS -- a check that none of our own fields goes around the standard, and
the "learns nothing" refusals. tests/cross_cutting/test_config_drop_in.py shows everything else TRL takes is taken."""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from trl import TrlParser

from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayGRPOConfig
from trl_moe_replay.core.config_checks import (
    ConfigTypeError,
    ConfigValueError,
    UpstreamValueError,
    check_config_file,
    field_types,
    own_field_types,
    understood,
)
from trl_moe_replay.trainer.grpo_config import MOE_LOSS_TYPES, TRL_LOSS_TYPES

from tests.helpers import load_script


ROOT = Path(__file__).resolve().parents[2]
SYNC, ASYNC = MoEReplayGRPOConfig, MoEReplayAsyncGRPOConfig
BOTH = (SYNC, ASYNC)
BASE = dict(use_cpu=True, bf16=False, report_to="none")


@pytest.fixture(scope="module")
def recipe():
    return load_script(ROOT / "recipes" / "grpo_r3.py", "grpo_r3_recipe")


@dataclasses.dataclass(frozen=True)
class Case:
    """A bad value for ``name`` in each of ``configs``; ``cli``: how the command line spells the same mistake (None:
    the command line's text cannot carry it, e.g. ``"yes"`` is a bool there, as HfArgumentParser reads it);
    ``in_file``: whether a YAML file can carry it (text for TRL's fields is typed by TrlParser, as plain TRL types it).
    """

    name: str
    value: object
    error: type
    configs: tuple = BOTH
    cli: str | None = None
    in_file: bool = True

    def __str__(self):
        return f"{self.name}={self.value!r}"


CASES = [
    # our ints stay ints: no float, no bool, no numeric text
    Case("pr2_cached_tokens_per_sequence", 1.5, ConfigTypeError, configs=(SYNC,), cli="1.5"),
    Case("pr2_cached_tokens_per_sequence", "16", ConfigTypeError, configs=(SYNC,)),
    Case("vllm_request_attempts", 1.5, ConfigTypeError, configs=(ASYNC,), cli="1.5"),
    Case("vllm_request_attempts", True, ConfigTypeError, configs=(ASYNC,), cli="True"),
    # our bools stay bools: "no" would be truthy
    Case("routing_metrics", "yes", ConfigTypeError, cli="maybe"),
    Case("vllm_sync_check", "no", ConfigTypeError, cli="maybe"),
    Case("replay_reference_model", "no", ConfigTypeError, configs=(SYNC,)),
    Case("routing_metrics", 1, ConfigTypeError),
    # None only where optional; text only where a str is meant
    Case("extreme_token_threshold", None, ConfigTypeError),
    Case("vllm_sync_dir", 5, ConfigTypeError),
    # our floats are finite
    Case("extreme_token_threshold", math.nan, ConfigValueError, cli="nan"),
    Case("sync_check_tolerance", math.nan, ConfigValueError, configs=(ASYNC,), cli="nan"),
    Case("sync_check_tolerance", math.inf, ConfigValueError, configs=(ASYNC,), cli="inf"),
    Case("minirl_is_cap", math.inf, ConfigValueError, configs=(SYNC,), cli="inf"),
    # our ranges
    Case("sync_check_tolerance", -0.01, ConfigValueError, configs=(ASYNC,), cli="-0.01"),
    Case("vllm_request_attempts", 0, ConfigValueError, configs=(ASYNC,), cli="0"),
    Case("extreme_token_threshold", 1.0, ConfigValueError, cli="1.0"),
    Case("router_shift_gamma_min", 0.0, ConfigValueError, configs=(SYNC,), cli="0"),
    Case("routing_replay", "r9", ValueError, cli="r9"),
    # TRL's and transformers' fields: only UPSTREAM_REFUSALS (plain TRL fails on these later, or runs silently wrong)
    Case("max_steps", 2.5, UpstreamValueError, cli="2.5"),
    Case("max_steps", "3", UpstreamValueError, in_file=False),  # a file's "3" is typed as the command line's 3
    Case("log_completions", "no", UpstreamValueError, in_file=False),  # a file's 'no' is False, as on the CLI
    Case("learning_rate", math.nan, UpstreamValueError, cli="nan"),
    Case("learning_rate", math.inf, UpstreamValueError, cli="inf"),
    Case("learning_rate", -1e-5, UpstreamValueError, cli="-1e-5"),
    Case("temperature", -math.inf, UpstreamValueError, cli="-inf"),
    Case("temperature", 0.0, UpstreamValueError, cli="0"),
    Case("top_p", -0.5, UpstreamValueError, cli="-0.5"),
    Case("num_generations", 0, ValueError, cli="0"),
    Case("num_iterations", 0, UpstreamValueError, configs=(SYNC,), cli="0"),
    Case("reward_weights", [1.0, math.inf], UpstreamValueError, configs=(SYNC,)),
    Case("loss_type", "bogus", UpstreamValueError, configs=(SYNC,), cli="bogus"),
    Case("max_staleness", -1, UpstreamValueError, configs=(ASYNC,), cli="-1"),
    Case("weight_sync_steps", 0, UpstreamValueError, configs=(ASYNC,), cli="0"),
    # learns nothing (issue 42): uniform sampling and no gradient; an inverted clip range
    Case("temperature", math.inf, UpstreamValueError, cli="inf"),
    Case("epsilon", -0.2, UpstreamValueError, cli="-0.2"),
    Case("epsilon_high", -0.1, UpstreamValueError, cli="-0.1"),
    # our correction (R3 on transformers generate, TRL's default sequence_mask): a bound that excludes ratio 1
    Case("vllm_importance_sampling_clip_max", 0.5, ConfigValueError, configs=(SYNC,), cli="0.5"),
    Case("vllm_importance_sampling_clip_min", 1.5, ConfigValueError, configs=(SYNC,), cli="1.5"),
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
def test_the_recipe_refuses_yaml_and_command_line_in_one_line_before_any_work(
    recipe, case, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(recipe, "main", lambda *args: pytest.fail("the recipe went past parsing"))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({case.name: case.value}))
    for argv in (
        ["--config", str(path)] if case.in_file else None,
        None if case.cli is None else [f"--{case.name}", case.cli],
    ):
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


# ------------------------------------------------------------------------------------------- no own field goes around
class NotAValue:
    """A value no annotation admits."""

    def __repr__(self):
        return "NotAValue()"


@pytest.mark.parametrize("config", BOTH, ids=lambda c: c.__name__)
def test_every_own_field_of_both_configs_is_checked(config):
    annotations = own_field_types(config)
    assert "routing_replay" in annotations and "max_steps" not in annotations and "loss_type" not in annotations
    assert set(annotations) < set(field_types(config)) and len(annotations) >= 9
    not_understood = {name: annotation for name, annotation in annotations.items() if not understood(annotation)}
    assert not not_understood  # an annotation the check cannot read would let its field through unchecked
    for name in annotations:
        with pytest.raises(ConfigTypeError, match=f"^{name} must be .*, got NotAValue NotAValue()"):
            build(config, **{name: NotAValue()})


@pytest.mark.parametrize("config", BOTH, ids=lambda c: c.__name__)
def test_numpy_scalars_become_python_numbers_in_our_fields_and_stay_as_given_in_trls(config):
    built = build(
        config,
        max_steps=np.int64(3),
        learning_rate=np.float32(0.5),
        max_grad_norm=math.inf,
        routing_metrics=np.bool_(True),
        extreme_token_threshold=np.float32(3.0),
    )
    assert built.routing_metrics is True and type(built.extreme_token_threshold) is float
    assert built.max_steps == 3 and isinstance(built.max_steps, np.int64)  # as plain TRL stores it
    assert built.max_grad_norm == math.inf  # transformers logs the gradient norm without clipping it


def test_an_asymmetric_or_unbounded_clip_range_is_taken_as_trl_takes_it():
    assert build(SYNC, epsilon=0.3, epsilon_high=0.2).epsilon_high == 0.2  # [0.7, 1.2]
    assert build(ASYNC, epsilon=0.3, epsilon_high=0.2).epsilon_high == 0.2
    assert build(SYNC, loss_type="gspo", epsilon_high=1e-4).epsilon == 3e-4  # the loss type's default ε, user's ε_high
    assert build(SYNC, epsilon_high=math.inf).epsilon_high == math.inf  # no upper clip


@pytest.mark.parametrize("config", BOTH, ids=lambda c: c.__name__)
def test_vllm_sync_dir_must_be_a_folder(config, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigValueError, match="vllm_sync_dir must be a folder .* which is a file"):
        build(config, vllm_sync_dir=str(tmp_path / "file"))
    assert build(config, vllm_sync_dir=str(tmp_path / "new")).vllm_sync_dir == str(tmp_path / "new")
    assert build(config, vllm_sync_dir=tmp_path / "new").vllm_sync_dir == str(tmp_path / "new")  # a Path, as text


# ------------------------------------------------------------------------------------------- learns nothing
@pytest.mark.parametrize(
    "mode, bound",
    [
        ("sequence_mask", {"vllm_importance_sampling_clip_max": -1.0}),  # every ratio above it: every token masked
        ("token_mask", {"vllm_importance_sampling_clip_max": 0.0}),
        ("token_truncate", {"vllm_importance_sampling_clip_max": 0.0}),  # every ratio clamped to 0
        ("sequence_truncate", {"vllm_importance_sampling_clip_max": -1.0}),  # every ratio -1: the gradient reversed
        ("sequence_mask", {"vllm_importance_sampling_clip_min": math.inf, "vllm_importance_sampling_clip_max": None}),
    ],
)
def test_a_correction_bound_that_leaves_no_gradient_is_refused_only_with_our_correction_on(mode, bound):
    kwargs = dict(vllm_importance_sampling_mode=mode, **bound)
    name = next(iter(bound))
    with pytest.raises(
        ConfigValueError, match=f"^{name} must be .* transformers_importance_sampling_correction is on"
    ):
        build(SYNC, **kwargs)  # R3 on transformers generate: our correction is on by default
    with pytest.raises(ConfigValueError, match=name):
        build(
            SYNC, loss_type="grpo", transformers_importance_sampling_correction=True, routing_replay="none", **kwargs
        )
    # plain TRL trains with these bounds there (its correction is off on the transformers path): so does ours when off
    for off in (
        dict(routing_replay="none"),
        dict(transformers_importance_sampling_correction=False),
        dict(loss_type="minirl", epsilon_high=None),
        dict(loss_type="vespo"),
    ):
        if off.get("loss_type") == "minirl" and "truncate" in mode:
            continue
        if off.get("loss_type") == "vespo" and "mask" in mode:
            continue  # vespo's weight of a zeroed ratio is about 1e-15: refused (the next test)
        assert getattr(build(SYNC, **kwargs, **off), name) == bound[name]


@pytest.mark.parametrize(
    "mode, bound",
    [
        ("sequence_mask", {"vllm_importance_sampling_clip_max": 0.5}),  # TRL's default mode (issue 42's three cases)
        ("sequence_mask", {"vllm_importance_sampling_clip_min": 1.5}),
        ("token_mask", {"vllm_importance_sampling_clip_max": 0.9}),
        ("token_mask", {"vllm_importance_sampling_clip_min": 1.01, "vllm_importance_sampling_clip_max": None}),
    ],
)
@pytest.mark.parametrize("loss", ["dapo", "vespo"])
def test_a_masking_bound_that_excludes_ratio_1_is_refused_with_our_correction_on(mode, bound, loss):
    # every ratio is about 1 on the transformers path: the mask zeroes every on-policy token
    name = next(iter(bound))
    kwargs = dict(vllm_importance_sampling_mode=mode, loss_type=loss, **bound)
    with pytest.raises(
        ConfigValueError, match=f"^{name} must be [<>]= 1 .*a bound which excludes ratio 1 cuts every on-policy token"
    ) as error:
        build(SYNC, **kwargs)
    assert "\n" not in str(error.value) and f"got {bound[name]}" in str(error.value)
    for mode_replay in ("r2", "pr2"):  # every mode that turns our correction on
        with pytest.raises(ConfigValueError, match=name):
            build(SYNC, routing_replay=mode_replay, **kwargs)
    assert getattr(build(SYNC, routing_replay="none", **kwargs), name) == bound[name]  # plain TRL: correction off


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=1.0),  # 1 is inside
        dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=1.0),
        dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=0.5),  # scales, learns
        dict(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_min=1.5),
        dict(
            vllm_importance_sampling_mode="token_mask",
            vllm_importance_sampling_clip_max=0.5,
            loss_type="minirl",
            epsilon_high=None,
        ),  # minirl weights by minirl_is_cap, not TRL's ratio
    ],
    ids=lambda kwargs: ",".join(f"{k}={v}" for k, v in kwargs.items()),
)
def test_a_bound_that_keeps_ratio_1_or_only_scales_it_is_taken(kwargs):
    built = build(SYNC, **kwargs)
    assert built.transformers_importance_sampling_correction is True
    assert all(getattr(built, name) == value for name, value in kwargs.items() if name != "epsilon_high")


@pytest.mark.parametrize("config", BOTH, ids=lambda c: c.__name__)
def test_zero_epochs_without_max_steps_is_refused_on_every_path(config, tmp_path, capsys):
    # transformers (and TRL's async trainer) train ceil(num_train_epochs x steps per epoch) steps when max_steps <= 0
    match = "^num_train_epochs must be > 0 while max_steps <= 0 .*silently wrong: .* 0 steps"
    for epochs, steps in ((0, -1), (-1.0, -1), (0.0, 0)):
        with pytest.raises(UpstreamValueError, match=match):
            build(config, num_train_epochs=epochs, max_steps=steps)
    assert build(config, num_train_epochs=0, max_steps=5).max_steps == 5  # max_steps sets the length: taken
    assert build(config, num_train_epochs=0.01).num_train_epochs == 0.01  # ceil: at least one step
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), **BASE, "num_train_epochs": 0}))
    with pytest.raises(UpstreamValueError, match=match):
        TrlParser((config,)).parse_args_and_config(["--config", str(path)])
    with pytest.raises(UpstreamValueError, match=match):
        TrlParser((config,)).parse_args_and_config(
            ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--num_train_epochs", "0"]
        )


def test_the_recipe_refuses_zero_epochs_without_max_steps_in_one_line(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(recipe, "main", lambda *args: pytest.fail("the recipe went past parsing"))
    path = tmp_path / "config.yaml"
    path.write_text("num_train_epochs: 0\nmax_steps: -1\n")
    for argv in (["--config", str(path)], ["--num_train_epochs", "0", "--max_steps", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            recipe.run(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and "num_train_epochs must be > 0" in lines[0], lines
    _, args, _ = recipe.parse_args(["--num_train_epochs", "0"])  # the recipe's max_steps sets the length
    assert args.max_steps == recipe.OFFLINE_DEFAULTS["max_steps"] > 0


def test_the_trainer_refuses_a_zero_gradient_bound_in_a_plain_trl_config_too(tmp_path):
    # the same check on the trainer's path: a plain GRPOConfig (our defaults: R3, correction on) reaches it there
    from trl import GRPOConfig

    from trl_moe_replay import MoEReplayGRPOTrainer
    from trl_moe_replay.testing import tiny_moe_model

    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", vllm_importance_sampling_clip_max=0.5
    )
    with pytest.raises(ConfigValueError, match="vllm_importance_sampling_clip_max must be >= 1"):
        MoEReplayGRPOTrainer(
            model=tiny_moe_model("qwen3_moe"), reward_funcs=lambda completions, **kw: [0.0], args=args
        )


# ------------------------------------------------------------------------------------------- loss types
def test_unknown_loss_type_is_refused_with_the_valid_names():
    with pytest.raises(UpstreamValueError, match="loss_type must be one of .*'Unknown loss type'") as error:
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


# ------------------------------------------------------------------------------------------- the recipe's ModelConfig
@pytest.mark.parametrize(
    "text, name",
    [
        ("use_peft: true\nlora_r: 4.5\n", "lora_r"),
        ("use_peft: true\nlora_r: 0\n", "lora_r"),
        ("use_peft: true\nlora_dropout: 1.5\n", "lora_dropout"),
        ("model_name_or_path: some/model\ndtype: float8\n", "dtype"),
    ],
)
def test_the_recipe_refuses_model_values_trl_would_fail_on_in_one_line(recipe, text, name, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        recipe.parse_args(["--config", str(path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and f"{name} must be" in lines[0], lines


def test_the_recipe_takes_model_values_trl_takes(recipe, tmp_path):
    # a float alpha scales the adapter; LoRA fields without use_peft and dtype without a model are unused, as in TRL
    path = tmp_path / "config.yaml"
    path.write_text("use_peft: true\nlora_alpha: 8.5\nlora_dropout: 0\n")
    assert recipe.parse_args(["--config", str(path)])[2].lora_alpha == 8.5
    path.write_text("lora_r: 4.5\n")
    assert recipe.parse_args(["--config", str(path)])[2].lora_r == 4.5


def test_a_cispo_cap_of_zero_is_refused_and_zero_elsewhere_is_taken():
    """CISPO weights each token by min(ratio, epsilon_high): a cap of 0 (set, or inherited from epsilon=0) leaves no
    gradient; 0 under another loss, or epsilon=0 beside a positive cap, learns (the async config has no loss_type)."""
    config = SYNC
    with pytest.raises(UpstreamValueError, match=r"^epsilon_high must be > 0 under loss_type='cispo', got float 0\.0"):
        build(config, loss_type="cispo", epsilon_high=0.0)
    with pytest.raises(UpstreamValueError, match=r"^epsilon must be > 0 under loss_type='cispo' without epsilon_high"):
        build(config, loss_type="cispo", epsilon=0.0, epsilon_high=None)
    assert build(config, loss_type="cispo", epsilon=0.0, epsilon_high=5.0).epsilon_high == 5.0
    assert build(config, loss_type="dapo", epsilon_high=0.0).epsilon_high == 0.0  # [1 - eps, 1]: 1 is inside
