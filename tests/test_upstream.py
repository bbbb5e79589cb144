"""The versioned seam: every reliance on TRL beyond its public API is checked against the installed TRL."""

import pytest
import torch
import trl
from peft import LoraConfig, get_peft_model
from trl import GRPOTrainer

from trl_moe_replay import MoEReplayGRPOTrainer, upstream
from trl_moe_replay.routing import transformers_seam
from trl_moe_replay.routing.errors import TransformersChangedError
from trl_moe_replay.testing import tiny_moe_model
from trl_moe_replay.trainer.objectives import MoEObjectivesMixin

from .test_trainer import make_trainer


def test_the_installed_trl_is_inside_the_declared_range_and_matches_every_entry():
    from packaging.specifiers import SpecifierSet

    assert trl.__version__ in SpecifierSet(upstream.TRL_RANGE)
    assert all(trl.__version__ in versions for versions in upstream.VERIFIED_ON.values())
    assert upstream.check_trl() == ()


def test_the_declared_trl_range_is_the_one_in_pyproject():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    assert f"trl{upstream.TRL_RANGE}" in project["dependencies"]


def test_a_trl_lacking_a_public_api_we_call_is_reported(monkeypatch):
    """TRL 1.15.0 passes entries 1-14 but has no VLLMClient.get_server_info and no parse_response(tools=)."""
    from trl import chat_template_utils
    from trl.generation.vllm_client import VLLMClient

    monkeypatch.delattr(VLLMClient, "get_server_info")
    monkeypatch.setattr(chat_template_utils, "parse_response", lambda tokenizer, ids, prefix=None: None)
    findings = upstream.check_trl.__wrapped__(GRPOTrainer)
    assert entries(findings) == {"15"}
    assert {"get_server_info" in str(f) for f in findings} == {True, False}
    assert all("verified on TRL 1.16.0" in str(f) for f in findings)


def test_a_missing_method_is_a_finding_not_a_crash():
    class Changed(GRPOTrainer):
        _tool_call_loop = None  # as if TRL had removed it

    findings = upstream.check_trl.__wrapped__(Changed)
    assert any(f.entry == "14" and "_tool_call_loop does not exist" in f.problem for f in findings)


def test_a_decoder_stack_without_a_known_cache_keyword_is_refused_by_name():
    class Stack(torch.nn.Module):
        def forward(self, input_ids, kv_state=None):
            return input_ids

    with pytest.raises(TransformersChangedError, match=r"\[T1\] Stack.forward takes neither"):
        transformers_seam.check_stack_cache_keyword(Stack())
    assert transformers_seam.stack_cache({"cache": "c"}) == "c"
    assert transformers_seam.stack_cache({"past_key_values": "p"}) == "p"
    assert transformers_seam.stack_cache({"past_key_values": None}) is None


def test_a_router_returning_another_order_fails_by_entry_name():
    logits, weights, ids = torch.randn(3, 8), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long)
    assert transformers_seam.split_router_output((ids, weights, logits), True, "r")[2] is ids
    assert transformers_seam.split_router_output((logits, weights, ids), False, "r")[0] is logits
    with pytest.raises(TransformersChangedError, match=r"\[T2\] router layers.0.gate"):
        transformers_seam.split_router_output((ids, weights, logits), False, "layers.0.gate")
    assert transformers_seam.join_router_output((ids, weights, logits, "extra"), True, logits, weights, ids)[3] == "extra"


def test_every_trl_private_method_we_override_is_an_entry_of_the_seam():
    ours = {name for cls in (MoEReplayGRPOTrainer, MoEObjectivesMixin) for name in cls.__dict__}
    overridden_private = {
        name for name in ours
        if name.startswith("_") and not name.startswith("__") and callable(getattr(GRPOTrainer, name, None))
    }
    assert overridden_private <= set(upstream.OVERRIDDEN_METHODS), overridden_private - set(upstream.OVERRIDDEN_METHODS)


def entries(findings) -> set[str]:
    return {finding.entry for finding in findings}


def test_a_changed_signature_is_reported():
    class Changed(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, num_generations, images=None):  # parameters reordered
            raise AssertionError

    findings = [finding for finding in upstream.check_trl(Changed) if finding.entry == "1"]
    assert len(findings) == 1 and "_generate_single_turn" in str(findings[0])


def test_reading_the_old_logprobs_before_the_forward_is_reported():
    class Changed(GRPOTrainer):  # a TRL whose loss reads the old log-probs first: γ placed in the forward is lost
        def _compute_loss(self, model, inputs):
            old_per_token_logps = inputs.get("old_per_token_logps")
            per_token_logps, _, _ = self._get_per_token_logps_and_entropies(model, inputs["input_ids"], None, 1)
            log_ratio = per_token_logps - old_per_token_logps
            return log_ratio

    findings = upstream.check_trl(Changed)
    assert any(finding.entry == "5" and "after the training forward" in finding.problem for finding in findings)
    assert upstream.check_trl(GRPOTrainer) == ()


def test_an_engine_correction_keyed_on_another_flag_is_reported():
    class Changed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            self._generate(inputs)
            if self.use_sampler_logprobs and self.vllm_importance_sampling_correction:
                raise AssertionError

    findings = upstream.check_trl(Changed)
    assert any(finding.entry == "2" and "old-logprob pass" in finding.problem for finding in findings)


def test_the_trainer_refuses_to_build_on_a_trl_that_changed(tmp_path, monkeypatch):
    finding = upstream.Finding("5", "_compute_loss no longer reads inputs['old_per_token_logps'] after the forward")
    monkeypatch.setattr(upstream, "check_trl", lambda trainer_class=GRPOTrainer: (finding,))
    with pytest.raises(upstream.UpstreamChangedError, match=r"\[5\] _compute_loss no longer reads"):
        make_trainer(tmp_path, tiny_moe_model("qwen3_moe"))


def test_engine_logprob_correction_is_scoped_and_restored(tmp_path):
    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"))
    assert trainer.use_vllm is False
    with upstream.engine_logprob_correction(trainer, True):
        assert trainer.use_vllm is True
        with upstream.engine_logprob_correction(trainer, False):
            assert trainer.use_vllm is False
        assert trainer.use_vllm is True
    assert trainer.use_vllm is False
    with pytest.raises(RuntimeError), upstream.engine_logprob_correction(trainer, True):
        raise RuntimeError
    assert trainer.use_vllm is False


def test_reference_forward_is_told_by_the_model_and_the_adapter_state(tmp_path):
    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"))
    assert trainer.ref_model is None and not upstream.is_reference_forward(trainer, trainer.model)

    class FakeTrainer:  # a trainer with a separate reference model
        ref_model = torch.nn.Linear(1, 1)
        accelerator = trainer.accelerator

    assert upstream.is_reference_forward(FakeTrainer, FakeTrainer.ref_model)
    assert not upstream.is_reference_forward(FakeTrainer, trainer.model)

    peft_model = get_peft_model(tiny_moe_model("qwen3_moe"), LoraConfig(r=2, target_modules=["q_proj"]))

    class PeftTrainer:
        ref_model = None
        accelerator = trainer.accelerator

    assert not upstream.is_reference_forward(PeftTrainer, peft_model)
    with peft_model.disable_adapter():  # TRL's use_adapter(model, None): the reference forward
        assert upstream.is_reference_forward(PeftTrainer, peft_model)
    assert not upstream.is_reference_forward(PeftTrainer, peft_model)
    peft_model.add_adapter("ref", LoraConfig(r=2, target_modules=["q_proj"]))
    peft_model.set_adapter("ref")  # TRL's use_adapter(model, "ref") when re-training an existing adapter
    assert upstream.is_reference_forward(PeftTrainer, peft_model)
