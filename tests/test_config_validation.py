"""MoEReplayGRPOConfig refuses values that cannot be meant: NaN anywhere, inf in our own fields, unknown loss types."""

import math

import pytest

from trl_moe_replay import MoEReplayGRPOConfig
from trl_moe_replay.trainer.grpo_config import MOE_LOSS_TYPES, TRL_LOSS_TYPES


def config(**kwargs):
    return MoEReplayGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **kwargs)


OWN_FLOATS = ["extreme_token_threshold", "pr2_lr_multiplier", "minirl_is_cap", "router_shift_gamma_min", "epsilon",
              "epsilon_high"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", OWN_FLOATS)
def test_our_float_fields_must_be_finite(name, value):
    extra = {"loss_type": "minirl"} if name == "minirl_is_cap" else {}
    with pytest.raises(ValueError, match=f"{name} must be a finite number, got {value}"):
        config(**{name: value}, **extra)


@pytest.mark.parametrize("name", ["learning_rate", "beta", "temperature", "max_grad_norm", "top_p"])
def test_nan_is_refused_in_inherited_float_fields_too(name):
    with pytest.raises(ValueError, match=f"{name} is NaN"):
        config(**{name: math.nan})


def test_inherited_fields_keep_their_meaning_for_inf():
    # transformers computes (and logs) the gradient norm without clipping it when max_grad_norm is inf
    assert config(max_grad_norm=math.inf).max_grad_norm == math.inf


def test_unknown_loss_type_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="loss_type must be one of") as error:
        config(loss_type="bogus")
    for name in (*TRL_LOSS_TYPES, *MOE_LOSS_TYPES):
        assert repr(name) in str(error.value)
    for name in (*TRL_LOSS_TYPES, *MOE_LOSS_TYPES):  # and every valid name is accepted
        assert config(loss_type=name).loss_type == name


def test_trl_loss_types_are_the_ones_trl_documents():
    # TRL exposes no list; its GRPOConfig.loss_type help names them. Fails when a TRL upgrade adds or drops one.
    from dataclasses import fields

    from trl import GRPOConfig

    help_text = next(f.metadata["help"] for f in fields(GRPOConfig) if f.name == "loss_type")
    documented = help_text.split("Supported values are ", 1)[1].split(". ", 1)[0]
    names = [part.strip().removeprefix("and ").strip("'") for part in documented.split(",")]
    assert sorted(names) == sorted(TRL_LOSS_TYPES)
