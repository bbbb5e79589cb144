"""Offline test doubles, for this package's tests, the offline demo and users' own CI.

* :mod:`.tiny_models`: tiny seeded MoE (and dense) models of every supported family and a code-built tokenizer;
  nothing touches the Hugging Face Hub.
* :mod:`.fake_vllm`: stand-ins for vLLM built to its routed-experts contract (an HTTP server TRL's client talks to,
  a colocated ``LLM`` look-alike, malformed-payload fuzzing), backed by a transformers model.
* :mod:`.fake_sglang`: a stand-in for SGLang's ``/generate`` built to its routed-experts contract (docs/sglang.md).

Import from here: ``from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer, FakeVLLMServer``.
"""

from .fake_sglang import FakeSGLangServer, sglang_payload
from .fake_vllm import (
    CORRUPTIONS,
    NEVER_WRITTEN,
    EngineCompletion,
    FakeVLLMServer,
    RouteFuzzer,
    TransformersEngine,
    corrupt_route_payload,
    fake_colocated_vllm,
    trl_vllm_transport_stub,
)
from .tiny_models import (
    CHAT_TEMPLATE,
    TINY_CONFIGS,
    TINY_VOCAB,
    TINY_VOCAB_SIZE,
    TOOL_CHAT_TEMPLATE,
    scripted_generation,
    supported_model_types,
    tiny_dense_model,
    tiny_moe_model,
    tiny_tokenizer,
    unavailable_model_types,
)


__all__ = [
    "CHAT_TEMPLATE",
    "CORRUPTIONS",
    "NEVER_WRITTEN",
    "TINY_CONFIGS",
    "TINY_VOCAB",
    "TINY_VOCAB_SIZE",
    "TOOL_CHAT_TEMPLATE",
    "EngineCompletion",
    "FakeSGLangServer",
    "FakeVLLMServer",
    "RouteFuzzer",
    "TransformersEngine",
    "corrupt_route_payload",
    "fake_colocated_vllm",
    "scripted_generation",
    "sglang_payload",
    "supported_model_types",
    "tiny_dense_model",
    "tiny_moe_model",
    "tiny_tokenizer",
    "trl_vllm_transport_stub",
    "unavailable_model_types",
]
