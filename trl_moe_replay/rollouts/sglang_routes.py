"""An SGLang server as the rollout engine of the sync trainer: a ``rollout_func`` that keeps SGLang's routed experts.

SGLang (read from the 0.5.23 wheel; docs/sglang.md) returns, per request of its native ``POST /generate``, the
experts each forwarded position was routed to, when the server runs with ``--enable-return-routed-experts`` and the
request sets ``return_routed_experts``: ``meta_info["routed_experts"]``, base64 of the raw bytes of an ``int32``
``[seqlen - 1 - s, num_hidden_layers, num_experts_per_tok]`` tensor (no ``.npy`` header: the shape is the model's),
covering positions ``[s, seqlen - 1)`` of prompt + output, ``s`` being the request's ``routed_experts_start_len``
(``0 <= s <= len(prompt)``, else the request is aborted). That is vLLM's row layout with another wire format, so
:class:`SGLangRollout` decodes each payload to a ``[rows, L, K]`` array and hands the rows, per sample and turn, to
the trainer's route intake like any engine's (per-sample and per-position fallback there).

Use it as the trainer's ``rollout_func``; it is a route source (``rollouts/route_source.py``), so the trainer takes
its routes from it, not from the fields the reward functions receive::

    rollout = SGLangRollout("http://localhost:30000", num_layers=config.num_hidden_layers,
                            top_k=config.num_experts_per_tok, max_new_tokens=256)
    trainer = MoEReplayGRPOTrainer(model, reward_funcs, args=config, rollout_func=rollout)

Multi-turn: pass ``conversation(rollout, prompt_ids, trainer) -> dict`` (TRL's rollout output) that calls
:meth:`SGLangRollout.generate` once per turn, naming for a later turn the samples its prompts continue; each later
request asks only for the positions those samples do not hold yet. The weights are not synced into SGLang here (its
``/update_weights_from_disk`` or ``/update_weights_from_tensor``): keep the server on the trainer's weights yourself.
"""

from __future__ import annotations

import base64
import binascii
import json
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..routing.codec import EngineTurn
from .route_source import TurnOutput, TurnRequest, TurnRows
from .turns import RolloutTurns


__all__ = ["SERVER_FLAG", "SGLangCompletion", "SGLangRollout", "decode_sglang_routes"]

SERVER_FLAG = "--enable-return-routed-experts"
#: SGLang's capture buffer dtype (``BaseHostCache``: ``torch.int32``), sent as raw bytes.
WIRE_DTYPE = np.dtype("<i4")


def decode_sglang_routes(payload: Any, num_layers: int, top_k: int) -> Any:
    """An SGLang ``routed_experts`` payload -> ``[rows, num_layers, top_k]`` int32 array; what does not decode
    (not base64 text, a byte count that is no whole number of rows) comes back as sent, for the route intake to
    report and route natively. ``None`` stays ``None``."""
    if not isinstance(payload, str):
        return payload
    try:
        raw = base64.b64decode(payload.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return payload
    row_bytes = WIRE_DTYPE.itemsize * num_layers * top_k
    if len(raw) % row_bytes:
        return payload
    return np.frombuffer(raw, WIRE_DTYPE).reshape(-1, num_layers, top_k)


@dataclass(frozen=True)
class SGLangCompletion:
    """One completion of a turn: its tokens, the sampler's log-probs, and its routes (decoded, or as sent)."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    routes: Any
    finish_reason: Any = None


@dataclass
class _Turn:
    prompt_ids: list[list[int]]
    completions: list[SGLangCompletion]
    prompt_start: int
    samples: list[int] | None  # None: the batch's first turn


class SGLangRollout:
    """A ``rollout_func`` sampling from an SGLang server's ``/generate``, and the route source of its rollouts.

    Args:
        base_url: the server, e.g. ``"http://localhost:30000"``.
        num_layers: the model's ``num_hidden_layers`` (SGLang sends one column per decoder layer, dense ones zero).
        top_k: the model's ``num_experts_per_tok``.
        max_new_tokens, sampling_params: SGLang's sampling parameters (``temperature`` defaults to the trainer's).
        conversation: a multi-turn rollout, ``conversation(rollout, prompt_ids, trainer) -> dict`` (TRL's rollout
            output: ``prompt_ids``, ``completion_ids``, ``logprobs``, and e.g. ``env_mask``), calling
            :meth:`generate` per turn. ``None``: one turn per prompt.
        timeout: seconds per HTTP request.
    """

    name = "SGLang"
    remedy = (
        f"Is the SGLang server started with {SERVER_FLAG} and serving the trainer's checkpoint (weights synced "
        "after each step)?"
    )

    def __init__(
        self,
        base_url: str,
        *,
        num_layers: int,
        top_k: int,
        max_new_tokens: int = 256,
        sampling_params: dict[str, Any] | None = None,
        conversation: Callable[[SGLangRollout, list[list[int]], Any], dict] | None = None,
        timeout: float = 600.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.num_layers, self.top_k = num_layers, top_k
        self.sampling_params = {"max_new_tokens": max_new_tokens, **(sampling_params or {})}
        self.conversation = conversation
        self.timeout = timeout
        self._turns: list[_Turn] = []  # the current rollout's turns
        self._params = dict(self.sampling_params)  # the current rollout's sampling parameters
        self.received_bytes = 0  # base64 characters of routes since the last take_metrics

    # ------------------------------------------------------------------ the rollout_func TRL calls
    def __call__(self, prompts: list, trainer: Any) -> dict:
        tokenizer = trainer.processing_class
        prompt_ids = [_tokenize(tokenizer, prompt) for prompt in prompts]
        self._turns = []
        self._params = {"temperature": trainer.temperature, **self.sampling_params}
        if self.conversation is not None:
            return self.conversation(self, prompt_ids, trainer)
        completions = self.generate(prompt_ids)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [c.token_ids for c in completions],
            "logprobs": [c.logprobs for c in completions],
        }

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        samples: Sequence[int] | None = None,
        sampling_params: dict[str, Any] | None = None,
    ) -> list[SGLangCompletion]:
        """One turn: a completion per prompt (``sampling_params``: this request's, else the rollout's). ``samples``: for a later turn of a conversation, the sample of the
        batch's first turn each prompt continues (its whole sequence so far, then new tokens); the request then asks
        only for the positions every one of them does not hold yet (``routed_experts_start_len``)."""
        prompts = [list(ids) for ids in prompt_ids]
        start = 0
        if samples is not None:
            if not self._turns or len(samples) != len(prompts):
                raise ValueError("a later turn needs the batch's first turn, and one sample per prompt")
            held = RolloutTurns.from_engine_turns(self._route_turns(), [[]] * len(self._turns[0].completions))
            start = min(held.held_positions(samples) or 0, *(len(prompt) for prompt in prompts))  # SGLang aborts past
        body = {
            "input_ids": prompts,
            "sampling_params": sampling_params or self._params,
            "return_logprob": True,
            "return_routed_experts": True,
            "routed_experts_start_len": start,
        }
        answers = self._post("/generate", body)
        if not isinstance(answers, list) or len(answers) != len(prompts):
            raise RuntimeError(
                f"SGLang's /generate answered {len(answers) if isinstance(answers, list) else 'no list'} "
                f"results for {len(prompts)} prompts"
            )
        completions = [self._completion(prompt, answer) for prompt, answer in zip(prompts, answers, strict=True)]
        self._turns.append(_Turn(prompts, completions, start, None if samples is None else list(samples)))
        return completions

    def _completion(self, prompt: list[int], answer: dict) -> SGLangCompletion:
        meta = answer.get("meta_info", {})
        payload = meta.get("routed_experts")
        if isinstance(payload, str):
            self.received_bytes += len(payload)
        logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
        return SGLangCompletion(
            prompt,
            list(answer.get("output_ids", [])),
            logprobs,
            decode_sglang_routes(payload, self.num_layers, self.top_k),
            meta.get("finish_reason"),
        )

    def _post(self, path: str, body: dict) -> Any:
        request = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - the user's server URL
            return json.load(response)

    # ------------------------------------------------------------------ the route source
    def _route_turns(self) -> list[list[EngineTurn]]:
        """Per sample of the first turn, its turns as ``EngineTurn`` s."""
        first = self._turns[0]
        samples = [
            [EngineTurn(c.routes, len(c.prompt_ids), len(c.token_ids), first.prompt_start)] for c in first.completions
        ]
        for turn in self._turns[1:]:
            assert turn.samples is not None  # only the first turn has none
            for sample, completion in zip(turn.samples, turn.completions, strict=True):
                samples[sample].append(
                    EngineTurn(
                        completion.routes, len(completion.prompt_ids), len(completion.token_ids), turn.prompt_start
                    )
                )
        return samples

    def generate_turn(self, request: TurnRequest, generate: Callable[[], TurnOutput]) -> tuple[TurnOutput, TurnRows]:
        return generate(), TurnRows()  # its rows come with the rollouts (TRL's own later tool turns carry none)

    def rollout_turns(
        self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], fields: dict[str, Any]
    ) -> RolloutTurns | None:
        """The turns of the rollout this object just returned to TRL (one sample per prompt of its first turn)."""
        if not self._turns:
            return None
        turns, self._turns = self._route_turns(), []
        if len(turns) != len(prompt_ids):
            raise ValueError(f"SGLang generated {len(turns)} samples, the rollout returned {len(prompt_ids)}")
        sequences = [[*prompt, *completion] for prompt, completion in zip(prompt_ids, completion_ids, strict=True)]
        return RolloutTurns.from_engine_turns(turns, sequences)

    def take_metrics(self) -> dict[str, float]:
        """``sglang/route_bytes``: the base64 characters of routes received since the last call."""
        received, self.received_bytes = self.received_bytes, 0
        return {"sglang/route_bytes": float(received)}


def _tokenize(tokenizer: Any, prompt: Any) -> list[int]:
    if isinstance(prompt, list):  # conversational: the chat template, as TRL renders it
        return list(
            tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
