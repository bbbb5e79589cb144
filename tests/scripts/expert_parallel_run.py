"""Routing replay on a model sharded at load time with expert parallelism, against DDP on the same data; two CPU
processes (gloo). Launched by ``tests/parallel/test_expert_parallel.py`` as a user launches it:

    torchrun --nproc_per_node 2 tests/scripts/expert_parallel_run.py OUT_DIR train
    torchrun --nproc_per_node 2 tests/scripts/expert_parallel_run.py OUT_DIR server URL CHECKPOINT
    torchrun --nproc_per_node 2 tests/scripts/expert_parallel_run.py OUT_DIR colocate CHECKPOINT

``train``: a tiny Qwen3-MoE (16 experts, top-2) saved once and loaded twice: with
``model_init_kwargs={"distributed_config": {"fsdp_size": 2, "ep_size": 2, "ep_implementation": "all_to_all"}}``
(each rank holds 8 experts, tokens travel by all-to-all, FSDP2 shards the rest) and plainly (DDP, the reference).
Per mode (none, R2, R3 with transformers ``generate`` and a KL term, R3 with threshold replay, PR2) both train on the
same data; the EP run's hooks on the experts modules check that every training forward and backward recompute ran
exactly the replayed experts (under threshold replay: the kept ones, and as many others as the replay counted
replaced), independently of the replay code; the losses, and the max difference of every weight after training
(gathered) from DDP's, go to the report. ``none`` also runs plain ``trl.GRPOTrainer`` on the EP model. PR2 saves a
checkpoint at step 2 (torch distributed checkpoint), and a fresh EP trainer resumes from it to step 4. Then the
all_reduce dispatch (``tp_size 2, ep_size 2``, forward only: accelerate trains tensor parallelism on GPUs only): one
process's routes replayed reproduce its logits. Last, under ``precision``: R3 at lr 1e-6 under bf16 autocast, the EP
model loaded in float32 and in bfloat16 (the update probe's reading of each; in this launch, not one of its own, to
save CI a torchrun start). ``server`` / ``colocate``: R3 with a real vLLM CPU engine (a server at URL serving
CHECKPOINT; or one engine per rank), weights synced by vLLM's reload from the EP trainer, each sync checked by the
engine probe.

Each rank writes ``OUT_DIR/rank<i>.json``.
"""

import json
import os
import sys
from pathlib import Path


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # a colocated vLLM CPU engine (scenario "colocate")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM


sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharded_run import (  # noqa: E402  (the same route checks)
    ExpertsWatch,
    Spy,
    ThresholdSpy,
    flat,
    logged,
    reward_len,
)

from trl_moe_replay import MoEReplayGRPOConfig  # noqa: E402
from trl_moe_replay.core.metrics import REPLACE_RATE  # noqa: E402
from trl_moe_replay.parallel.sharded import full_tensor, is_sharded_at_load  # noqa: E402
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer  # noqa: E402


OUT = Path(sys.argv[1])
EP = {"fsdp_size": 2, "ep_size": 2, "ep_implementation": "all_to_all"}
SETTINGS = dict(
    use_cpu=True,
    bf16=False,
    report_to="none",
    logging_steps=1,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=6,
    learning_rate=1e-3,
    gradient_accumulation_steps=1,
    num_iterations=2,
    seed=0,
    max_grad_norm=1e6,
    save_strategy="no",
)
STEPS = {"none": 2, "r2": 2, "r3": 3, "pr2": 4}
PROMPTS = [f"{a}+{b}=" for a in range(4) for b in range(4)]


def make_trainer(checkpoint: str, mode: str, sharded: bool, name: str, cls=Spy, peft_config=None, **overrides):
    settings = {
        **SETTINGS,
        "output_dir": str(OUT / name),
        "routing_replay": mode,
        "max_steps": STEPS[mode],
        "model_init_kwargs": {"dtype": "float32", **({"distributed_config": EP} if sharded else {})},
        **overrides,
    }
    if mode == "pr2":
        settings.setdefault("pr2_lr_multiplier", 10.0)
    return cls(
        model=checkpoint,
        reward_funcs=reward_len,
        args=MoEReplayGRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tiny_tokenizer(),
        peft_config=peft_config,
    )


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """Every weight of the trained model, whole (a collective on the EP model)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {name: full_tensor(param.detach()).cpu() for name, param in model.named_parameters()}


def weight_diff(a: dict, b: dict) -> dict:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return {name: float((a[name] - b[name]).abs().max()) for name in a}


def storage(trainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    return {
        "sharded_at_load": is_sharded_at_load(model),
        "wrapper": type(trainer.model_wrapped).__name__,
        "distributed_type": trainer.accelerator.distributed_type.value,
        "experts_placements": [str(p) for p in getattr(experts, "placements", ())],
        "experts_local": list(experts.to_local().shape) if hasattr(experts, "to_local") else list(experts.shape),
        "experts_full": list(experts.shape),
    }


def train_modes(checkpoint: str) -> dict:
    result = {}
    for mode in ("none", "r2", "r3"):
        extra = {"beta": 0.04} if mode == "r3" else {}  # R3 with a KL term: the reference model is sharded too
        ddp = make_trainer(checkpoint, mode, sharded=False, name=f"{mode}_ddp", **extra)
        ddp.train()
        ep = make_trainer(checkpoint, mode, sharded=True, name=f"{mode}_ep", **extra)
        ep.train()
        result[mode] = {
            "loss": logged(ep, "loss"),
            "ddp_loss": logged(ddp, "loss"),
            "routes": ep.route_checks,
            "ddp_routes": ddp.route_checks,
            "weight_diff": weight_diff(full_weights(ep), full_weights(ddp)),
            "storage": storage(ep),
            "ddp_storage": storage(ddp),
            "hooks": ep._route_replay is not None,
            "fallback": logged(ep, "routing/fallback_frac"),
            "kl": logged(ep, "kl"),
            "ddp_kl": logged(ddp, "kl"),
            "ref_sharded": is_sharded_at_load(ep.ref_model) if ep.ref_model is not None else None,
        }
        if mode == "none":  # plain TRL on the same EP model: what routing_replay="none" must be
            from trl import GRPOConfig, GRPOTrainer

            settings = {
                **SETTINGS,
                "output_dir": str(OUT / "trl_ep"),
                "max_steps": STEPS["none"],
                "model_init_kwargs": {"dtype": "float32", "distributed_config": EP},
            }
            plain = GRPOTrainer(
                model=checkpoint,
                reward_funcs=reward_len,
                args=GRPOConfig(**settings),
                train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                processing_class=tiny_tokenizer(),
            )
            plain.train()
            result[mode]["trl_loss"] = logged(plain, "loss")
            result[mode]["trl_weight_diff"] = weight_diff(full_weights(ep), full_weights(plain))
    return result


def train_threshold(checkpoint: str) -> dict:
    """R3 with threshold replay at 1 on EP and DDP: a generation batch's on-policy update (nothing to reject) and its
    off-policy one (the moved router rejects some replayed experts); the EP run's hooks compare the experts that ran
    with the replace counts behind ``routing/replace_rate`` (sharded_run.ThresholdSpy)."""
    trainers = {}
    for sharded in (False, True):
        trainer = make_trainer(
            checkpoint,
            "r3",
            sharded=sharded,
            name=f"threshold_{'ep' if sharded else 'ddp'}",
            cls=ThresholdSpy,
            max_steps=2,
            replay_score_threshold=1.0,
        )
        trainer.train()
        trainers["ep" if sharded else "ddp"] = trainer
    ep, ddp = trainers["ep"], trainers["ddp"]
    layers = sorted({name for entry in ep.state.log_history for name in entry if name.startswith(f"{REPLACE_RATE}/")})
    return {
        "loss": logged(ep, "loss"),
        "ddp_loss": logged(ddp, "loss"),
        "replace_rate": logged(ep, REPLACE_RATE),
        "ddp_replace_rate": logged(ddp, REPLACE_RATE),
        "replace_rate_layers": {name: logged(ep, name) for name in layers},
        "ddp_replace_rate_layers": {name: logged(ddp, name) for name in layers},
        "routes": ep.route_checks,
        "ddp_routes": ddp.route_checks,
        "top_k": ep._route_replay.top_k,
        "weight_diff": weight_diff(full_weights(ep), full_weights(ddp)),
        "storage": storage(ep),
    }


def train_pr2_and_resume(checkpoint: str) -> dict:
    """PR2 on EP and DDP (4 steps, a checkpoint at step 2 on EP), then a fresh EP trainer resumed from it."""
    ddp = make_trainer(checkpoint, "pr2", sharded=False, name="pr2_ddp")
    ddp.train()
    ep = make_trainer(checkpoint, "pr2", sharded=True, name="pr2_ep", save_strategy="steps", save_steps=2)
    ep.train()
    uninterrupted = full_weights(ep)
    result = {
        "loss": logged(ep, "loss"),
        "ddp_loss": logged(ddp, "loss"),
        "routes": ep.route_checks,
        "pr2_loss": logged(ep, "pr2/loss"),
        "ddp_pr2_loss": logged(ddp, "pr2/loss"),
        "weight_diff": weight_diff(uninterrupted, full_weights(ddp)),
        "storage": storage(ep),
    }
    saved = OUT / "pr2_ep" / "checkpoint-2"
    result["checkpoint_files"] = sorted(p.name for p in saved.iterdir())
    result["shard_files"] = sorted(p.name for p in (saved / "distributed").iterdir())
    resumed = make_trainer(checkpoint, "pr2", sharded=True, name="pr2_ep_resumed")
    resumed.train(resume_from_checkpoint=str(saved))
    result["resumed"] = {
        "global_step": resumed.state.global_step,
        "loss": logged(resumed, "loss"),
        "weight_diff": weight_diff(full_weights(resumed), uninterrupted),
        "predictors": flat(resumed._pr2.full_state_dict()),
        "uninterrupted_predictors": flat(ep._pr2.full_state_dict()),
    }
    # a resume from a checkpoint whose shards are gone is refused in one line, the weights untouched
    broken = OUT / "pr2_ep" / "checkpoint-4"
    if int(os.environ["RANK"]) == 0:
        (broken / "distributed" / ".metadata").unlink()
    torch.distributed.barrier()
    refused = make_trainer(checkpoint, "pr2", sharded=True, name="pr2_ep_refused")
    before = full_weights(refused)
    try:
        refused.train(resume_from_checkpoint=str(broken))
        result["refusal"] = None
    except Exception as exc:  # noqa: BLE001  (the test checks the class and the line)
        result["refusal"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "untouched": max(weight_diff(full_weights(refused), before).values()) == 0.0,
        }
    return result


def peft_refusal(checkpoint: str) -> dict:
    """A LoRA adapter on the EP model: refused in one line when the trainer is built."""
    from peft import LoraConfig

    try:
        make_trainer(
            checkpoint,
            "r3",
            sharded=True,
            name="lora_ep",
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        )
    except Exception as exc:  # noqa: BLE001  (the test checks the class and the line)
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def all_reduce_replay(checkpoint: str) -> dict:
    """all_reduce dispatch (needs ep_size == tp_size): one process's routes replayed on the sharded model reproduce
    its logits, shifted routes change them, and the experts modules receive exactly the replayed ids."""
    from transformers.distributed import DistributedConfig

    from trl_moe_replay.routing import RouterReplay, has_route

    ids = torch.randint(6, 60, (2, 12), generator=torch.Generator().manual_seed(3))
    single = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad(), RouterReplay(single).record() as recording:
        reference = single(input_ids=ids).logits
    routes = recording.routes
    sizes = DistributedConfig(tp_size=2, tp_plan="auto", ep_size=2, ep_implementation="all_reduce")
    sharded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, distributed_config=sizes).eval()
    watch = ExpertsWatch(sharded)
    replay = RouterReplay(sharded)
    with torch.no_grad(), replay.replay(routes):
        replayed = sharded(input_ids=ids).logits
    seen = {layer: [c.tolist() for c in calls] for layer, calls in watch.calls.items()}
    expected = {layer: routes[:, :, layer].reshape(-1, routes.shape[-1]).tolist() for layer in seen}
    shifted_routes = torch.where(has_route(routes)[..., None], (routes.long() + 1) % 16, routes.long())
    shifted_routes = shifted_routes.to(routes.dtype)
    with torch.no_grad(), replay.replay(shifted_routes):
        shifted = sharded(input_ids=ids).logits
    experts = sharded.model.layers[0].mlp.experts.gate_up_proj
    return {
        "max_diff": float((replayed - reference).abs().max()),
        "shifted_diff": float((shifted - reference).abs().max()),
        "experts_seen_equal_replayed": all(
            sorted(map(sorted, calls[0])) == sorted(map(sorted, expected[layer])) for layer, calls in seen.items()
        )
        and bool(seen),
        "experts_local": list(experts.to_local().shape),
    }


def vllm_run(checkpoint: str, **engine) -> dict:
    """R3 against a real vLLM CPU engine (a server, or colocated in each rank), weights synced from the EP trainer by
    vLLM's reload, each sync checked by the engine probe."""
    from trl_moe_replay.weight_sync.sync_check import SyncCheck

    syncs = []

    class Checked(Spy):
        def _sync_vllm_weights(self):
            model = self.accelerator.unwrap_model(self.model)
            before = self._sync_check.measure(model) if syncs else None  # the engine's first weights: the file's
            super()._sync_vllm_weights()
            after = self._sync_check.measure(model)
            syncs.append({"step": self.state.global_step, "before": before, "after": after})

    trainer = make_trainer(
        checkpoint,
        "r3",
        sharded=True,
        name=f"vllm_{engine['vllm_mode']}",
        cls=Checked,
        use_vllm=True,
        vllm_sync_check=True,
        learning_rate=3e-2,
        max_completion_length=8,
        **engine,
    )
    assert isinstance(trainer._sync_check, SyncCheck)
    trainer.train()
    return {
        "loss": logged(trainer, "loss"),
        "routes": trainer.route_checks,
        "syncs": syncs,
        "sync_metric": logged(trainer, "vllm/sync_max_logprob_diff"),
        "fallback": logged(trainer, "routing/fallback_frac"),
        "mismatch": logged(trainer, "routing/mismatch_frac"),
        "weight_sync": type(trainer._weight_sync).__name__,
        "storage": storage(trainer),
    }, trainer


def precision_runs(checkpoint: str) -> dict:
    """R3 on the EP model at lr 1e-6 under bf16 autocast (bf16=True), loaded in float32 (the shipped EP configs: fp32
    masters) and in bfloat16 (updated in place): what the update probe logs, the stored dtype, the compute dtype."""
    result = {}
    for dtype in ("float32", "bfloat16"):
        trainer = make_trainer(
            checkpoint,
            "r3",
            sharded=True,
            name=f"precision_{dtype}",
            bf16=True,
            learning_rate=1e-6,
            max_steps=2,
            model_init_kwargs={"dtype": dtype, "distributed_config": EP},
        )
        model = trainer.accelerator.unwrap_model(trainer.model)
        computed = set()
        handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(
            lambda module, args, output, computed=computed: computed.add(str(output.dtype))
        )
        trainer.train()
        handle.remove()
        result[dtype] = {
            "updated_frac": logged(trainer, "precision/updated_frac"),
            "stored": sorted({str(p.dtype) for p in model.parameters()}),
            "computed": sorted(computed),
            "sharded_at_load": is_sharded_at_load(model),
        }
    return result


def main():
    scenario = sys.argv[2]
    rank = int(os.environ["RANK"])
    if scenario == "train":
        checkpoint = str(OUT / f"model_rank{rank}")  # the same seeded weights, one folder per rank (no race)
        tiny_moe_model("qwen3_moe", num_experts=16).save_pretrained(checkpoint)
        result = train_modes(checkpoint)
        result["threshold"] = train_threshold(checkpoint)
        result["pr2"] = train_pr2_and_resume(checkpoint)
        result["peft_refusal"] = peft_refusal(checkpoint)
        result["all_reduce"] = all_reduce_replay(checkpoint)
        result["precision"] = precision_runs(checkpoint)
    elif scenario == "server":
        result, _ = vllm_run(sys.argv[4], vllm_mode="server", vllm_server_base_url=sys.argv[3])
    else:  # colocate: one engine in each rank (TRL's external launcher)
        result, _ = vllm_run(sys.argv[3], vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
    result["rank"], result["world"] = rank, int(os.environ["WORLD_SIZE"])
    (OUT / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
