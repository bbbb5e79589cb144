"""The one reload weight sync and the one engine sync check, reached by both trainers (weight_sync/weight_reload.py,
weight_sync/sync_check.py).

Both trainers sync into the same stand-in server: TRL's vLLM contract (trl_moe_replay.testing.FakeVLLMServer) plus
what a dev-mode vLLM server answers to the reload and the check: ``/collective_rpc reload_weights`` reads the written
folder the way a fresh engine reads a checkpoint (transformers' ``from_pretrained``), ``/pause``, ``/resume`` and
``prompt_logprobs``. The real engine runs the same paths in tests/cross_cutting/test_vllm_engine.py and tests/cross_cutting/test_async_engine.py.
"""

import os
import shutil
import tempfile
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayAsyncGRPOTrainer
from trl_moe_replay.async_grpo.async_grpo_trainer import cpu_tree_attention
from trl_moe_replay.core import routing_options
from trl_moe_replay.core.routing_options import ASYNC_TRAINER, SYNC_TRAINER, ReplayMode
from trl_moe_replay.testing import FakeVLLMServer, tiny_moe_model, trl_vllm_transport_stub
from trl_moe_replay.testing.async_workers import ScriptedRolloutWorker
from trl_moe_replay.weight_sync import sync_check, weight_reload
from trl_moe_replay.weight_sync.sync_check import (
    EngineWeightsChangedError,
    SyncCheck,
    SyncCheckUnavailableError,
    WeightSyncNotDeliveredError,
)
from trl_moe_replay.weight_sync.weight_reload import WeightReload, WeightSyncDirError

from tests.trainer.test_grpo_trainer import make_trainer


class ReloadingServer(FakeVLLMServer):
    """FakeVLLMServer answering the reload sync and the sync check as a dev-mode vLLM server does.

    ``drop_reloads``: acknowledge reloads without loading (a transfer that delivers nothing); ``restart()``: back to
    the checkpoint it was started from (a supervisor restarting a crashed server)."""

    def __init__(self, checkpoint: str):
        super().__init__(AutoModelForCausalLM.from_pretrained(checkpoint))
        self.checkpoint = checkpoint
        self.drop_reloads = False
        self.reloaded_from: list[list[str]] = []  # the folder's files at each reload

    def restart(self) -> None:
        self.engine.model.load_state_dict(AutoModelForCausalLM.from_pretrained(self.checkpoint).state_dict())

    def handle(self, method, path, body):
        if method == "POST" and path == "/collective_rpc" and body["method"] == "reload_weights":
            folder = body["kwargs"]["weights_path"]
            self.reloaded_from.append(sorted(os.listdir(folder)))
            if not self.drop_reloads:
                with tempfile.TemporaryDirectory() as fresh:  # the served config, the written weights
                    shutil.copy(os.path.join(self.checkpoint, "config.json"), fresh)
                    os.symlink(os.path.join(folder, "model.safetensors"), os.path.join(fresh, "model.safetensors"))
                    loaded = AutoModelForCausalLM.from_pretrained(fresh).state_dict()
                with self.engine._lock:
                    self.engine.model.load_state_dict(loaded)
            return 200, {}
        if method == "POST" and path in ("/pause", "/resume"):
            return 200, {}
        if method == "POST" and path == "/v1/completions" and (body or {}).get("prompt_logprobs") is not None:
            (probe,) = body["prompt"]
            with self.engine._lock, torch.no_grad():
                logits = self.engine.model(input_ids=torch.tensor([probe])).logits[0, :-1].float()
            logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(probe[1:])[:, None])[:, 0].tolist()
            entries = [None] + [{str(t): {"logprob": v}} for t, v in zip(probe[1:], logprobs, strict=True)]
            return 200, {"choices": [{"index": 0, "text": "", "prompt_logprobs": entries}]}
        return super().handle(method, path, body)


def sync_trainer(tmp_path, server, checkpoint):
    """The synchronous trainer, vLLM server mode, reload sync and sync check; returns it and its sync function."""
    trainer = make_trainer(
        tmp_path,
        checkpoint,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server.url,
        vllm_weight_sync="reload",
        vllm_sync_check=True,
    )
    trainer.model.train()  # as inside train(): the sync's metric goes to the "train" metrics
    return trainer, trainer._sync_vllm_weights


def async_trainer(tmp_path, server, checkpoint):
    """The async trainer, reload sync and sync check (a scripted worker: no sample is needed to sync)."""
    args = MoEReplayAsyncGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        vllm_server_base_url=server.url,
        vllm_weight_sync="reload",
        vllm_sync_check=True,
    )
    trainer = MoEReplayAsyncGRPOTrainer(
        model=checkpoint,
        reward_funcs=lambda completions, **kw: [0.0],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+1="]}),
        rollout_worker=ScriptedRolloutWorker([]),
    )

    def sync():
        with cpu_tree_attention():  # TRL's packed attention, as inside train()
            trainer._sync_weight()

    return trainer, sync


TRAINERS = {"sync": sync_trainer, "async": async_trainer}


def train_a_little(trainer, seed):
    """Stands for an optimizer step: every weight moves."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in trainer.accelerator.unwrap_model(trainer.model).parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)


@pytest.mark.parametrize("kind", TRAINERS)
def test_each_trainer_reloads_its_weights_and_the_check_catches_lost_syncs_and_restarts(tmp_path, checkpoint, kind):
    with ReloadingServer(checkpoint) as server, trl_vllm_transport_stub(server):
        trainer, sync = TRAINERS[kind](tmp_path, server, checkpoint)
        model = trainer.accelerator.unwrap_model(trainer.model)
        assert isinstance(trainer._sync_check, SyncCheck)
        sync()  # the cold sync: the engine already holds these weights
        train_a_little(trainer, 1)
        sync()  # a delivered sync: the engine holds the trainer's weights, bit for bit (checkpoint names round trip)
        served = dict(server.engine.model.named_parameters())
        assert all(torch.equal(param, served[name]) for name, param in model.named_parameters())
        assert server.reloaded_from == [["model.safetensors"]] * 2  # nothing else in the folder, no partial file
        diffs = trainer._metrics["train"]["vllm/sync_max_logprob_diff"]
        assert len(diffs) == 2 and max(diffs) < 1e-4  # fp32 on both sides

        server.drop_reloads = True  # the transfer returns, the engine keeps its weights
        train_a_little(trainer, 2)
        with pytest.raises(WeightSyncNotDeliveredError, match="did not deliver the weights"):
            sync()

        server.drop_reloads = False
        server.restart()  # between two syncs the engine is back at its checkpoint
        train_a_little(trainer, 3)
        with pytest.raises(EngineWeightsChangedError, match="was it restarted"):
            sync()
    if kind == "async":
        trainer.rollout_worker.stop()


def test_both_trainers_go_through_the_one_reload_and_the_one_check(tmp_path, checkpoint, monkeypatch):
    """No private copy: spies on the shared implementations see every step of both trainers' syncs."""
    calls = []

    def spy(cls, name):
        original = getattr(cls, name)

        def recorded(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, recorded)

    spy(WeightReload, "reload")
    spy(WeightReload, "write")
    spy(SyncCheck, "before_sync")
    spy(SyncCheck, "after_sync")
    for kind, build in TRAINERS.items():
        with ReloadingServer(checkpoint) as server, trl_vllm_transport_stub(server):
            trainer, sync = build(tmp_path / kind, server, checkpoint)
            sync()
        assert calls == ["before_sync", "reload", "write", "after_sync"], kind
        calls.clear()


def test_the_write_is_whole_or_absent_and_refuses_a_folder_with_other_weights(tmp_path, monkeypatch):
    reload = WeightReload(base_url="http://unused", sync_dir=str(tmp_path))
    model = tiny_moe_model("qwen3_moe")
    first = reload.write(model.named_parameters())
    written = open(first, "rb").read()

    def crash(tensors, path):  # the process dies while writing
        open(path, "wb").write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(weight_reload, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        reload.write(model.named_parameters())
    assert open(first, "rb").read() == written  # the server still finds the previous weights, whole
    monkeypatch.undo()
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(WeightSyncDirError, match="model-00001-of-00002.safetensors: vLLM would load those too"):
        reload.write(model.named_parameters())


def args(**values):
    defaults = dict(
        use_vllm=True,
        vllm_mode="server",
        routing_replay="r3",
        routing_metrics=None,
        vllm_weight_sync="auto",
        vllm_sync_check=None,
        vllm_enable_sleep_mode=False,
        device=torch.device("cpu"),
    )
    return SimpleNamespace(**{**defaults, **values})


def resolve_sync_check(config, *, asynchronous: bool) -> bool:
    """``routing_options.resolve_sync_check`` for ``config`` (its mode and metrics as the configs resolve them)."""
    mode = ReplayMode(config.routing_replay)
    metrics = mode.replays if config.routing_metrics is None else config.routing_metrics
    return routing_options.resolve_sync_check(config, mode, metrics, ASYNC_TRAINER if asynchronous else SYNC_TRAINER)


def resolve_weight_sync(config, *, asynchronous: bool) -> str | None:
    mode = ReplayMode(config.routing_replay)
    metrics = mode.replays if config.routing_metrics is None else config.routing_metrics
    return routing_options.resolve_weight_sync(config, mode, metrics, ASYNC_TRAINER if asynchronous else SYNC_TRAINER)


@pytest.mark.parametrize("mode, metrics, checked", [("r3", None, True), ("none", True, True), ("none", None, False)])
def test_the_sync_check_resolves_alike_for_both_trainers(mode, metrics, checked):
    for asynchronous in (False, True):
        assert (
            resolve_sync_check(args(routing_replay=mode, routing_metrics=metrics), asynchronous=asynchronous)
            is checked
        )
        assert resolve_sync_check(
            args(routing_replay=mode, vllm_sync_check=not checked), asynchronous=asynchronous
        ) is (not checked)  # an explicit value wins
    assert resolve_sync_check(args(use_vllm=False), asynchronous=False) is False  # no engine to check


def test_a_sleeping_colocated_engine_has_no_sync_check():
    sleeping = dict(vllm_mode="colocate", vllm_enable_sleep_mode=True)
    assert resolve_sync_check(args(**sleeping), asynchronous=False) is False
    with pytest.raises(SyncCheckUnavailableError, match="vllm_enable_sleep_mode=True in colocate mode"):
        resolve_sync_check(args(**sleeping, vllm_sync_check=True), asynchronous=False)


@pytest.mark.parametrize(
    "device, mode, metrics, sync_trainer, async_trainer",
    [
        ("cpu", "r3", None, "reload", "reload"),
        ("cpu", "none", True, "reload", "reload"),
        ("cuda", "r3", None, "trl", "trl"),
        # the one difference (docs/async.md): plain TRL's sync trainer keeps TRL's sync; TRL's async one has none off CUDA
        ("cpu", "none", None, "trl", "reload"),
    ],
)
def test_auto_weight_sync_resolves_where_trl_transfer_cannot_run(device, mode, metrics, sync_trainer, async_trainer):
    config = args(device=torch.device(device), routing_replay=mode, routing_metrics=metrics)
    assert resolve_weight_sync(config, asynchronous=False) == sync_trainer
    assert resolve_weight_sync(config, asynchronous=True) == async_trainer
    assert resolve_weight_sync(args(vllm_weight_sync="trl"), asynchronous=True) == "trl"  # an explicit value wins
    assert resolve_weight_sync(args(use_vllm=False), asynchronous=False) is None


def test_each_trainer_builds_its_sync_by_its_own_constructor_from_the_typed_method(tmp_path):
    """One named constructor per trainer (no ``asynchronous=`` switch), from the method resolved once."""
    config = args(output_dir=str(tmp_path), vllm_server_base_url="http://127.0.0.1:1/", weight_sync_timeout=7)
    method = resolve_weight_sync(config, asynchronous=True)
    assert method is weight_reload.WeightSyncMethod.RELOAD
    transfer = weight_reload.async_trainer_weight_transfer(method, config)
    assert isinstance(transfer, weight_reload.ReloadWeightTransfer) and transfer.model is None
    assert (transfer.base_url, transfer.timeout) == ("http://127.0.0.1:1", 7.0)
    assert transfer.sync_dir == str(tmp_path / weight_reload.DEFAULT_SYNC_FOLDER)
    trl = weight_reload.WeightSyncMethod.TRL
    assert weight_reload.async_trainer_weight_transfer(trl, config) is None  # TRL's own transfer
    assert weight_reload.sync_trainer_weight_sync(trl, config, vllm_generation=None, model=None) is None
    assert weight_reload.sync_trainer_weight_sync(None, config, vllm_generation=None, model=None) is None  # no vLLM
    assert sync_check.async_trainer_check(False, accelerator=None, base_url="http://127.0.0.1:1") is None
    assert sync_check.sync_trainer_check(False, accelerator=None, vllm_generation=None) is None


def test_a_process_without_the_engine_joins_the_trainer_forward_only():
    """A server's non-main processes score nothing with the engine but run the probe forward (a sharded model's
    forward needs every rank), and log what the main process measured."""
    forwards = []
    check = SyncCheck(None, lambda model, probe: forwards.append(probe) or torch.zeros(len(probe) - 1))
    model = torch.nn.Linear(1, 1)
    check.before_sync()
    assert check.after_sync(model) is None and forwards == [sync_check.PROBE_TOKENS] and model.training
