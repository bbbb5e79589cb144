"""Tiny offline MoE models and a tokenizer, for tests, the offline demo and users' own CI.

Nothing here touches the Hugging Face Hub: models are built from configs with random (seeded) weights and the
tokenizer is built from code. ``tiny_moe_model("qwen3_moe")`` takes the ``model_type`` strings of transformers.
"""

from __future__ import annotations

import contextlib
import string
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)


# ----------------------------------------------------------------------------- tokenizer
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]
# Whole-word tokens for the chat roles and the answer format; everything else is one printable character a token.
WORD_TOKENS = ["system", "user", "assistant", "\\boxed{"]
CHAR_TOKENS = list(string.digits + string.ascii_letters + string.punctuation + " \n")
# With tools=True, the tool-call markup is whole words too (real tokenizers spend one or a few tokens on each): it
# halves the length of a character-level tool-calling rollout. Last in the vocabulary, so the other ids never move.
TOOL_WORD_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", '"name": ', '"arguments": ']
TINY_VOCAB = SPECIAL_TOKENS + WORD_TOKENS + CHAR_TOKENS + TOOL_WORD_TOKENS
TINY_VOCAB_SIZE = 128  # len(TINY_VOCAB) rounded up, so models leave room for a few added tokens
PAD_ID, BOS_ID, EOS_ID = 0, 1, TINY_VOCAB.index("<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# A compact ChatML template that renders tool calls the way Qwen3's does (``<tool_call>\n{json}\n</tool_call>``, tool
# results inside ``<tool_response>``), so TRL's Qwen3 response parser reads them; the system line only names the
# tools (Qwen3's full JSON schema would make a character-level prompt hundreds of tokens long).
TOOL_CHAT_TEMPLATE = (  # one line of Jinja, no stray whitespace, so no whitespace control is needed
    "{% if tools %}<|im_start|>system\nTools:"
    "{% for t in tools %} {{ t.function.name if t.function is defined else t.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in (m.tool_calls or []) %}<tool_call>\n{{ (tc.function if tc.function is defined else tc) | tojson }}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(tools: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (plus role words and ``\\boxed{``) with a ChatML chat template.

    Round-trips any printable ASCII text exactly, pads on the left, ends assistant turns with ``<|im_end|>``
    (its ``eos_token``), and works as TRL's ``processing_class``. ``tools=True``: a template that renders tool
    calls and results (:data:`TOOL_CHAT_TEMPLATE`) and TRL's Qwen3 response parser, for ``GRPOTrainer(tools=...)``,
    and one token for each piece of tool-call markup (:data:`TOOL_WORD_TOKENS`).
    """
    words = "|".join(Regex_escape(w) for w in (WORD_TOKENS + TOOL_WORD_TOKENS if tools else WORD_TOKENS))
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(TINY_VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(f"{words}|.|\\n"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate pieces verbatim: exact round trip, no inserted spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<eos>"],
        padding_side="left",
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if tools:
        from ..upstream import qwen3_template

        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
        tokenizer.response_template = qwen3_template
    return tokenizer


def Regex_escape(text: str) -> str:  # noqa: N802 - mirrors re.escape for the tokenizers regex dialect
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in text)


# ----------------------------------------------------------------------------- models
_COMMON: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)

# DeepSeek-V3.2's sparse-attention architecture (MLA + the DSA indexer), which GLM-MoE-DSA shares: one tiny config.
_DSA: dict[str, Any] = dict(
    intermediate_size=64,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    mlp_layer_types=["dense", "sparse"],
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    num_key_value_heads=4,
    index_topk=64,
    index_head_dim=16,
    index_n_heads=2,
)

# Per-family settings on top of _COMMON: 8 experts, top-2, small expert MLPs.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16),
    "qwen3_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        head_dim=16,
    ),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "qwen2_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen3_next": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
    ),
    "deepseek_v3": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
    "gpt_oss": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=16),
    # Further families (routers.py): a dense first layer wherever the family has dense layers (the option is
    # first_k_dense_replace, mlp_layer_types, mlp_only_layers, num_dense_layers, layers_block_type or
    # expert_layer_offset), so there is always at least one MoE layer.
    "flex_olmo": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "mellum": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        mlp_layer_types=["dense", "sparse"],
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=16,
    ),
    "qwen4_exp_text": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
        hc_count=2,
        hc_lowrank=8,
        ple_embed_dim=16,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=64,
        indexer_compress_ratio=4,
    ),
    "aria_text": dict(intermediate_size=32, moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1, head_dim=16),
    "dots1": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        head_dim=16,
    ),
    "dots3_note_text": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_experts_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=16,
        num_key_value_heads=4,
        index_topk=64,
        index_head_dim=16,
        index_n_heads=2,
        layer_types=["sliding_attention", "sliding_attention"],
        sliding_window=16,
        per_layer_config=None,
    ),
    "glm4_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        head_dim=16,
    ),
    "glm4_moe_lite": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
    "glm_moe_dsa": _DSA,
    "deepseek_v32": _DSA,
    "exaone_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        n_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
    ),
    "mimo_v2_flash": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
        head_dim=16,
        v_head_dim=16,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=16,
    ),
    "nemotron_h": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        layers_block_type=["full_attention", "moe"],
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
    ),
    "axk1": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
    "axk2": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        num_key_value_heads=4,
        index_topk=64,
        index_head_dim=16,
        index_n_heads=2,
        gated_norm_rank=8,
    ),
    "bailing_hybrid": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        num_expert_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=16,
        linear_head_dim=16,
        linear_num_heads=4,
        layer_types=["linear_attention", "full_attention"],
        layer_group_size=2,
        num_nextn_predict_layers=0,
    ),
    "hy_v4": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=16,
        num_key_value_heads=4,
        index_topk=64,
        index_head_dim=16,
        index_n_heads=2,
    ),
    "kimi_linear": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        num_expert_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        linear_head_dim=16,
        linear_num_heads=4,
        layer_types=["linear_attention", "full_attention"],
    ),
    "solar_open": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        head_dim=16,
    ),
    "deepseek_v2": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
    "qwen3_5_moe_text": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
    ),
    "jamba": dict(
        intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,
        attn_layer_offset=0,
        mamba_d_state=8,
        mamba_dt_rank=8,
    ),
    "granitemoe": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "granitemoeshared": dict(
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
    ),
    "granitemoehybrid": dict(
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        layer_types=["mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_state=16,
        mamba_d_head=32,
        mamba_chunk_size=16,
    ),
    "granitemoe_swa": dict(
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=16,
    ),
    "cohere2_moe": dict(
        intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        mlp_layer_types=["sparse", "sparse"],
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
    ),
    "lfm2_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        use_expert_bias=False,
        num_dense_layers=1,
        layer_types=["conv", "full_attention"],
    ),
    "minimax_m3_vl_text": dict(
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        dense_intermediate_size=64,
        shared_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"],
        head_dim=16,
        rotary_dim=8,
        layer_types=["full_attention", "full_attention"],
    ),
    "laguna": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_layer_types=["dense", "sparse"],
        head_dim=16,
        num_attention_heads_per_layer=[4, 4],
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=16,
    ),
    "flint": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        head_dim=16,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=16,
    ),
    "kolibri1": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
    ),
    "beam": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        mlp_layer_types=["dense", "sparse"],
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
    ),
    "deepseek_v4": dict(
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        mlp_layer_types=["moe", "moe"],
        head_dim=32,
        q_lora_rank=32,
        num_key_value_heads=1,
        qk_rope_head_dim=8,
        o_groups=2,
        o_lora_rank=16,
        layer_types=["sliding_attention", "sliding_attention"],
        sliding_window=16,
        num_nextn_predict_layers=0,
    ),
}


def supported_model_types() -> list[str]:
    """The model types with a tiny config that the installed transformers can replay (see
    :func:`unavailable_model_types` for the others)."""
    return sorted(set(TINY_CONFIGS) - set(unavailable_model_types()))


def unavailable_model_types() -> dict[str, str]:
    """Tiny-config model types whose router class the installed transformers predates: ``{model_type: the
    transformers version they need}``. Routing replay refuses them (``TransformersTooOldError``)."""
    from packaging.version import Version

    from ..routing.routers import min_transformers_for
    from ..upstream.transformers_seam import transformers_version

    installed = Version(transformers_version())
    needed = {model_type: min_transformers_for(model_type) for model_type in TINY_CONFIGS}
    return {t: v for t, v in sorted(needed.items()) if v is not None and installed < Version(v)}


def tiny_moe_model(
    model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides: Any
) -> PreTrainedModel:
    """A tiny random MoE causal LM of the given transformers ``model_type`` (seeded, offline, eval mode).

    Defaults: hidden 64, 2 layers, 8 experts, top-2, the vocabulary of ``tiny_tokenizer()``. Any config field can
    be overridden, e.g. ``tiny_moe_model("qwen3_moe", num_experts=64, num_experts_per_tok=8)``.
    """
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for model_type {model_type!r}; available: {supported_model_types()}")
    import transformers
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:  # a family newer than the installed transformers
        raise ValueError(
            f"transformers {transformers.__version__} does not know model_type {model_type!r}; it needs transformers "
            f">= {unavailable_model_types().get(model_type, '(a newer release)')}"
        )
    settings = {**_COMMON, **TINY_CONFIGS[model_type], **config_overrides}
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    _make_routing_nontrivial(model, seed)
    model.generation_config = GenerationConfig(
        pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id
    )
    return model.to(dtype).eval()


def tiny_dense_model(model_type: str = "qwen3", *, seed: int = 0, **config_overrides: Any) -> PreTrainedModel:
    """A tiny random dense causal LM (no experts) with the same vocabulary and sizes as :func:`tiny_moe_model`:
    what ``routing_replay="none"`` must train exactly like ``trl.GRPOTrainer``."""
    settings = {**_COMMON, "intermediate_size": 64, "head_dim": 16, **config_overrides}
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id
    )
    return model.eval()


def _make_routing_nontrivial(model: PreTrainedModel, seed: int) -> None:
    """Some routers start at zero (all experts tie): give them small random weights so routing means something.

    Drawn on the CPU (the same weights wherever the model is built, also under ``with torch.device("cuda")``)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            name = type(module).__name__
            if not name.endswith(("Router", "TopkRouter", "TopKRouter")):
                continue
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.abs().max() == 0:
                weight.copy_(torch.randn(weight.shape, generator=generator, device="cpu") * 0.1)
            for buffer_name in ("bias", "e_score_correction_bias"):
                extra = getattr(module, buffer_name, None)
                if isinstance(extra, torch.Tensor) and extra.abs().max() == 0:
                    extra.copy_(torch.randn(extra.shape, generator=generator, device="cpu") * 0.05)


# ----------------------------------------------------------------------------- scripted generation
class _ScriptedLogits(LogitsProcessor):
    """Forces each row's continuation to a fixed token list (then EOS): every other logit becomes -inf."""

    def __init__(self, targets: list[list[int]], prompt_width: int, eos_token_id: int):
        self.targets, self.prompt_width, self.eos_token_id = targets, prompt_width, eos_token_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_width
        forced = torch.full_like(scores, float("-inf"))
        for row, target in enumerate(self.targets):
            token = target[step] if step < len(target) else self.eos_token_id
            forced[row, token] = 0.0
        return cast(torch.FloatTensor, forced)  # a float tensor; torch's stubs type FloatTensor as its own class


@contextlib.contextmanager
def scripted_generation(model: torch.nn.Module, tokenizer, script: Callable[[str], str]) -> Iterator[None]:
    """While active, ``model.generate`` writes ``script(prompt_text)`` (then EOS) for every prompt.

    The model's real forwards still run (prefill and every decode step), so routes and log-probs are recorded as
    for any generation; only the choice of tokens is scripted, through a logits processor. ``prompt_text`` is the
    decoded prompt without padding, tool results of earlier turns included: tests use it to drive multi-turn
    tool-calling rollouts deterministically with a tiny random model.
    """
    own = model.__dict__.get("generate")  # an instance attribute to restore, if someone set one
    original = cast(Callable[..., Any], model.generate)  # nn.Module's __getattr__ types it as a Tensor or Module

    def generate(*args, **kwargs):
        input_ids = kwargs["input_ids"]
        mask = kwargs.get("attention_mask")
        texts = [
            tokenizer.decode(row[row_mask.bool()] if mask is not None else row)
            for row, row_mask in zip(input_ids, mask if mask is not None else input_ids, strict=True)
        ]
        targets = [tokenizer(script(text), add_special_tokens=False)["input_ids"] for text in texts]
        processor = _ScriptedLogits(targets, input_ids.shape[1], tokenizer.eos_token_id)
        return original(*args, logits_processor=LogitsProcessorList([processor]), **kwargs)

    model.generate = generate  # type: ignore[assignment]  # an instance attribute over the method, for the context
    try:
        yield
    finally:
        if own is None:
            del model.generate  # the class's generate again
        else:
            model.generate = own
