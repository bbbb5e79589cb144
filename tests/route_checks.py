"""A hook-based check that the trainer's forwards use, position by position, the experts the engine used.

:class:`RouteOracle` keys the engine's routes by token prefix: the route of position j of a sequence s depends on
s[: j + 1] only, and the first engine forward of a prefix is kept (a later turn's prefill never replaces it), which is
the rule R3 promises. :class:`RouteCheckingTrainer` observes the experts every scoring and training forward actually
ran (``RouterReplay.observe``) and compares them with the oracle at every position that scores a token.
"""

import numpy as np
import torch

from trl_moe_replay import MoEReplayGRPOTrainer
from trl_moe_replay.routing import RouterReplay, decode_routed_experts


class RouteOracle:
    def __init__(self, num_layers: int, top_k: int):
        self.routes: dict[tuple[int, ...], torch.Tensor] = {}
        self.num_layers, self.top_k = num_layers, top_k

    def add(self, tokens: list[int], rows, start: int = 0) -> None:
        """An engine forwarded ``tokens[start : start + len(rows)]`` with these routes (vLLM's row layout)."""
        if isinstance(rows, str):
            rows = decode_routed_experts(rows)
        rows = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        for j in range(rows.shape[0]):
            self.routes.setdefault(tuple(tokens[: start + j + 1]), rows[j])

    def record_generate(self, generate, rr: RouterReplay, eos_token_id: int, steer=None):
        """Wrap a transformers ``generate`` (an engine) so that every call's routes are added; ``steer(call_index)``
        optionally gives a RouterReplay.steer function per call (to make each call route differently)."""
        calls = iter(range(1_000_000))

        def recorded(*args, **kwargs):
            index = next(calls)
            steering = rr.steer(steer(index)) if steer is not None else _nullcontext()
            with steering, rr.record() as rec:
                out = generate(*args, **kwargs)
            mask = kwargs["attention_mask"]
            width = mask.shape[1]
            for row, row_mask, routes in zip(out, mask, rec.routes, strict=True):
                start = width - int(row_mask.sum())
                completion = row[width:].tolist()
                end = completion.index(eos_token_id) + 1 if eos_token_id in completion else len(completion)
                tokens = row[start : width + end].tolist()
                # the final sampled token is never forwarded for this sample (generate keeps feeding finished rows
                # EOS/padding, but no engine forwards a finished sequence)
                self.add(tokens, routes[start : start + len(tokens) - 1].numpy())
            return out

        return recorded

    def expected(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, S, L, K]`` the engine's routes for a forward's input (-1 where no engine forwarded the prefix)."""
        batch, seq = input_ids.shape
        out = torch.full((batch, seq, self.num_layers, self.top_k), -1, dtype=torch.long)
        for i in range(batch):
            real = attention_mask[i].bool()
            start = int((~real).cumsum(0).eq(torch.arange(1, seq + 1)).sum())  # left padding
            tokens = input_ids[i, start:][real[start:]].tolist()
            for j in range(len(tokens)):
                route = self.routes.get(tuple(tokens[: j + 1]))
                if route is not None:
                    out[i, start + j] = route
        return out


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class RouteCheckingTrainer(MoEReplayGRPOTrainer):
    """Compares the experts every scoring and training forward used with ``self.oracle``, token by token.

    ``checked_positions`` counts the (sample, position) pairs checked over all forwards, ``forwards`` the forwards.
    With ``count_mismatches`` (a negative control, e.g. under ``routing_replay="none"``) a position whose experts
    differ from the engine's is counted in ``mismatched_positions`` instead of failing the run.
    """

    oracle: RouteOracle
    checked_positions = 0
    mismatched_positions = 0
    forwards = 0
    count_mismatches = False

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        used: dict[int, list[torch.Tensor]] = {}
        with self._route_replay.observe(lambda call: used.setdefault(call.layer, []).append(call.used.detach())):
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        self.forwards += 1
        if not self.oracle.routes:  # no engine routes in this run (r2 against an engine without them)
            return result
        expected = self.oracle.expected(input_ids.cpu(), attention_mask.cpu())
        # every real position but each sequence's last was forwarded by the engine (the last one too when TRL
        # truncated the sample: the engine went on generating, but that position scores no token)
        last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).int().argmax(-1)
        scored = attention_mask.bool().cpu().clone()
        scored[torch.arange(scored.shape[0]), last.cpu()] = False
        off_route = torch.zeros_like(scored)  # scored positions where some layer used other experts
        for layer, calls in used.items():
            ids = torch.cat(calls).view(input_ids.shape[0], input_ids.shape[1], -1).cpu().long()
            want = expected[:, :, layer]
            assert (want[scored] >= 0).all(), f"layer {layer}: a scored position has no engine route"
            differ = (ids.sort(-1).values != want.sort(-1).values).any(-1) & scored
            assert self.count_mismatches or not differ.any(), (
                f"layer {layer}: the experts used differ from the engine's"
            )
            off_route |= differ
        self.mismatched_positions += int(off_route.sum())
        self.checked_positions += int(scored.sum())
        return result
