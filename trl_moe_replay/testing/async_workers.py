"""Rollout workers for testing TRL's async trainer without a spawned process (``RolloutWorkerProtocol``).

* :class:`ScriptedRolloutWorker` hands the trainer a fixed list of samples, in order: two trainers given the same
  script see exactly the same data (the golden test), and a test can choose each sample's tokens, routes and version.
* :func:`sampled_routes` records what a model routes every position of a token sequence to, in vLLM's layout
  (``[len - 1, L, K]``, the last token never forwarded), as an engine serving those weights would return them.
* :class:`NoOpWeightTransfer` is a ``WeightTransferProtocol`` that delivers nothing.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from ..routing import RouterReplay
from ..routing.routes import route_dtype


class ScriptedRolloutWorker:
    """``RolloutWorkerProtocol`` serving ``samples`` (TRL ``RolloutSample`` s or subclasses) in order, then an error.

    Script one micro-batch more than the steps train: accelerate's dataloader fetches the next batch ahead."""

    def __init__(self, samples: Iterable):
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        for sample in samples:
            self.rollout_buffer.put(sample)
        self.versions: list[int] = []
        self.started = self.stopped = False
        self._empty_checks = 0

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        # TRL calls this when the queue stayed empty for its poll interval (5 s); the trainer may also call it per
        # sample. Empty three calls in a row: the script ran out, and waiting longer would hang the test.
        self._empty_checks = self._empty_checks + 1 if self.rollout_buffer.empty() else 0
        if self._empty_checks >= 3:
            raise RuntimeError("ScriptedRolloutWorker ran out of samples: script more, or train fewer steps")


def sampled_routes(model: torch.nn.Module, input_ids: list[int]) -> np.ndarray:
    """The experts ``model`` routes each of ``input_ids[:-1]`` to: ``[len - 1, num_layers, top_k]``, vLLM's layout
    and dtype (dense layers all-zero)."""
    replay = RouterReplay(model)
    try:
        with torch.no_grad(), replay.record() as recording:
            model(input_ids=torch.tensor([input_ids[:-1]]))
    finally:
        replay.remove()
    assert recording.routes is not None  # record() sets them on exit
    routes = recording.routes[0]
    dense = [layer for layer in range(replay.num_layers) if layer not in replay.moe_layers]
    routes[:, dense] = 0
    dtype = np.uint8 if replay.num_experts <= 256 else np.uint16
    assert route_dtype(replay.num_experts, replay.top_k) in (torch.uint8, torch.int16)
    return routes.numpy().astype(dtype)


class NoOpWeightTransfer:
    """A ``WeightTransferProtocol`` that delivers nothing (reads the weights, sends them nowhere)."""

    def __init__(self):
        self.calls: list[str] = []

    def init_weight_transfer(self) -> None:
        self.calls.append("init")

    def pause(self) -> None:
        self.calls.append("pause")

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.calls.append(f"send({sum(1 for _ in iterator)})")

    def resume(self) -> None:
        self.calls.append("resume")

    def destroy(self) -> None:
        self.calls.append("destroy")
