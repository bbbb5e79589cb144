"""Drop-in for configs (issue 38): plain TRL's config and ours, built from the same values, accept the same values and
store the same values in TRL's and transformers' fields, through Python, ``TrlParser`` YAML and the command line.

The values: every field's default passed explicitly, the type edges users hit (paths, ``bool | str | list`` unions,
dataclass values transformers stores, ``None`` and 0 where they mean something, YAML scalars typed as int or date in a
str field), and the literal config arguments of TRL's own GRPO and async GRPO test files (tests/data/
trl_test_config_kwargs.json names the commit). Where ours refuses a value TRL takes, the refusal must be an entry of
``config_checks.UPSTREAM_REFUSALS`` (each with its reason), and the set of such refusals is pinned here, so a rule made
stricter -- inside or outside that list -- fails this file (the last tests show it does). Building configs only: no
model, no trainer."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.util
import json
import math
import pathlib
import sys
from dataclasses import MISSING

import numpy as np
import pytest
import yaml
from transformers.trainer_pt_utils import AcceleratorConfig
from trl import GRPOConfig, TrlParser
from trl.experimental.async_grpo import AsyncGRPOConfig

from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayGRPOConfig
from trl_moe_replay.core import config_checks
from trl_moe_replay.core.config_checks import UPSTREAM_REFUSALS, ConfigTypeError, UpstreamValueError
from trl_moe_replay.trainer import grpo_config
from trl_moe_replay.trainer.grpo_config import UnrecordableGenerationError


DATA = json.loads((pathlib.Path(__file__).parents[1] / "data" / "trl_test_config_kwargs.json").read_text())
SYNC, ASYNC = (MoEReplayGRPOConfig, GRPOConfig), (MoEReplayAsyncGRPOConfig, AsyncGRPOConfig)
PAIRS = [pytest.param(SYNC, id="sync"), pytest.param(ASYNC, id="async")]
# TRL's bf16 default asks for a GPU: both sides get the same fixed base.
BASE = dict(use_cpu=True, bf16=False, report_to="none")
# The drop-in promise is for routing_replay="none"; the default ("r3") is checked too, where the only refusals it may
# add are generation settings whose routes it cannot record (UnrecordableGenerationError), pinned in REPLAY_REFUSED.
REPLAY_MODES = [{"routing_replay": "none"}, {}]
REPLAY_REFUSED = {"use_transformers_continuous_batching", "generation_kwargs"}  # TRL's tests' values r3 refuses

# Values plain TRL takes and ours refuses, as (field, repr(value)): each is refused by an UPSTREAM_REFUSALS entry.
DOCUMENTED = {
    ("temperature", "0.0"),
    ("learning_rate", "nan"),
    ("learning_rate", "-1e-05"),
    ("max_steps", "2.5"),
    ("log_completions", "'no'"),
    ("num_iterations", "0"),
    ("reward_weights", "[nan]"),
    ("loss_type", "'bogus'"),
    ("top_p", "-0.5"),
    ("max_staleness", "-1"),
    ("temperature", "inf"),
    ("num_train_epochs", "0.0"),
    ("epsilon", "-0.1"),
    ("epsilon_high", "-0.1"),
    ("adam_beta1", "1.5"),
    ("adam_beta2", "1.0"),
    ("adam_epsilon", "-1e-08"),
    ("adam_epsilon", "0.0"),
    ("weight_decay", "-0.1"),
}


def documented_for(pair) -> set:
    names = {spec.name for spec in dataclasses.fields(pair[1])}
    return {entry for entry in DOCUMENTED if entry[0] in names}


# Type edges: (kwargs, command-line spelling or None). Values TRL takes and ours refuses are marked by DOCUMENTED.
EDGES = [
    ({"output_dir": pathlib.Path("out")}, None),
    ({"fsdp": True}, ["--fsdp", "true"]),
    ({"fsdp": ["full_shard"]}, ["--fsdp", "full_shard"]),
    ({"fsdp": "full_shard auto_wrap"}, ["--fsdp", "full_shard auto_wrap"]),
    ({"accelerator_config": AcceleratorConfig()}, None),
    ({"accelerator_config": {"dispatch_batches": True}}, ["--accelerator_config", '{"dispatch_batches": true}']),
    ({"epsilon": 0.3, "epsilon_high": 0.2}, ["--epsilon", "0.3", "--epsilon_high", "0.2"]),
    ({"epsilon_high": math.inf}, ["--epsilon_high", "inf"]),
    ({"max_steps": 0}, ["--max_steps", "0"]),
    ({"max_steps": -5}, ["--max_steps", "-5"]),
    ({"max_steps": np.int64(3)}, None),
    ({"debug": ["underflow_overflow"]}, ["--debug", "underflow_overflow"]),
    ({"debug": "underflow_overflow"}, None),
    ({"run_name": 2024}, ["--run_name", "2024"]),
    ({"run_name": datetime.date(2024, 1, 1)}, ["--run_name", "2024-01-01"]),
    ({"max_completion_length": None}, None),
    ({"num_generations": None}, None),
    ({"per_device_train_batch_size": True}, None),
    ({"scale_rewards": True}, None),
    ({"scale_rewards": False}, None),
    ({"max_grad_norm": math.inf}, ["--max_grad_norm", "inf"]),
    ({"warmup_steps": 0.1}, ["--warmup_steps", "0.1"]),
    ({"logging_steps": 0.5, "save_steps": 0.5}, ["--logging_steps", "0.5", "--save_steps", "0.5"]),
    ({"top_p": 0.0}, ["--top_p", "0"]),
    ({"top_p": 1.5}, ["--top_p", "1.5"]),  # transformers applies no top-p above 1
    ({"top_k": 0}, ["--top_k", "0"]),
    ({"beta": -0.1}, ["--beta", "-0.1"]),
    ({"vllm_importance_sampling_clip_max": None}, None),
    ({"gradient_checkpointing_kwargs": {"use_reentrant": False}}, None),
    ({"lr_scheduler_kwargs": '{"min_lr": 0.0}'}, ["--lr_scheduler_kwargs", '{"min_lr": 0.0}']),
    ({"model_init_kwargs": {"dtype": "float32"}}, None),
    ({"log_completions": "true"}, ["--log_completions", "yes"]),
    ({"report_to": ["none"]}, ["--report_to", "none"]),
    ({"dtype": "float64"}, None),  # the async config's; its choices bind the command line only
    ({"weight_sync_steps": 3, "max_staleness": 0}, ["--weight_sync_steps", "3", "--max_staleness", "0"]),
    # refused early: plain TRL takes them and fails later or runs silently wrong (UPSTREAM_REFUSALS)
    ({"temperature": 0.0}, ["--temperature", "0"]),
    ({"learning_rate": math.nan}, ["--learning_rate", "nan"]),
    ({"learning_rate": -1e-5}, ["--learning_rate", "-1e-5"]),
    ({"max_steps": 2.5}, None),
    ({"log_completions": "no"}, None),
    ({"num_iterations": 0}, ["--num_iterations", "0"]),
    ({"reward_weights": [math.nan]}, ["--reward_weights", "nan"]),
    ({"loss_type": "bogus"}, ["--loss_type", "bogus"]),
    ({"top_p": -0.5}, ["--top_p", "-0.5"]),
    ({"max_staleness": -1}, ["--max_staleness", "-1"]),
    # learns nothing (issue 42): uniform sampling, 0 steps, an inverted clip range
    ({"temperature": math.inf}, ["--temperature", "inf"]),
    ({"num_train_epochs": 0.0}, ["--num_train_epochs", "0"]),
    ({"epsilon": -0.1}, ["--epsilon", "-0.1"]),
    ({"epsilon_high": -0.1}, ["--epsilon_high", "-0.1"]),
    # torch's AdamW raises on these when the trainer builds it (issue 51), or turns weights NaN (an epsilon of 0)
    ({"adam_beta1": 1.5}, ["--adam_beta1", "1.5"]),
    ({"adam_beta2": 1.0}, ["--adam_beta2", "1.0"]),
    ({"adam_epsilon": -1e-8}, ["--adam_epsilon=-1e-8"]),
    ({"adam_epsilon": 0.0}, ["--adam_epsilon", "0"]),
    ({"weight_decay": -0.1}, ["--weight_decay", "-0.1"]),
    # ... but an optimizer that is no torch AdamW reads them otherwise or not at all: taken, as plain TRL takes them
    ({"optim": "sgd", "adam_beta1": 1.5, "adam_epsilon": 0.0}, ["--optim", "sgd", "--adam_beta1", "1.5"]),
    ({"adam_beta1": 0.0, "adam_beta2": 0.0}, ["--adam_beta1", "0", "--adam_beta2", "0"]),
]


# ------------------------------------------------------------------------------------------- building, both sides
@dataclasses.dataclass
class Outcome:
    config: object = None
    error: BaseException | None = None


def build_python(cls, kwargs) -> Outcome:
    try:
        return Outcome(cls(**{"output_dir": "out", **BASE, **kwargs}))
    except Exception as error:  # noqa: BLE001 -- the outcome is compared, whatever it is
        return Outcome(error=error)


@functools.cache
def parser_for(cls) -> TrlParser:
    return TrlParser((cls,))


def parse(cls, argv) -> Outcome:
    """``TrlParser((cls,)).parse_args_and_config(argv)``, on one parser per class (building one costs more than
    parsing): the defaults a config file sets on it are put back afterwards."""
    parser = parser_for(cls)
    saved = [(action, action.default, action.required) for action in parser._actions]
    try:
        (config,) = parser.parse_args_and_config(argv)
        return Outcome(config)
    except (Exception, SystemExit) as error:  # noqa: BLE001 -- argparse's refusals are SystemExit
        return Outcome(error=error)
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required


def build_yaml(cls, kwargs, tmp_path) -> Outcome | None:
    try:
        text = yaml.safe_dump({"output_dir": str(tmp_path / "out"), **BASE, **kwargs})
    except yaml.representer.RepresenterError:
        return None  # no YAML spelling (a Path, a dataclass)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return parse(cls, ["--config", str(path)])


def build_cli(cls, argv, tmp_path) -> Outcome:
    return parse(
        cls,
        ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--bf16", "false", "--report_to", "none", *argv],
    )


def to_argv(kwargs) -> list[str] | None:
    """The command line's spelling of ``kwargs``, or None where it has none (None, nested lists)."""
    argv = []
    for name, value in kwargs.items():
        if value is None:
            return None
        if isinstance(value, bool):
            argv += [f"--{name}", str(value).lower()]
        elif isinstance(value, dict):
            argv += [f"--{name}", json.dumps(value)]
        elif isinstance(value, list):
            if not value or any(isinstance(item, (list, dict)) for item in value):
                return None
            argv += [f"--{name}", *map(str, value)]
        else:
            argv += [f"--{name}", str(value)]
    return argv


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b) or repr(a) == repr(b)
    except Exception:  # noqa: BLE001 -- an object without a usable ==
        return repr(a) == repr(b)


@dataclasses.dataclass
class Differential:
    """What one comparison found: values refused by ours only under an UPSTREAM_REFUSALS entry (``documented``), and
    anything else that differs (``problems``)."""

    problems: list = dataclasses.field(default_factory=list)
    documented: set = dataclasses.field(default_factory=set)
    replay_refused: set = dataclasses.field(default_factory=set)
    both_built: int = 0  # comparisons where both sides built a config (so the stored values were compared)

    def compare(self, pair, ours: Outcome, theirs: Outcome, what: str, kwargs: dict, mode: dict) -> None:
        own, trl = pair
        if theirs.error is not None:
            if ours.error is None:
                self.problems.append(f"{own.__name__} takes what {trl.__name__} refuses: {what} ({theirs.error!r})")
            return
        if ours.error is not None:
            error = ours.error
            if (
                isinstance(error, UnrecordableGenerationError)
                and mode.get("routing_replay") != "none"
                and set(kwargs) & REPLAY_REFUSED
            ):
                self.replay_refused.update(set(kwargs) & REPLAY_REFUSED)
            elif isinstance(error, UpstreamValueError) and error.refusal in config_checks.UPSTREAM_REFUSALS:
                self.documented.add((error.field, repr(error.value)))
                assert error.refusal.covers(error.field, config_checks.field_types(trl).get(error.field))
                assert "\n" not in str(error) and str(error).startswith(error.field)
            else:
                self.problems.append(f"{own.__name__} refuses what {trl.__name__} takes: {what}: {error!r}")
            return
        self.both_built += 1
        for spec in dataclasses.fields(trl):
            if spec.init and not same(getattr(ours.config, spec.name), getattr(theirs.config, spec.name)):
                self.problems.append(
                    f"{what}: {spec.name} stored as {getattr(ours.config, spec.name)!r} by "
                    f"{own.__name__}, {getattr(theirs.config, spec.name)!r} by {trl.__name__}"
                )


def python_differential(pair, values, modes=REPLAY_MODES) -> Differential:
    found = Differential()
    own, trl = pair
    for kwargs in values:
        theirs = build_python(trl, kwargs)
        for mode in modes:
            found.compare(pair, build_python(own, {**kwargs, **mode}), theirs, f"{kwargs} {mode}", kwargs, mode)
    return found


def trl_test_values(pair) -> list[dict]:
    return DATA[pair[1].__name__]


def trl_test_pairs(pair) -> list[dict]:
    """Each distinct (field, value) of TRL's tests' configs alone: YAML and the command line type field by field,
    and the combinations are compared through Python."""
    distinct = {}
    for kwargs in trl_test_values(pair):
        for name, value in kwargs.items():
            distinct.setdefault(f"{name}={json.dumps(value, sort_keys=True)}", {name: value})
    return list(distinct.values())


def default_values(pair) -> list[dict]:
    """Each TRL/transformers field with its default passed explicitly."""
    values = []
    for spec in dataclasses.fields(pair[1]):
        if not spec.init or spec.name in ("output_dir", *BASE):
            continue
        default = spec.default if spec.default is not MISSING else spec.default_factory()
        values.append({spec.name: default})
    return values


def edge_values(pair) -> list[dict]:
    names = {spec.name for spec in dataclasses.fields(pair[1])}
    return [kwargs for kwargs, _ in EDGES if set(kwargs) <= names]


# ------------------------------------------------------------------------------------------- the differential
@pytest.mark.parametrize("pair", PAIRS)
def test_python_takes_and_stores_what_trl_does(pair):
    found = python_differential(pair, [{}] + default_values(pair) + edge_values(pair) + trl_test_values(pair))
    assert not found.problems, "\n".join(found.problems)
    assert found.documented == documented_for(pair)
    assert found.replay_refused == (REPLAY_REFUSED if pair is SYNC else set()) and found.both_built > 150


@pytest.mark.parametrize("pair", PAIRS)
def test_yaml_through_trl_parser_takes_and_stores_what_trl_does(pair, tmp_path):
    found = Differential()
    own, trl = pair
    # every default in one file (TRL's default config, spelled out), then each edge and each of TRL's tests' values
    defaults = {name: value for kwargs in default_values(pair) for name, value in kwargs.items()}
    for kwargs in [defaults] + edge_values(pair) + trl_test_pairs(pair):
        theirs = build_yaml(trl, kwargs, tmp_path)
        if theirs is None:
            continue
        for mode in REPLAY_MODES:
            found.compare(
                pair, build_yaml(own, {**kwargs, **mode}, tmp_path), theirs, f"YAML {kwargs} {mode}", kwargs, mode
            )
    assert not found.problems, "\n".join(found.problems)
    # YAML reads `no` as False, and TrlParser types a quoted number as the command line does: fewer refusals reach us
    assert ("temperature", "0.0") in found.documented and found.documented <= documented_for(pair)
    assert found.both_built > 40


@pytest.mark.parametrize("pair", PAIRS)
def test_yaml_scalars_that_parse_as_int_or_date_reach_a_str_field_as_on_trl(pair, tmp_path):
    own, trl = pair
    for text in ("run_name: 2024", "run_name: 2024-01-01", "hub_model_id: 1.5"):
        path = tmp_path / "config.yaml"
        path.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nbf16: false\nreport_to: none\n{text}\n")
        theirs, ours = parse(trl, ["--config", str(path)]), parse(own, ["--config", str(path)])
        name = text.split(":")[0]
        assert theirs.error is None and ours.error is None, (text, theirs.error, ours.error)
        assert getattr(ours.config, name) == getattr(theirs.config, name)


@pytest.mark.parametrize("pair", PAIRS)
def test_command_line_takes_and_stores_what_trl_does(pair, tmp_path):
    found = Differential()
    own, trl = pair
    argvs = [
        argv for kwargs, argv in EDGES if argv is not None and set(kwargs) <= {f.name for f in dataclasses.fields(trl)}
    ]
    argvs += [argv for argv in map(to_argv, trl_test_pairs(pair)) if argv is not None]
    argvs += [["--fsdp"]]  # the bare flag transformers documents
    for argv in argvs:
        theirs = build_cli(trl, argv, tmp_path)
        for mode in REPLAY_MODES:
            found.compare(
                pair,
                build_cli(own, argv + to_argv(mode), tmp_path),
                theirs,
                f"CLI {argv} {mode}",
                {arg[2:]: None for arg in argv if arg.startswith("--")},
                mode,
            )
    assert not found.problems, "\n".join(found.problems)
    assert ("temperature", "0.0") in found.documented and found.documented <= documented_for(pair)
    assert found.both_built > 40


@pytest.mark.parametrize("pair", PAIRS)
def test_a_built_config_copies_as_trl_s_does(pair):
    found = Differential()
    own, trl = pair
    for kwargs in [{}] + edge_values(pair) + trl_test_values(pair)[:20]:
        theirs, ours = build_python(trl, kwargs), build_python(own, {**kwargs, "routing_replay": "none"})
        if theirs.error is not None or ours.error is not None:
            continue
        for how, copy in (
            ("dataclasses.replace", dataclasses.replace),
            ("cls(**to_dict())", lambda c: type(c)(**c.to_dict())),
        ):
            copies = []
            for config in (ours.config, theirs.config):
                try:
                    copies.append(Outcome(copy(config)))
                except Exception as error:  # noqa: BLE001
                    copies.append(Outcome(error=error))
            found.compare(pair, *copies, f"{how} of {kwargs}", kwargs, {"routing_replay": "none"})
    assert not found.problems, "\n".join(found.problems)
    assert found.both_built > 40 or pair is SYNC  # TRL's GRPOConfig refuses its own copies (both batch sizes set)


SUBCLASS_MODULE = """
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trl import GRPOConfig
from trl.experimental.async_grpo import AsyncGRPOConfig

from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayGRPOConfig

if TYPE_CHECKING:
    from a_module_that_is_not_installed import Thing


@dataclass
class MySync(MoEReplayGRPOConfig):
    thing: Thing | None = field(default=None, metadata={"help": "a user's own field"})


@dataclass
class MyTRLSync(GRPOConfig):
    thing: Thing | None = field(default=None, metadata={"help": "a user's own field"})


@dataclass
class MyAsync(MoEReplayAsyncGRPOConfig):
    thing: Thing | None = None


@dataclass
class MyTRLAsync(AsyncGRPOConfig):
    thing: Thing | None = None
"""


def test_a_subclass_with_type_checking_annotations_builds_as_on_trl(tmp_path, monkeypatch):
    (tmp_path / "user_configs.py").write_text(SUBCLASS_MODULE)
    spec = importlib.util.spec_from_file_location("user_configs", tmp_path / "user_configs.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "user_configs", module)
    spec.loader.exec_module(module)
    for own, trl in ((module.MySync, module.MyTRLSync), (module.MyAsync, module.MyTRLAsync)):
        found = python_differential((own, trl), [{}, {"thing": object()}, {"max_steps": 0}])
        assert not found.problems, "\n".join(found.problems)
        assert build_python(own, {"routing_replay": "none"}).config.thing is None


# ------------------------------------------------------------------------------------------- it fails when too strict
def test_a_stricter_check_outside_the_list_fails_the_differential(monkeypatch):
    # the old rule: output_dir must be a str
    checked = grpo_config.check_config

    def old_rule(config, own_class):
        checked(config, own_class)
        if not isinstance(config.output_dir, str):
            raise ConfigTypeError(f"output_dir must be a str or None, got {config.output_dir!r}")

    monkeypatch.setattr(grpo_config, "check_config", old_rule)
    found = python_differential(SYNC, edge_values(SYNC))
    assert any("output_dir" in problem and "refuses what GRPOConfig takes" in problem for problem in found.problems)


def test_a_stricter_entry_in_the_list_fails_the_differential(monkeypatch):
    # the old max_steps rule again, now as a documented entry: the pinned set of documented refusals catches it
    stricter = config_checks.UpstreamRefusal(
        "max_steps",
        lambda name, annotation: name == "max_steps",
        lambda value: value == 0,
        "-1 or >= 1",
        "silently wrong: transformers reads it as 'use num_train_epochs'",
    )
    monkeypatch.setattr(config_checks, "UPSTREAM_REFUSALS", (stricter, *UPSTREAM_REFUSALS))
    found = python_differential(SYNC, edge_values(SYNC))
    assert found.documented - documented_for(SYNC) == {("max_steps", "0")}


def test_every_documented_refusal_gives_its_reason():
    for refusal in UPSTREAM_REFUSALS:
        assert refusal.reason.startswith(("TRL crashes later", "silently wrong")), refusal.fields
