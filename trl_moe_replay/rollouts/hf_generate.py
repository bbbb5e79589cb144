"""transformers ``generate`` as the inference engine: record its routes and sampling log-probs while it runs.

This makes the HF generation path a small-scale stand-in for vLLM: per completion it yields engine rows with
vLLM's layout (``[p + c - 1, num_layers, top_k]``, row j = position j of prompt+completion) and the sampled
tokens' log-probabilities with vLLM's ``processed_logprobs`` semantics at the default sampling settings
(``log_softmax(logits / temperature)``; like TRL's trainer side, top-k/top-p filtering is not folded in).
:class:`TransformersRouteSource` is the sync trainer's route source on this path (``rollouts/route_source.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..routing import RouterReplay
from .route_source import TurnOutput, TurnRequest, TurnRows


if TYPE_CHECKING:
    from ..routing.replay import RouteRecording


class TransformersRolloutRecorder:
    """Context manager around one ``model.generate`` call.

    ``causal_lm`` is the module whose forward returns ``.logits`` (for PEFT, the base causal LM). Log-probs are
    gathered step by step (each decode step's input is the token sampled from the previous step's logits), so only
    one step of ``[B, vocab]`` log-probs is alive at a time. With ``router_replay=None`` only the log-probs are
    recorded (a run that needs the sampler's log-probs but not its routes).
    """

    def __init__(self, router_replay: RouterReplay | None, causal_lm: nn.Module, temperature: float):
        self.router_replay = router_replay
        self.causal_lm = causal_lm
        self.temperature = temperature
        self._pending: torch.Tensor | None = None
        self._logprobs: list[torch.Tensor] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._recording: RouteRecording | None = None
        self._record_ctx: contextlib.AbstractContextManager[RouteRecording] | None = None

    def __enter__(self) -> TransformersRolloutRecorder:
        if self.router_replay is not None:
            self._record_ctx = self.router_replay.record()
            self._recording = self._record_ctx.__enter__()
        self._handles = [
            self.causal_lm.register_forward_pre_hook(self._before_step, with_kwargs=True),
            self.causal_lm.register_forward_hook(self._after_step),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        if self._record_ctx is not None:
            self._record_ctx.__exit__(*exc)

    def _before_step(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if self._pending is not None and input_ids is not None:
            self._take(input_ids[:, -1])
        return None

    def _after_step(self, module, args, output):
        logits = output.logits[:, -1].float()
        self._pending = torch.log_softmax(logits / self.temperature, dim=-1)

    def _take(self, tokens: torch.Tensor) -> None:
        pending = self._pending
        assert pending is not None  # both callers check that a forward left log-probs to take
        self._logprobs.append(pending.gather(1, tokens.view(-1, 1).to(pending.device)).squeeze(1))
        self._pending = None

    def finish_with(self, completion_ids: list[list[int]], pad_token_id: int) -> None:
        """Take the log-prob of the final generated column, which no later forward consumed.

        Only completions that reach that column need it; the others get ``pad_token_id`` there (never read).
        """
        if self._pending is None:
            return
        column = len(self._logprobs)
        last = [ids[column] if len(ids) > column else pad_token_id for ids in completion_ids]
        self._take(torch.tensor(last))

    # ------------------------------------------------------------------ results
    @property
    def routes(self) -> torch.Tensor | None:
        """``[B, prompt_width + generated, num_layers, top_k]``, the generation batch's own layout (None when no
        forward ran)."""
        return None if self._recording is None else self._recording.routes

    def engine_rows(self, prompt_lengths: list[int], completion_lengths: list[int]) -> list[torch.Tensor | None]:
        """Per sample, the routes of positions ``0 .. p + c - 2`` of prompt+completion (vLLM's row layout).

        ``None`` for a sample whose tokens the recorded forwards did not cover: ``generate`` ran no forward at all
        (a replaced ``model.generate``, e.g. a test stub), or fewer steps than the completion has tokens. The
        trainer's route intake then routes it by the router's own choice, or stops the run if no sample of its
        first batch has routes under R3.
        """
        routes = self.routes
        if routes is None or len(prompt_lengths) != routes.shape[0]:
            return [None] * len(prompt_lengths)
        prompt_width = routes.shape[1] - len(self._logprobs)
        rows = []
        for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
            fits = p <= prompt_width and c <= len(self._logprobs)
            rows.append(routes[i, prompt_width - p : prompt_width + c - 1] if fits else None)
        return rows

    def sampling_logprobs(self, completion_lengths: list[int]) -> list[list[float]]:
        """Per sample, the log-probs of its first ``c`` sampled tokens."""
        table = torch.stack(self._logprobs, dim=1).cpu() if self._logprobs else torch.zeros(len(completion_lengths), 0)
        return [table[i, :c].tolist() for i, c in enumerate(completion_lengths)]


class TransformersRouteSource:
    """transformers ``generate`` as a route source (:class:`~.route_source.RouteSourceProtocol`): every turn runs
    inside a :class:`TransformersRolloutRecorder`.

    ``router_replay`` records the routes (``None``: only the sampler's log-probs, for the engine log-prob correction);
    ``causal_lm`` gives the module whose forward returns ``.logits`` at the time of the turn (for PEFT, the base causal
    LM). With ``return_logprobs`` (TRL's correction on the transformers path) the turn's output carries the sampler's
    log-probs; without it they are kept for the mismatch metrics only, on single-turn batches (TRL assembles multi-turn
    log-probs only when it receives them).
    """

    name = "transformers generate"
    remedy = (
        "Did generate run the model's forward for these completions? A replaced model.generate (e.g. a test "
        "stub) runs none, so there are no routes to replay: use routing_replay='r2' with it."
    )

    def __init__(
        self,
        router_replay: RouterReplay | None,
        causal_lm: Callable[[], nn.Module],
        temperature: float,
        pad_token_id: int,
        *,
        return_logprobs: bool,
    ):
        self.router_replay = router_replay
        self.causal_lm = causal_lm
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.return_logprobs = return_logprobs

    def generate_turn(self, request: TurnRequest, generate: Callable[[], TurnOutput]) -> tuple[TurnOutput, TurnRows]:
        recorder = TransformersRolloutRecorder(self.router_replay, self.causal_lm(), self.temperature)
        with recorder:
            completion_ids, _ = generate()
        recorder.finish_with(completion_ids, pad_token_id=self.pad_token_id)
        completion_lengths = [len(ids) for ids in completion_ids]
        rows = None
        if self.router_replay is not None:
            rows = recorder.engine_rows([len(ids) for ids in request.prompt_ids], completion_lengths)
        logprobs = recorder.sampling_logprobs(completion_lengths)
        if self.return_logprobs:
            return (completion_ids, logprobs), TurnRows(rows)
        # A replaced generate (a test stub) runs no forward, so its rows fall short of the completions: there is no
        # sampler to compare with then.
        covered = all(len(row) == length for row, length in zip(logprobs, completion_lengths, strict=True))
        kept = logprobs if covered and not request.later_turn else None
        return (completion_ids, None), TurnRows(rows, sampling_logprobs=kept)

    def rollout_turns(self, prompt_ids, completion_ids, fields) -> None:
        return None  # its rows come turn by turn

    def take_metrics(self) -> dict[str, float]:
        return {}
