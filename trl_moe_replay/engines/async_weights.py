"""Weight sync for TRL's async trainer against a vLLM server without NCCL, and a check that each sync arrived.

:class:`ReloadWeightTransfer` is a TRL ``WeightTransferProtocol``: the same reload as the synchronous trainer's
``vllm_weight_sync="reload"`` for a server (``engines/vllm_sync.py``): the trainer's weights, under the checkpoint's
names and layout (``checkpoint_named_tensors``), are written to ``sync_dir/model.safetensors``; the server (dev mode,
``VLLM_SERVER_DEV_MODE=1``) reloads them with ``POST /collective_rpc reload_weights`` and resets its prefix cache, so
cached prompt routes are recomputed under the new weights. It works on vLLM's CPU build, where TRL's default NCCL
transfer cannot.

:class:`SyncGuard` makes a sync that did not arrive, or weights that changed behind the trainer's back, loud. The
policy version TRL tags samples with counts *syncs*, not weights that reached the engine: with a transfer that does
nothing the version still increments and staleness reads "fresh" while the server samples with its first weights.
Around every sync the guard scores a fixed probe with the engine (``prompt_logprobs``):

* after the sync, the engine's answer must have moved by at least a tenth of what the trainer's moved since the
  previous sync (when that is more than ``tolerance``); otherwise :class:`WeightSyncNotDeliveredError`;
* before the next sync, the engine must still answer as it did right after the previous one (within
  ``tolerance`` nats); otherwise the server's weights changed in between, e.g. it was restarted from its checkpoint,
  and the samples it produced since are tagged with a version whose weights it did not have:
  :class:`EngineWeightsChangedError`.

Both errors are raised on the main process from the trainer's weight-sync callback, which ends the run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import requests
import torch
from safetensors.torch import save_file
from transformers.utils import logging

from .vllm_weights import checkpoint_named_tensors

logger = logging.get_logger(__name__)

__all__ = [
    "EngineWeightsChangedError",
    "ReloadWeightTransfer",
    "SyncGuard",
    "VLLMServerUnavailableError",
    "WeightSyncNotDeliveredError",
]


class VLLMServerUnavailableError(RuntimeError):
    """The vLLM server did not answer a weight-sync request (down, restarting, or unreachable)."""


class WeightSyncNotDeliveredError(RuntimeError):
    """A weight sync returned, but the engine still scores like before it: the weights did not reach it."""


class EngineProbeNotFiniteError(RuntimeError):
    """The engine answered the sync probe with a NaN or infinite log-prob: no tolerance can compare it."""


class EngineWeightsChangedError(RuntimeError):
    """Between two syncs the engine's weights changed without the trainer (a restarted or shared server)."""


def _post(url: str, what: str, timeout: float, **kwargs) -> requests.Response:
    try:
        response = requests.post(url, timeout=timeout, **kwargs)
    except requests.RequestException as exc:
        raise VLLMServerUnavailableError(
            f"the vLLM server at {'/'.join(url.split('/')[:3])} did not answer {what} ({type(exc).__name__}: {exc}). Is it "
            "still running? Restart it and resume training from the last checkpoint."
        ) from exc
    if response.status_code != 200:
        raise VLLMServerUnavailableError(
            f"the vLLM server refused {what} ({response.status_code}: {response.text[:300]}). The reload sync needs "
            "the dev-mode endpoints (VLLM_SERVER_DEV_MODE=1) and read access to the sync directory."
        )
    return response


class ReloadWeightTransfer:
    """TRL ``WeightTransferProtocol`` through vLLM's ``reload_weights`` (see the module docstring).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        sync_dir: where the weights are written; the server must be able to read it (same machine or shared disk).
        model: the unwrapped transformers model; its weight conversions name the checkpoint layout. The async
            trainer sets it when it builds this transfer.
        timeout: seconds for each request.
    """

    def __init__(self, base_url: str, sync_dir: str, model: torch.nn.Module | None = None, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.sync_dir = os.path.abspath(sync_dir)
        self.model = model
        self.timeout = timeout
        self.delivered = 0  # syncs the server acknowledged

    def init_weight_transfer(self) -> None:
        try:
            requests.get(f"{self.base_url}/health", timeout=self.timeout).raise_for_status()
        except requests.RequestException as exc:
            raise VLLMServerUnavailableError(f"the vLLM server at {self.base_url} is not healthy: {exc}") from exc

    def pause(self) -> None:
        # "keep": requests in flight are frozen, not aborted, and go on with the new weights after resume()
        _post(f"{self.base_url}/pause", "pause", self.timeout, params={"mode": "keep"})

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        if self.model is None:
            raise RuntimeError("ReloadWeightTransfer.model is not set: it names the checkpoint layout vLLM loads")
        os.makedirs(self.sync_dir, exist_ok=True)
        tensors = {name: tensor.detach().cpu().contiguous()
                   for name, tensor in checkpoint_named_tensors(self.model, iterator)}
        save_file(tensors, os.path.join(self.sync_dir, "model.safetensors"))
        _post(f"{self.base_url}/collective_rpc", "the weight reload", self.timeout,
              json={"method": "reload_weights", "kwargs": {"weights_path": self.sync_dir}})
        _post(f"{self.base_url}/reset_prefix_cache", "the prefix-cache reset", self.timeout)
        self.delivered += 1

    def resume(self) -> None:
        _post(f"{self.base_url}/resume", "resume", self.timeout)

    def destroy(self) -> None:
        pass


def engine_probe_logprobs(base_url: str, model_name: str, probe: list[int], timeout: float = 120.0) -> torch.Tensor:
    """The server's log-probs of ``probe[1:]`` given the tokens before each (``prompt_logprobs``)."""
    response = _post(f"{base_url.rstrip('/')}/v1/completions", "the sync-check probe", timeout, json={
        "model": model_name, "prompt": [probe], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0,
        "return_tokens_as_token_ids": True,
    })
    entries = response.json()["choices"][0]["prompt_logprobs"][1:]
    values = []
    for entry, token in zip(entries, probe[1:], strict=True):
        value = entry.get(str(token)) or entry.get(f"token_id:{token}")
        values.append(value["logprob"] if isinstance(value, dict) else float(value))
    return torch.tensor(values, dtype=torch.float32)


def trainer_probe_logprobs(model: torch.nn.Module, probe: list[int]) -> torch.Tensor:
    """The trainer model's log-probs of ``probe[1:]`` (one packed segment: TRL's tree-attention model)."""
    n = len(probe)
    device = next(model.parameters()).device
    ids = torch.tensor([probe], device=device)
    with torch.no_grad():
        logits = model(
            input_ids=ids, position_ids=torch.arange(n, device=device)[None],
            tree_kv_index=torch.arange(n, device=device),
            tree_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
            tree_cu_seqlens_k=torch.tensor([0, n], dtype=torch.int32, device=device),
            tree_max_seqlen_q=n, tree_max_seqlen_k=n,
        ).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].cpu()


class SyncGuard:
    """Checks around each weight sync that the engine holds the trainer's weights (see the module docstring)."""

    def __init__(self, base_url: str, model_name: str, probe: list[int], tolerance: float = 0.05):
        self.base_url, self.model_name, self.probe, self.tolerance = base_url, model_name, probe, tolerance
        self._engine_after: torch.Tensor | None = None  # engine answer right after the previous sync
        self._trainer_at_sync: torch.Tensor | None = None  # trainer answer at the previous sync
        self._engine_before: torch.Tensor | None = None
        self.last_diff: float | None = None  # max |engine - trainer| after the last sync

    def _engine_answer(self, when: str) -> torch.Tensor:
        """The engine's probe log-probs, refused unless finite: NaN compares false with every tolerance, so a NaN
        answer would pass both checks."""
        engine = engine_probe_logprobs(self.base_url, self.model_name, self.probe)
        bad = (~torch.isfinite(engine)).nonzero().flatten().tolist()
        if bad:
            raise EngineProbeNotFiniteError(
                f"{when}, {len(bad)} of the vLLM server's {engine.numel()} log-probs of the sync probe are not finite "
                f"({float(engine[bad[0]])} at token {bad[0] + 1}): its weights hold NaN or inf, or the reload failed. "
                "Check the server's log; resume training from the last checkpoint against a fresh server."
            )
        return engine

    def before_sync(self) -> None:
        engine = self._engine_answer("before a weight sync")
        if self._engine_after is not None:
            drift = float((engine - self._engine_after).abs().max())
            if drift > self.tolerance:
                raise EngineWeightsChangedError(
                    f"between two weight syncs the vLLM server's log-probs of the sync probe moved by {drift:.4f} "
                    f"nats (tolerance {self.tolerance}): its weights changed without the trainer (was it restarted "
                    "from its checkpoint?). The samples it produced since carry a policy version whose weights it did "
                    "not have. Resume training from the last checkpoint against a fresh server."
                )
        self._engine_before = engine

    def after_sync(self, model: torch.nn.Module) -> float:
        engine = self._engine_answer("after a weight sync")
        trainer = trainer_probe_logprobs(model, self.probe)
        if self._trainer_at_sync is not None and self._engine_before is not None:
            # scale-free: a delivered sync moves the engine about as far as the trainer moved since the previous one;
            # an undelivered one moves it by the engine's batch noise only
            trainer_change = float((trainer - self._trainer_at_sync).abs().max())
            engine_change = float((engine - self._engine_before).abs().max())
            if trainer_change > self.tolerance and engine_change < 0.1 * trainer_change:
                raise WeightSyncNotDeliveredError(
                    f"a weight sync returned but the vLLM server's log-probs of the sync probe moved by "
                    f"{engine_change:.4f} nats while the trainer's moved by {trainer_change:.4f} since the previous "
                    "sync: the weight_transfer did not deliver the weights. The policy version would still increase "
                    "and staleness would read fresh. Use trl_moe_replay's ReloadWeightTransfer (CPU) or TRL's NCCL "
                    "transfer (GPU)."
                )
        self._engine_after, self._trainer_at_sync = engine, trainer
        self.last_diff = float((engine - trainer).abs().max())
        return self.last_diff
