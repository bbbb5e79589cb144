"""PR2 route predictors: one zero-initialised linear map per MoE router, and the predictor's loss.

Predictive Routing Replay (Dong et al., arXiv 2606.00395) adds to each router a bias-free linear predictor
``W_p`` (hidden -> experts) of the short-horizon drift of the router logits. With router input ``h`` and router
logits ``p = h W^T``, the predicted distribution and route are

    q = softmax(p + h W_p^T),    I = TopK(q, k)                                         (paper Eqs. 9-10)

and the predictor is trained on cached ``(h_old, p_old)`` against the *current* router's distribution:

    L = sum over layers of mean over tokens of KL( sg[softmax(p_current)] || softmax(p_old + h_old W_p^T) )

``nn.Linear(hidden, E)`` stores its weight ``[E, hidden]`` exactly like every supported router's ``weight``, so
``p + h W_p^T`` is the router's own linear layer with weight ``W + W_p``. The predicted route is taken that way:
the router's own ``forward`` runs with the shifted weight, so its own selection rule picks the experts (softmax
top-k, or sigmoid plus correction bias and group limits for DeepSeek-V3-style routers, as the authors' port does
with ``routing(logits + delta)``). A zero predictor therefore gives the router's natural route bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class RoutePredictors(nn.Module):
    """The PR2 predictors of one model: ``layers[str(layer)]`` is ``nn.Linear(hidden, num_experts, bias=False)``.

    Built from ``{absolute layer index: router}`` (``RouterReplay.routers()``), zero-initialised without touching
    the global RNG (so a run with PR2 samples exactly like one without), in fp32 (the predictor trains with a
    learning rate ~1e3 times the policy's), each on its router's device. Keep it outside the model: it is not a
    parameter of the policy and is saved on its own.
    """

    def __init__(self, routers: dict[int, nn.Module]):
        super().__init__()
        if not routers:
            raise ValueError("RoutePredictors needs at least one router")
        self.moe_layers: list[int] = sorted(routers)
        self.layers = nn.ModuleDict()
        for layer in self.moe_layers:
            weight = routers[layer].weight
            num_experts, hidden = weight.shape
            linear = torch.nn.utils.skip_init(
                nn.Linear, hidden, num_experts, bias=False, device=weight.device, dtype=torch.float32
            )
            nn.init.zeros_(linear.weight)
            self.layers[str(layer)] = linear

    def shift(self, layer: int, router_input: torch.Tensor) -> torch.Tensor:
        """The predicted logit shift ``h W_p^T`` in fp32, ``[N, E]`` for ``router_input`` ``[N, hidden]``."""
        linear = self.layers[str(layer)]
        return linear(router_input.to(device=linear.weight.device, dtype=torch.float32))

    @torch.no_grad()
    def choose(
        self, layer: int, router: nn.Module, router_input: torch.Tensor, logits: torch.Tensor, natural: torch.Tensor
    ) -> torch.Tensor:
        """The predicted route: the router's own choice with logits ``p + h W_p^T`` (a ``RouterReplay.steer`` fn)."""
        weight = router.weight
        shifted = weight + self.layers[str(layer)].weight.to(device=weight.device, dtype=weight.dtype)
        with _weight_replaced(router, shifted):
            # `forward`, not `__call__`: no hook (ours or anyone's) sees this second evaluation of the router
            return router.forward(router_input)[2]


@contextlib.contextmanager
def _weight_replaced(router: nn.Module, weight: torch.Tensor) -> Iterator[None]:
    original = router._parameters["weight"]
    router._parameters["weight"] = weight
    try:
        yield
    finally:
        router._parameters["weight"] = original


def predictor_kl(old_logits: torch.Tensor, shift: torch.Tensor, current_logits: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(softmax(current) || softmax(old + shift))`` (``[N]``; only ``shift`` carries gradient).

    The paper's post-routing matching loss (``kl-post``, the authors' default). Softmax over the logits for every
    router family, as in the authors' port, sigmoid-scored routers included.
    """
    if not old_logits.shape == shift.shape == current_logits.shape:
        raise ValueError(
            f"old logits {tuple(old_logits.shape)}, predicted shift {tuple(shift.shape)} and current logits "
            f"{tuple(current_logits.shape)} must have the same [tokens, experts] shape"
        )
    log_predicted = F.log_softmax(old_logits.detach().float() + shift, dim=-1)
    log_target = F.log_softmax(current_logits.detach().float(), dim=-1)
    return F.kl_div(log_predicted, log_target, log_target=True, reduction="none").sum(dim=-1)
