"""The one versioned seam: every private name of torch, transformers, TRL and vLLM the package uses, and every
reliance on the order or form of their code, as named entries, each with the version it was read from.

One part per library, each a module of entries: a comment saying what is relied on and where, an
``entry(name, library, read_from, verified_on)`` declaration, the functions the rest of the package calls instead of
touching the private name, and the part's check.

==========================  ==========================================================================================
``torch_seam``              ``autograd_graph_task``, ``assert_async``, ``module_parameter_slot``,
                            ``ddp_ignored_parameters``, ``dcp_metadata_pickle``, ``dcp_local_chunks``
``transformers_seam``       ``stack_cache_keyword``, ``router_output_order``, ``hub_kernels``,
                            ``trainer_private_methods``, ``keys_ignored_on_save``, ``saved_weight_layout``,
                            ``sharded_at_load_resume``, ``parallel_plan_styles``, ``ep_implementations``,
                            ``resume_at_max_steps``, ``trainer_end``
``trl_seam``                ``grpo_private_methods``, ``padded_width``, ``engine_logprob_correction``,
                            ``reference_forward``, ``loss_branch``, ``old_logps_after_forward``, ``minirl_on_vespo``,
                            ``vllm_client_session``, ``http_vllm_client``, ``vllm_generation_classes``,
                            ``vllm_request_fields``, ``weight_sync_params``, ``vllm_sync_trigger``,
                            ``tool_turn_rendering``, ``tool_loop_samples``, ``trl_public_apis``,
                            ``model_card_identity``, ``trl_utilities``
``trl_async_seam``          ``async_rollout_worker``, ``async_trainer_globals``, ``async_batcher_rows``,
                            ``async_grpo_classes``, ``async_packing``
``vllm_seam``               ``cpu_experts_select``, ``routing_replay_capture``, ``unquantized_setup_kernel``,
                            ``forward_context_layers`` (declared and checked in ``trl_moe_replay_vllm_plugin``)
==========================  ==========================================================================================

``torch_seam`` and ``transformers_seam`` import no TRL (the routing package uses them), and neither does this index:
the TRL parts load on first use of one of their names (PEP 562), so ``from trl_moe_replay.upstream import
engine_logprob_correction`` works as an eager import would. :func:`check_upstream` runs every part's check.
``tests/cross_cutting/test_layout.py`` fails if a private upstream name is used outside this package, or a TRL name
is imported from anywhere but ``trl`` itself. vLLM's private names are used only in ``trl_moe_replay_vllm_plugin``
(loaded by vLLM in its own processes; it imports nothing of ours): it keeps its entries and their check itself, as
light data, and ``vllm_seam`` registers them here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .entries import ENTRIES, Entry, Finding, TransformersChangedError, UpstreamChangedError


PARTS = ("torch_seam", "transformers_seam", "trl_seam", "trl_async_seam", "vllm_seam")

# name -> the part that defines it, for the names the rest of the package imports from the seam
_LAZY = {
    **dict.fromkeys(
        (
            "check_trl",
            "assert_trl_compatible",
            "quiet_upstream_notices",
            "TRL_READ",
            "TRL_RANGE",
            "trl_padded_width",
            "engine_logprob_correction",
            "is_reference_forward",
            "run_loss_on_trl_branch",
            "set_old_logps_for_loss",
            "MINIRL_TRL_BRANCH",
            "client_session",
            "http_vllm_client",
            "vllm_generation_classes",
            "vllm_sampling_params_class",
            "vllm_request_fields",
            "exclude_from_weight_sync",
            "tool_loop_samples",
            "trl_named_params",
            "map_weight_sync_tensors",
            "vllm_weights_stale",
            "mark_vllm_weights_synced",
            "wake_colocated_weights",
            "model_card_identity",
            "pad",
            "nanmin",
            "nanmax",
            "profiling_context",
            "disable_gradient_checkpointing",
            "add_response_schema",
            "parse_response",
            "qwen3_template",
        ),
        "trl_seam",
    ),
    **dict.fromkeys(
        (
            "check_async_trl",
            "assert_async_trl_compatible",
            "async_worker_classes",
            "worker_loop_kwargs",
            "async_trainer_globals",
            "async_adapter_only_sync",
            "async_tree_row_class",
            "keyed_tree_row_class",
            "batcher_rows",
            "tree_attention_kernel",
            "AsyncGRPOTrainer",
            "AsyncGRPOConfig",
            "RolloutQueueDataset",
            "FixedCountBatcher",
            "TokenBudgetBatcher",
            "DataCollatorForRollout",
        ),
        "trl_async_seam",
    ),
    **dict.fromkeys(
        (
            "checkpoint_run_dir",
            "keys_ignored_on_save",
            "ignore_on_save",
            "saved_weight_layout",
            "save_pretrained_weights",
            "lift_sharded_resume_refusal",
            "dcp_placements",
            "distributed_config_class",
            "parallel_plan_styles",
            "tp_sharded_parameters",
            "ep_implementations",
            "end_trainer",
        ),
        "transformers_seam",
    ),
    **dict.fromkeys(
        (
            "in_backward",
            "assert_without_sync",
            "parameter_replaced",
            "ignore_in_ddp",
            "DCPMetadataUnpickler",
            "dcp_storage_info_class",
            "checked_dcp_reader",
            "checked_dcp_planner",
            "dcp_local_chunk",
        ),
        "torch_seam",
    ),
}

if TYPE_CHECKING:
    from .torch_seam import (
        DCPMetadataUnpickler,
        assert_without_sync,
        checked_dcp_planner,
        checked_dcp_reader,
        dcp_local_chunk,
        dcp_storage_info_class,
        ignore_in_ddp,
        in_backward,
        parameter_replaced,
    )
    from .transformers_seam import (
        checkpoint_run_dir,
        dcp_placements,
        distributed_config_class,
        end_trainer,
        ep_implementations,
        ignore_on_save,
        keys_ignored_on_save,
        lift_sharded_resume_refusal,
        parallel_plan_styles,
        save_pretrained_weights,
        saved_weight_layout,
        tp_sharded_parameters,
    )
    from .trl_async_seam import (
        AsyncGRPOConfig,
        AsyncGRPOTrainer,
        DataCollatorForRollout,
        FixedCountBatcher,
        RolloutQueueDataset,
        TokenBudgetBatcher,
        assert_async_trl_compatible,
        async_adapter_only_sync,
        async_trainer_globals,
        async_tree_row_class,
        async_worker_classes,
        batcher_rows,
        check_async_trl,
        keyed_tree_row_class,
        tree_attention_kernel,
        worker_loop_kwargs,
    )
    from .trl_seam import (
        MINIRL_TRL_BRANCH,
        TRL_RANGE,
        TRL_READ,
        add_response_schema,
        assert_trl_compatible,
        check_trl,
        client_session,
        disable_gradient_checkpointing,
        engine_logprob_correction,
        exclude_from_weight_sync,
        http_vllm_client,
        is_reference_forward,
        map_weight_sync_tensors,
        mark_vllm_weights_synced,
        model_card_identity,
        nanmax,
        nanmin,
        pad,
        parse_response,
        profiling_context,
        quiet_upstream_notices,
        qwen3_template,
        run_loss_on_trl_branch,
        set_old_logps_for_loss,
        tool_loop_samples,
        trl_named_params,
        trl_padded_width,
        vllm_generation_classes,
        vllm_request_fields,
        vllm_sampling_params_class,
        vllm_weights_stale,
        wake_colocated_weights,
    )

__all__ = [
    "ENTRIES",
    "PARTS",
    "Entry",
    "Finding",
    "TransformersChangedError",
    "UpstreamChangedError",
    "all_entries",
    "check_upstream",
    *_LAZY,
]


def all_entries() -> dict[str, Entry]:
    """Every entry of every part, by name (imports the TRL parts)."""
    for part in PARTS:
        importlib.import_module(f"{__name__}.{part}")
    return dict(ENTRIES)


def check_upstream() -> tuple[Finding, ...]:
    """Every part's check against the installed libraries (TRL's includes torch's and transformers'; vLLM's only
    where vLLM is importable)."""
    from .trl_async_seam import check_async_trl
    from .trl_seam import check_trl
    from .vllm_seam import check_vllm

    return check_trl() + check_async_trl() + check_vllm()


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
