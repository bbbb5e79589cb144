"""Weight sync into vLLM through vLLM's own reload, and a check that the weights arrived.

TRL 1.16 syncs the trainer's weights into vLLM parameter by parameter: ``model.load_weights`` on the colocated
engine's model, an NCCL broadcast to a server. Neither works on vLLM's CPU build: TRL's communicator needs CUDA,
and the CPU backend replaces parameters after loading so a direct ``load_weights`` fails. A transformers-5 Mixtral's
fused names are also rejected by vLLM 0.28-0.31's Mixtral loader on any device. ``vllm_weight_sync="reload"``
sends the weights the way a fresh engine reads a checkpoint instead: under the checkpoint's names and layout
(``checkpoint_named_tensors``, transformers' own reversion) through vLLM's ``reload_weights``, which re-runs the
backend's weight processing (on CPU with the plugin's re-pack, ``trl_moe_replay_vllm_plugin``):

* colocate: ``llm.collective_rpc("reload_weights", weights_iterator=...)``, in process (TRL's external launcher),
  nothing copied;
* server: the main process writes the tensors to ``sync_dir/model.safetensors`` and asks the server (dev mode, as
  ``trl vllm-serve`` starts it) ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path":
  sync_dir}}``; the server must be able to read that path (same machine, or a shared filesystem).

Then the prefix cache is reset, as TRL does, so cached prompt routes are recomputed under the new weights.

:class:`SyncCheck` scores a fixed probe with the engine and the trainer after each sync: the largest difference of
their log-probs is logged as ``vllm/sync_max_logprob_diff`` (in fp32 on both sides it is ~1e-6 when the weights
arrived, and grows with every update the engine missed).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate.utils import is_peft_model
from safetensors.torch import save_file
from transformers.utils import logging

from ..upstream import trl_named_params, wake_colocated_weights
from .vllm_weights import checkpoint_named_tensors

logger = logging.get_logger(__name__)

SYNC_METHODS = ("auto", "trl", "reload")


def client_without_communicator(client_class: type) -> type:
    """TRL's ``VLLMClient`` without its NCCL weight-transfer communicator (weights go through vLLM's reload)."""

    class ReloadSyncVLLMClient(client_class):
        def init_communicator(self, device=0):
            logger.info("vllm_weight_sync='reload': TRL's NCCL communicator is not opened")

        def close_communicator(self):
            pass

    return ReloadSyncVLLMClient


class ReloadWeightSync:
    """Sync the trainer's weights into TRL's vLLM engine with vLLM's ``reload_weights`` (see the module docstring)."""

    def __init__(self, vllm_generation: Any, accelerator: Any, model: torch.nn.Module, sync_dir: str):
        self.generation = vllm_generation
        self.accelerator = accelerator
        self.model = model  # the unwrapped transformers model: its conversions name the checkpoint
        self.sync_dir = os.path.abspath(sync_dir)
        self.syncs = 0

    def sync(self) -> None:
        generation = self.generation
        wake_colocated_weights(generation)
        tensors = checkpoint_named_tensors(self.model, trl_named_params(generation))
        if generation.mode == "colocate":
            generation.llm.collective_rpc(
                "reload_weights", kwargs=dict(weights_iterator=tensors, is_checkpoint_format=True)
            )
            generation.llm.reset_prefix_cache()
        elif self.accelerator.is_main_process:
            os.makedirs(self.sync_dir, exist_ok=True)
            # gathered one parameter at a time by TRL's iterator; held on the host until written. Under PEFT copied,
            # not referenced: on a CPU `.cpu()` is the parameter itself, and TRL's iterator unmerges the adapter in
            # place when it is exhausted, before the file is written (the engine would get W, not W + BA)
            copy = is_peft_model(self.model)
            save_file({name: tensor.detach().to("cpu", copy=copy).contiguous() for name, tensor in tensors},
                      os.path.join(self.sync_dir, "model.safetensors"))
            client = generation.vllm_client
            response = client.session.post(
                f"{client.base_url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": self.sync_dir}},
            )
            if response.status_code != 200:
                raise RuntimeError(
                    f"the vLLM server refused the weight reload ({response.status_code}: {response.text[:300]}). "
                    "vllm_weight_sync='reload' needs the dev-mode endpoint /collective_rpc (VLLM_SERVER_DEV_MODE=1, "
                    f"which `trl vllm-serve` sets) and read access to {self.sync_dir}."
                )
            client.reset_prefix_cache()
        else:
            for _ in tensors:  # take part in the gathers (DeepSpeed ZeRO-3, FSDP)
                pass
        self.syncs += 1


class SyncCheck:
    """After a weight sync: how far the engine's log-probs of a fixed probe are from the trainer's."""

    def __init__(self, vllm_generation: Any, accelerator: Any):
        self.generation = vllm_generation
        self.accelerator = accelerator
        self.probe: list[int] | None = None

    def set_probe(self, token_ids: list[int]) -> None:
        if self.probe is None and len(token_ids) >= 2:
            self.probe = list(token_ids)

    def measure(self, model: torch.nn.Module) -> float | None:
        """Max |engine - trainer| log-prob over the probe's tokens (main process in server mode; else None)."""
        if self.probe is None:
            return None
        # the trainer's side first, on every rank: a sharded model's forward is a collective (expert parallelism)
        with torch.no_grad():
            ids = torch.tensor([self.probe], device=self.accelerator.device)
            logits = model(input_ids=ids).logits[0, :-1].float()
            trainer = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].cpu()
        engine = self._engine_logprobs()
        if engine is None:
            return None
        return float((trainer - torch.tensor(engine)).abs().max())

    def _engine_logprobs(self) -> list[float] | None:
        generation = self.generation
        if generation.mode == "colocate":
            from vllm import SamplingParams

            params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
            request = generation.llm.generate([{"prompt_token_ids": self.probe}], params, use_tqdm=False)[0]
            entries = request.prompt_logprobs[1:]
            return [entry[token].logprob for entry, token in zip(entries, self.probe[1:], strict=True)]
        if not self.accelerator.is_main_process:
            return None
        client = generation.vllm_client
        response = client.session.post(
            f"{client.base_url}/v1/completions",
            json={"model": client.model, "prompt": [self.probe], "max_tokens": 1, "temperature": 1.0,
                  "prompt_logprobs": 0, "return_tokens_as_token_ids": True},
        )
        response.raise_for_status()
        entries = response.json()["choices"][0]["prompt_logprobs"][1:]
        logprobs = []
        for entry, token in zip(entries, self.probe[1:], strict=True):
            # vLLM keys the entries by token id (a string in JSON); with return_tokens_as_token_ids also "token_id:N"
            value = entry.get(str(token)) or entry.get(f"token_id:{token}")
            logprobs.append(value["logprob"] if isinstance(value, dict) else float(value))
        return logprobs
