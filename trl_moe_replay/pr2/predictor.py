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
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ..upstream import transformers_seam
from ..upstream.torch_seam import parameter_replaced


class RoutePredictor(nn.Module):
    """One router's predictor ``W_p`` (``[num_experts, hidden]``, fp32, zero-initialised).

    Every use goes through ``__call__``: without ``router`` it returns the logit shift ``h W_p^T``; with it, the
    route the router picks with weight ``W + W_p``. Engines that materialise a parameter only inside its module's
    forward (DeepSpeed ZeRO-3 gathers in forward hooks) then see the full weight in both uses.
    """

    def __init__(self, num_experts: int, hidden: int, device: torch.device):
        super().__init__()
        # torch.zeros: no draw from the global RNG, so a run with PR2 samples exactly like one without
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, device=device, dtype=torch.float32))

    def forward(self, router_input: torch.Tensor, router: nn.Module | None = None) -> torch.Tensor:
        if router is None:
            return F.linear(router_input.to(device=self.weight.device, dtype=torch.float32), self.weight)
        with torch.no_grad(), _weight_shifted(router, self.weight):
            # `forward`, not `__call__`: no hook (ours or anyone's) sees this second evaluation of the router
            output = router.forward(router_input)
            return transformers_seam.split_router_output(
                output, transformers_seam.router_ids_first(router), type(router).__name__
            )[2]


class RoutePredictors(nn.Module):
    """The PR2 predictors of one model: ``layers[str(layer)]`` is a [`RoutePredictor`] ``[num_experts, hidden]``.

    Built from ``{absolute layer index: router}`` (``RouterReplay.routers()``), each on its router's device, in fp32
    (the predictor trains with a learning rate ~1e3 times the policy's). ``PredictiveRoutingReplay`` registers it in
    the model (so DDP, FSDP and DeepSpeed see it like any parameter) and keeps it out of the saved model.
    """

    def __init__(self, routers: dict[int, nn.Module]):
        super().__init__()
        if not routers:
            raise ValueError("RoutePredictors needs at least one router")
        self.moe_layers: list[int] = sorted(routers)
        self.layers = nn.ModuleDict()
        for layer in self.moe_layers:
            weight = cast(torch.Tensor, routers[layer].weight)  # nn.Module's attributes are typed Tensor | Module
            # under DeepSpeed ZeRO-3 (zero.Init) a partitioned weight is empty; ds_shape is its real shape
            num_experts, hidden = getattr(weight, "ds_shape", weight.shape)
            self.layers[str(layer)] = RoutePredictor(num_experts, hidden, weight.device)

    def shift(self, layer: int, router_input: torch.Tensor) -> torch.Tensor:
        """The predicted logit shift ``h W_p^T`` in fp32, ``[N, E]`` for ``router_input`` ``[N, hidden]``."""
        return self.layers[str(layer)](router_input)

    def choose(
        self, layer: int, router: nn.Module, router_input: torch.Tensor, logits: torch.Tensor, natural: torch.Tensor
    ) -> torch.Tensor:
        """The predicted route: the router's own choice with logits ``p + h W_p^T`` (a ``RouterReplay.steer`` fn)."""
        return self.layers[str(layer)](router_input, router)


@contextlib.contextmanager
def _weight_shifted(router: nn.Module, shift: torch.Tensor) -> Iterator[None]:
    """Within the context the router's stored weight is ``W + shift``. Under a LoRA on the router (PEFT's
    ``ParamWrapper``), the weight is a parametrization ``W + BA`` while the router runs: the shift goes into the
    stored ``W``, so the router evaluates ``W + shift + BA`` (the adapted router, shifted)."""
    owner: nn.Module
    if parametrize.is_parametrized(router, "weight"):
        owner, name = cast(Any, router.parametrizations).weight, "original"
    else:
        owner, name = router, "weight"
    original = getattr(owner, name)
    with parameter_replaced(owner, name, original + shift.to(device=original.device, dtype=original.dtype)):
        yield


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
