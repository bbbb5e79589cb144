"""The one engine sync check, for both trainers: does the vLLM engine hold the trainer's weights after each sync?

A weight sync that returns has not necessarily reached the engine: a transfer that does nothing still returns (and
TRL's async trainer still bumps the policy version it tags samples with, so staleness reads "fresh" while the engine
samples with its first weights), and a server restarted from its checkpoint has silently dropped every sync so far.
Around every sync, :class:`SyncCheck` scores a fixed probe (a few token ids, the same for every process and every
sync) with the engine (``prompt_logprobs``) and, after the sync, with the trainer:

* after the sync, the largest difference of engine and trainer log-probs is logged as
  ``vllm/sync_max_logprob_diff`` (~1e-6 in fp32 on both sides when the weights arrived, ~1e-2 for a bf16 engine, and
  growing with every update the engine missed);
* after the sync, the engine's answer must have moved by at least a tenth of what the trainer's moved since the
  previous sync (when that is more than ``tolerance`` nats); otherwise :class:`WeightSyncNotDeliveredError`;
* before the next sync, the engine must still answer as it did right after the previous one (within ``tolerance``
  nats); otherwise its weights changed in between, e.g. the server was restarted from its checkpoint, and what it
  sampled since came from weights the trainer never sent: :class:`EngineWeightsChangedError`;
* a NaN or infinite engine log-prob would pass both comparisons (NaN compares false): :class:`EngineProbeNotFiniteError`.

All three are :class:`EngineSyncError`. Both trainers run a sync through :func:`checked_weight_sync`, built by
:func:`sync_trainer_check` or :func:`async_trainer_check`; whether the check is on is ``core.routing_options.resolve_sync_check``'s to say (one rule
for both trainers). The engine is scored by the process that drives it (each process in colocate mode, the main process for a server); the trainer's probe
forward runs on every process, so that a sharded model's forward has all its ranks. An error is raised on the process
that measured it and ends the run there (a launcher such as ``torchrun`` then stops the other processes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import TrlMoeReplayError
from ..upstream import vllm_sampling_params_class
from .server_requests import post_to_server, served_model_name


__all__ = [
    "EngineProbeNotFiniteError",
    "EngineSyncError",
    "EngineWeightsChangedError",
    "SYNC_CHECK_TOLERANCE",
    "SyncCheck",
    "SyncCheckUnavailableError",
    "WeightSyncNotDeliveredError",
    "async_trainer_check",
    "checked_weight_sync",
    "sync_trainer_check",
]

SYNC_CHECK_TOLERANCE = 0.05  # nats the engine's probe log-probs may move without a weight change (batch noise)
PROBE_TOKENS = list(range(10, 26))  # any fixed token ids: only their log-probs are compared
PROBE_TIMEOUT = 120.0  # seconds for the server to score the probe
METRIC = "vllm/sync_max_logprob_diff"

EngineScorer = Callable[[list[int]], torch.Tensor]  # probe -> the engine's log-probs of probe[1:]
TrainerScorer = Callable[[torch.nn.Module, list[int]], torch.Tensor]  # model, probe -> the same from the trainer


class EngineSyncError(TrlMoeReplayError, RuntimeError):
    """A weight sync left the vLLM engine without the trainer's weights (the subclass says how)."""


class WeightSyncNotDeliveredError(EngineSyncError):
    """A weight sync returned, but the engine still scores like before it: the weights did not reach it."""


class EngineWeightsChangedError(EngineSyncError):
    """Between two syncs the engine's weights changed without the trainer (a restarted or shared server)."""


class EngineProbeNotFiniteError(EngineSyncError):
    """The engine answered the sync probe with a NaN or infinite log-prob: no tolerance can compare it."""


class SyncCheckUnavailableError(TrlMoeReplayError, ValueError):
    """``vllm_sync_check=True`` asked for where the engine cannot be probed around a sync."""


# ------------------------------------------------------------------ scoring the probe
def server_scorer(base_url: str, timeout: float = PROBE_TIMEOUT) -> EngineScorer:
    """A vLLM server's log-probs of ``probe[1:]`` given the tokens before each (``/v1/completions``,
    ``prompt_logprobs``); the served model's name is asked once, from ``/v1/models``."""
    base_url = base_url.rstrip("/")
    names: list[str] = []

    def score(probe: list[int]) -> torch.Tensor:
        if not names:
            names.append(served_model_name(base_url, timeout))
        response = post_to_server(
            f"{base_url}/v1/completions",
            "the sync-check probe",
            timeout,
            "Set vllm_sync_check=False if this server cannot answer prompt_logprobs.",
            json={
                "model": names[0],
                "prompt": [probe],
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": 0,
                "return_tokens_as_token_ids": True,
            },
        )
        entries = response.json()["choices"][0]["prompt_logprobs"][1:]
        values = []
        for entry, token in zip(entries, probe[1:], strict=True):
            # vLLM keys the entries by token id (a string in JSON); with return_tokens_as_token_ids also "token_id:N"
            value = entry.get(str(token)) or entry.get(f"token_id:{token}")
            values.append(value["logprob"] if isinstance(value, dict) else float(value))
        return torch.tensor(values, dtype=torch.float32)

    return score


def colocated_scorer(llm: Any) -> EngineScorer:
    """A colocated ``vllm.LLM``'s log-probs of ``probe[1:]`` (``prompt_logprobs``), in process."""

    def score(probe: list[int]) -> torch.Tensor:
        params = vllm_sampling_params_class()(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        request = llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)[0]
        entries = request.prompt_logprobs[1:]
        return torch.tensor(
            [entry[token].logprob for entry, token in zip(entries, probe[1:], strict=True)], dtype=torch.float32
        )

    return score


def causal_lm_logprobs(model: torch.nn.Module, probe: list[int]) -> torch.Tensor:
    """The sync trainer's model's log-probs of ``probe[1:]``: a plain causal-LM forward."""
    ids = torch.tensor([probe], device=next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].cpu()


def packed_row_logprobs(model: torch.nn.Module, probe: list[int]) -> torch.Tensor:
    """The async trainer's model's log-probs of ``probe[1:]``: one packed segment, the keyword arguments of TRL's
    tree attention (its async trainer's model runs with that attention implementation)."""
    n = len(probe)
    device = next(model.parameters()).device
    ids = torch.tensor([probe], device=device)
    logits = (
        model(
            input_ids=ids,
            position_ids=torch.arange(n, device=device)[None],
            tree_kv_index=torch.arange(n, device=device),
            tree_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
            tree_cu_seqlens_k=torch.tensor([0, n], dtype=torch.int32, device=device),
            tree_max_seqlen_q=n,
            tree_max_seqlen_k=n,
        )
        .logits[0, :-1]
        .float()
    )
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].cpu()


@contextlib.contextmanager
def _scoring(model: torch.nn.Module) -> Iterator[None]:
    """No gradients, no dropout; the model's training mode is restored on exit."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


# ------------------------------------------------------------------ the check
class SyncCheck:
    """Checks around each weight sync that the engine holds the trainer's weights (see the module docstring).

    Args:
        engine: scores the probe with the engine; ``None`` on a process that drives no engine (a server's non-main
            processes), which then only takes part in the trainer's probe forward.
        trainer: scores the probe with the trainer's model (:func:`causal_lm_logprobs` or
            :func:`packed_row_logprobs`: the trainers' models take different forward arguments).
        probe: the token ids scored.
        tolerance: nats the engine's answer may move with unchanged weights (``sync_check_tolerance``).
        engine_name: how the errors name the engine.
    """

    def __init__(
        self,
        engine: EngineScorer | None,
        trainer: TrainerScorer,
        probe: list[int] | None = None,
        tolerance: float = SYNC_CHECK_TOLERANCE,
        engine_name: str = "vLLM server",
    ):
        self.engine, self.trainer, self.tolerance, self.engine_name = engine, trainer, tolerance, engine_name
        self.probe = list(PROBE_TOKENS if probe is None else probe)
        self._engine_after: torch.Tensor | None = None  # engine answer right after the previous sync
        self._trainer_at_sync: torch.Tensor | None = None  # trainer answer at the previous sync
        self._engine_before: torch.Tensor | None = None
        self.last_diff: float | None = None  # max |engine - trainer| after the last sync

    def _engine_answer(self, when: str) -> torch.Tensor:
        """The engine's probe log-probs, refused unless finite: NaN compares false with every tolerance, so a NaN
        answer would pass both checks."""
        scorer = self.engine
        assert scorer is not None  # its callers return first on a process that drives no engine
        engine = scorer(self.probe)
        bad = (~torch.isfinite(engine)).nonzero().flatten().tolist()
        if bad:
            raise EngineProbeNotFiniteError(
                f"{when}, {len(bad)} of the {self.engine_name}'s {engine.numel()} log-probs of the sync probe are not finite "
                f"({float(engine[bad[0]])} at token {bad[0] + 1}): its weights hold NaN or inf, or the reload failed. "
                "Check the engine's log; resume training from the last checkpoint against a fresh engine."
            )
        return engine

    def _trainer_answer(self, model: torch.nn.Module) -> torch.Tensor:
        with _scoring(model):
            return self.trainer(model, self.probe)

    def before_sync(self) -> None:
        """Raise :class:`EngineWeightsChangedError` if the engine no longer answers as right after the last sync."""
        if self.engine is None:
            return
        engine = self._engine_answer("before a weight sync")
        if self._engine_after is not None:
            drift = float((engine - self._engine_after).abs().max())
            if drift > self.tolerance:
                raise EngineWeightsChangedError(
                    f"between two weight syncs the {self.engine_name}'s log-probs of the sync probe moved by {drift:.4f} "
                    f"nats (tolerance {self.tolerance}): its weights changed without the trainer (was it restarted "
                    "from its checkpoint?). The samples it produced since came from weights the trainer never sent. "
                    "Resume training from the last checkpoint against a fresh server."
                )
        self._engine_before = engine

    def after_sync(self, model: torch.nn.Module) -> float | None:
        """Raise :class:`WeightSyncNotDeliveredError` if the sync did not move the engine as the trainer moved;
        returns max |engine - trainer| over the probe (``None`` on a process without an engine)."""
        trainer = self._trainer_answer(model)
        if self.engine is None:
            return None
        engine = self._engine_answer("after a weight sync")
        if self._trainer_at_sync is not None and self._engine_before is not None:
            # scale-free: a delivered sync moves the engine about as far as the trainer moved since the previous one;
            # an undelivered one moves it by the engine's batch noise only
            trainer_change = float((trainer - self._trainer_at_sync).abs().max())
            engine_change = float((engine - self._engine_before).abs().max())
            if trainer_change > self.tolerance and engine_change < 0.1 * trainer_change:
                raise WeightSyncNotDeliveredError(
                    f"a weight sync returned but the {self.engine_name}'s log-probs of the sync probe moved by "
                    f"{engine_change:.4f} nats while the trainer's moved by {trainer_change:.4f} since the previous "
                    "sync: the weight sync did not deliver the weights (the async trainer's policy version would "
                    "still increase and staleness read fresh). Use vllm_weight_sync='reload' (any device) or TRL's "
                    "NCCL transfer (GPU), and check the engine's log."
                )
        self._engine_after, self._trainer_at_sync = engine, trainer
        self.last_diff = float((engine - trainer).abs().max())
        return self.last_diff

    def measure(self, model: torch.nn.Module) -> float | None:
        """max |engine - trainer| over the probe now, changing nothing (``None`` on a process without an engine)."""
        trainer = self._trainer_answer(model)
        return None if self.engine is None else float((self._engine_answer("measuring") - trainer).abs().max())


def checked_weight_sync(
    check: SyncCheck | None,
    sync: Callable[[], None],
    model: torch.nn.Module,
    accelerator: Any,
    metrics: dict[str, list],
) -> None:
    """Run ``sync`` (a trainer's weight sync) inside ``check``, on every process, and log the engine-trainer
    difference as ``vllm/sync_max_logprob_diff`` in ``metrics`` (TRL's ``self._metrics[mode]``): the largest over
    the processes that measured one. Without a check, ``sync()`` alone."""
    if check is None:
        sync()
        return
    check.before_sync()
    sync()
    diff = check.after_sync(model)
    value = torch.tensor([float("nan") if diff is None else diff], device=accelerator.device)
    measured = accelerator.gather(value)
    measured = measured[~measured.isnan()]
    if measured.numel():
        metrics[METRIC].append(float(measured.max()))


# ------------------------------------------------------------------ which trainers get it, and how it is built
def sync_trainer_check(
    enabled: bool, *, accelerator: Any, vllm_generation: Any, tolerance: float = SYNC_CHECK_TOLERANCE
) -> SyncCheck | None:
    """The sync trainer's sync check (every process builds one), or ``None`` when not ``enabled`` (``vllm_sync_check``
    as ``core.routing_options.resolve_sync_check`` resolves it). ``vllm_generation`` is TRL's ``VLLMGeneration``:
    in colocate mode each process scores its own engine, with a server the main process alone."""
    if not enabled:
        return None
    if vllm_generation.mode == "colocate":
        return SyncCheck(
            colocated_scorer(vllm_generation.llm),
            causal_lm_logprobs,
            tolerance=tolerance,
            engine_name="colocated vLLM engine",
        )
    engine = server_scorer(vllm_generation.vllm_client.base_url) if accelerator.is_main_process else None
    return SyncCheck(engine, causal_lm_logprobs, tolerance=tolerance)


def async_trainer_check(
    enabled: bool, *, accelerator: Any, base_url: str, tolerance: float = SYNC_CHECK_TOLERANCE
) -> SyncCheck | None:
    """The async trainer's sync check of the server at ``base_url`` (scored by the main process), on packed rows; or
    ``None`` when not ``enabled``."""
    if not enabled:
        return None
    engine = server_scorer(base_url) if accelerator.is_main_process else None
    return SyncCheck(engine, packed_row_logprobs, tolerance=tolerance)
