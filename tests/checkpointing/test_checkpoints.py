"""Stopping and resuming (trl_moe_replay.checkpointing.checkpoints, recipes/grpo_r3.py): Ctrl-C saves a checkpoint at a
generation-batch boundary, a bare --resume_from_checkpoint finds the newest complete one, a resumed run continues the
uninterrupted one bit for bit (the MoE expert weights restored through from_pretrained's conversion, PR2's predictors
too), and a re-run says what it does with an earlier run."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import TrainerControl
from trl import GRPOTrainer

from trl_moe_replay.checkpointing import checkpoints
from trl_moe_replay.checkpointing.checkpoint_weights import CheckpointWeightsError
from trl_moe_replay.checkpointing.checkpoints import (
    NoCheckpointError,
    SaveOnInterrupt,
    describe_run,
    generation_period,
    newest_checkpoint,
    resolve_resume,
    saves_inside_generation_batches,
)
from trl_moe_replay.testing import tiny_moe_model

from tests.helpers import CPU_ONLY_ENV, load_script, run_two_ranks
from tests.pr2.test_state import OFF_POLICY
from tests.trainer.test_grpo_trainer import make_trainer


ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_r3.py"


def fake_checkpoint(output_dir: Path, step: int, max_steps: int = 10, complete: bool = True) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    if complete:  # the Trainer writes trainer_state.json last
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": max_steps}))
    return folder


def test_resume_true_names_the_newest_complete_checkpoint(tmp_path):
    assert resolve_resume(None, tmp_path) is None and resolve_resume("false", tmp_path) is None
    with pytest.raises(NoCheckpointError, match="no checkpoint in"):
        resolve_resume("true", tmp_path)
    fake_checkpoint(tmp_path, 5)
    newest = fake_checkpoint(tmp_path, 20)
    fake_checkpoint(tmp_path, 100, complete=False)  # a save cut short: not a resume point
    (tmp_path / "checkpoint-x").mkdir()
    for value in (True, "true", "True", ""):
        assert resolve_resume(value, tmp_path) == str(newest)
    assert newest_checkpoint(tmp_path) == newest
    assert resolve_resume(str(tmp_path / "checkpoint-5"), tmp_path) == str(tmp_path / "checkpoint-5")
    with pytest.raises(NoCheckpointError, match="no such folder"):
        resolve_resume(str(tmp_path / "checkpoint-7"), tmp_path)


def test_describe_run_tells_finished_from_unfinished(tmp_path):
    assert describe_run(tmp_path / "absent") is None and describe_run(tmp_path) is None
    fake_checkpoint(tmp_path, 150, max_steps=200)
    assert describe_run(tmp_path) == "an unfinished run (last checkpoint at step 150 of 200)"
    fake_checkpoint(tmp_path, 200, max_steps=200)
    assert describe_run(tmp_path) == "a finished run of 200 steps"


def test_describe_run_reads_the_state_with_a_bound(tmp_path, monkeypatch):
    from trl_moe_replay import bounded_json

    monkeypatch.setattr(bounded_json, "MAX_JSON_VALUES", 100)
    state = fake_checkpoint(tmp_path, 5) / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 5, "max_steps": 10, "log_history": [{}] * 200}))
    described = describe_run(tmp_path)
    assert described.startswith(f"an earlier run ({state} unreadable: ") and "\n" not in described
    assert "JSON values, more than the 100 read" in described


def test_describe_run_names_the_file_holding_a_number_python_will_not_convert(tmp_path):
    state = fake_checkpoint(tmp_path, 5) / "trainer_state.json"
    state.write_text('{"global_step": ' + "9" * 5000 + ', "max_steps": 10}')  # json: ValueError, 4,300-digit limit
    described = describe_run(tmp_path)
    assert described.startswith(f"an earlier run ({state} unreadable: {state} holds a number Python refuses to ")
    assert "\n" not in described


@pytest.mark.parametrize(
    "steps_per_generation, num_iterations, accumulation, period",
    [
        (1, 1, 1, 1),
        (4, 1, 1, 4),
        (4, 1, 4, 1),
        (4, 2, 4, 2),
        (2, 3, 1, 6),
        (4, 1, 8, 1),
    ],
)
def test_generation_period(steps_per_generation, num_iterations, accumulation, period):
    args = SimpleNamespace(
        steps_per_generation=steps_per_generation,
        num_iterations=num_iterations,
        gradient_accumulation_steps=accumulation,
    )
    assert generation_period(args) == period


@pytest.mark.parametrize(
    "save_steps, strategy, warned",
    [
        (50, "steps", "save_steps 50 is not a multiple of the generation period, 4 optimizer steps"),
        (48, "steps", None),
        (52, "steps", None),
        (50, "no", None),
        (50, "epoch", None),
        (0.25, "steps", None),
        (2, "steps", "use 4"),  # below one period: no lower multiple to offer
    ],
)
def test_a_save_interval_between_generation_batches_is_warned_in_one_line(save_steps, strategy, warned):
    """64 micro-batches per generation batch over 16 accumulation steps: a new generation batch every 4 optimizer
    steps (the 30B server configs), so only a multiple of 4 saves at a boundary."""
    args = SimpleNamespace(
        steps_per_generation=64,
        num_iterations=1,
        gradient_accumulation_steps=16,
        save_strategy=strategy,
        save_steps=save_steps,
    )
    warning = saves_inside_generation_batches(args)
    if warned is None:
        assert warning is None
    else:
        assert warned in warning and len(warning.splitlines()) == 1
    if save_steps == 50 and strategy == "steps":
        assert warning.endswith("use 48 or 52")


def test_the_config_warns_of_a_save_interval_between_generation_batches(caplog):
    """The config's own check, for every way a config is built (the recipe's YAML and command line build it too)."""
    import logging

    from trl_moe_replay import MoEReplayGRPOConfig

    with caplog.at_level(logging.WARNING):
        MoEReplayGRPOConfig(
            output_dir="/tmp/unused",
            use_cpu=True,
            report_to="none",
            per_device_train_batch_size=8,
            num_generations=8,
            gradient_accumulation_steps=2,
            steps_per_generation=8,
            save_steps=5,
        )
    assert [r.getMessage() for r in caplog.records if "save_steps" in r.getMessage()] == [
        saves_inside_generation_batches(
            SimpleNamespace(
                steps_per_generation=8,
                num_iterations=1,
                gradient_accumulation_steps=2,
                save_strategy="steps",
                save_steps=5,
            )
        )
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        MoEReplayGRPOConfig(
            output_dir="/tmp/unused",
            use_cpu=True,
            report_to="none",
            per_device_train_batch_size=8,
            num_generations=8,
            gradient_accumulation_steps=2,
            steps_per_generation=8,
            save_steps=8,
        )
    assert not [r for r in caplog.records if "save_steps" in r.getMessage()]


# ----------------------------------------------------------------------------- weights and exactness
def weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_transformers_resume_leaves_fused_experts_at_their_initial_values_and_ours_restores_them(tmp_path):
    """The cause of the old resume difference (transformers#48805): save_pretrained writes per-expert weights, the
    Trainer's load_state_dict skips them, and the fused experts keep the weights the model was built with."""
    saved = tiny_moe_model("qwen3_moe", seed=0)
    saved.save_pretrained(tmp_path / "checkpoint")
    with safe_open(tmp_path / "checkpoint" / "model.safetensors", framework="pt") as checkpoint_file:
        on_disk = set(checkpoint_file.keys())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in on_disk  # the Hub layout ...
    assert "model.layers.0.mlp.experts.gate_up_proj" in saved.state_dict()  # ... of fused experts
    expected = weights(saved)
    fused = {name for name in expected if ".mlp.experts." in name}
    assert fused and not fused & on_disk

    trainer = make_trainer(tmp_path / "run", tiny_moe_model("qwen3_moe", seed=1))
    GRPOTrainer._load_from_checkpoint(trainer, str(tmp_path / "checkpoint"))  # TRL's, i.e. transformers' load
    loaded = weights(trainer.model)
    kept_initial = {name for name in expected if not torch.equal(loaded[name], expected[name])}
    assert kept_initial == fused, (
        "transformers restored the fused experts itself: MoEReplayGRPOTrainer."
        "_load_from_checkpoint and restore_checkpoint_weights can go"
    )

    trainer._load_from_checkpoint(str(tmp_path / "checkpoint"))  # ours
    loaded = weights(trainer.model)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


@pytest.mark.parametrize(
    "dropped, says",
    [
        ("model.layers.1.self_attn.q_proj.weight", "'model.layers.1.self_attn.q_proj.weight' is missing from it"),
        (
            "model.layers.1.mlp.experts.3.down_proj.weight",
            "'model.layers.1.mlp.experts.3.down_proj.weight' is missing",
        ),
    ],
)
def test_a_checkpoint_without_some_weights_is_refused_not_resumed_at_initial_values(tmp_path, dropped, says):
    tiny_moe_model("qwen3_moe", seed=0).save_pretrained(tmp_path / "checkpoint")
    tensors = load_file(tmp_path / "checkpoint" / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, tmp_path / "checkpoint" / "model.safetensors", metadata={"format": "pt"})
    trainer = make_trainer(tmp_path / "run", tiny_moe_model("qwen3_moe", seed=1))
    with pytest.raises(CheckpointWeightsError, match=f"checkpoint {tmp_path / 'checkpoint'} refused: {says}"):
        trainer._load_from_checkpoint(str(tmp_path / "checkpoint"))


#: what a resumed run may log differently: how long the steps took
TIMINGS = ("step_time",)


def step_logs(trainer) -> dict[int, dict]:
    return {
        entry["step"]: {k: v for k, v in entry.items() if k not in TIMINGS}
        for entry in trainer.state.log_history
        if "loss" in entry
    }


@pytest.mark.parametrize(
    "mode, settings",
    [
        ("none", {}),
        ("r3", {}),
        ("pr2", dict(pr2_lr_multiplier=10.0, **OFF_POLICY)),  # 2 updates per generation batch: the predictors train
    ],
)
def test_a_resumed_run_continues_the_uninterrupted_one_bit_for_bit(tmp_path, mode, settings):
    """docs/demo.md, "Stopping and resuming": 4 steps straight, and 2 steps resumed from the checkpoint at step 2
    (one thread, as the test session runs), log the same numbers to the last bit and end on the same weights."""

    def run(output_dir):
        return make_trainer(
            output_dir,
            tiny_moe_model("qwen3_moe"),
            routing_replay=mode,
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            **settings,
        )

    full = run(tmp_path / "full")
    full.train()
    resumed = run(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    logs, resumed_logs = step_logs(full), step_logs(resumed)  # steps 1-2 of the resumed run: its checkpoint's
    assert sorted(resumed_logs) == sorted(logs) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed_logs[step] == logs[step], step  # loss, grad_norm, rewards, metrics: exactly
    if mode == "pr2":
        assert any(name.startswith("pr2/") for name in logs[4])
    final, resumed_final = weights(full.model), weights(resumed.model)
    assert all(torch.equal(final[name], resumed_final[name]) for name in final)


@pytest.mark.parametrize("mode", ["none", "r3"])
def test_a_run_resumed_at_its_last_step_trains_nothing_and_ends_on_the_checkpoints_weights(tmp_path, mode, caplog):
    """transformers judges max_steps only after a step: resumed at global_step == max_steps, its loop trains a step
    max_steps + 1. Ours trains none: the checkpoint's weights and step, one line saying the run is complete; with a
    larger max_steps it trains on."""
    full = make_trainer(
        tmp_path / "full", tiny_moe_model("qwen3_moe"), routing_replay=mode, save_strategy="steps", save_steps=2
    )
    full.train()
    final = weights(full.model)
    resumed = make_trainer(tmp_path / "resumed", tiny_moe_model("qwen3_moe"), routing_replay=mode)
    with caplog.at_level("WARNING", logger="trl_moe_replay.checkpointing.checkpoint_weights"):
        output = resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert output.global_step == resumed.state.global_step == 2 and not step_logs(resumed).keys() - {1, 2}
    assert all(torch.equal(final[name], tensor) for name, tensor in weights(resumed.model).items())
    assert "resumed at step 2 of 2: the run is complete, no step is trained" in caplog.text
    more = make_trainer(tmp_path / "more", tiny_moe_model("qwen3_moe"), routing_replay=mode, max_steps=3)
    more.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert more.state.global_step == 3 and sorted(step_logs(more)) == [1, 2, 3]


def test_resume_true_skips_a_checkpoint_cut_before_its_state_was_written(tmp_path):
    """The trainer API's resume_from_checkpoint=True resolves as the recipe does (resolve_resume): the newest
    checkpoint with its trainer_state.json (written last), not transformers' newest folder, whose missing state is a
    FileNotFoundError there."""
    first = make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="r3", save_strategy="steps", save_steps=1
    )
    first.train()
    first.end()  # releases output_dir for the next trainer
    (tmp_path / "checkpoint-2" / "trainer_state.json").unlink()  # the save of step 2 cut short
    second = make_trainer(
        tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="r3", save_strategy="steps", save_steps=1
    )
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 2 and sorted(step_logs(second)) == [1, 2]  # step 1 from checkpoint-1's log
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").is_file()  # step 2 trained and saved again
    second.end()
    for folder in tmp_path.glob("checkpoint-*"):
        shutil.rmtree(folder)
    with pytest.raises(NoCheckpointError, match="no checkpoint in .* to resume from"):
        make_trainer(tmp_path, tiny_moe_model("qwen3_moe")).train(resume_from_checkpoint=True)


# ----------------------------------------------------------------------------- the recipe
@pytest.fixture(scope="module")
def recipe():
    return load_script(RECIPE, "grpo_r3_recipe_resume")


def one_line_exit(capsys, recipe, argv) -> str:
    with pytest.raises(SystemExit) as stopped:
        recipe.parse_args(argv)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], lines
    return lines[0]


def test_bare_resume_flag_means_the_newest_checkpoint(recipe):
    for argv in (["--resume_from_checkpoint"], ["--resume_from_checkpoint", "--max_steps", "3"]):
        _, args, _ = recipe.parse_args(argv)
        assert args.resume_from_checkpoint == "true"
    _, args, _ = recipe.parse_args(["--resume_from_checkpoint", "runs/x/checkpoint-5"])
    assert args.resume_from_checkpoint == "runs/x/checkpoint-5"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--routing_replai", "r3"], "unknown argument: --routing_replai (did you mean --routing_replay?)"),
        (["--routing_replay", "r4"], "invalid choice: 'r4'"),
        (["--max_steps", "five"], "invalid int value: 'five'"),
    ],
)
def test_command_line_mistakes_are_one_line(recipe, capsys, argv, says):
    assert says in one_line_exit(capsys, recipe, argv)


@pytest.mark.parametrize(
    "yaml, says",
    [
        # TRL's field: TrlParser's own refusal (as on plain TRL), named with the file
        ("max_steps: five\n", "invalid int value: 'five' (the value of max_steps in "),
        ("routing_replai: r3\n", "unknown key in "),
        ("routing_replay: r4\n", "routing_replay must be one of"),
    ],
)
def test_config_file_mistakes_are_one_line(recipe, capsys, tmp_path, yaml, says):
    config = tmp_path / "c.yaml"
    config.write_text(yaml)
    line = one_line_exit(capsys, recipe, ["--config", str(config)])
    assert says in line
    if "unknown key" in says:
        assert "routing_replai (did you mean routing_replay?)" in line


def small_args(output_dir, cache_dir, *extra):
    return [
        "--output_dir",
        str(output_dir),
        "--sft_cache_dir",
        str(cache_dir),
        "--max_steps",
        "4",
        "--sft_steps",
        "30",
        "--per_device_train_batch_size",
        "16",
        "--synthetic_samples",
        "64",
        "--plot",
        "false",
        "--save_steps",
        "2",
        *extra,
    ]


def trained_logs(output_dir: Path) -> list[dict]:
    return json.loads((output_dir / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]


@pytest.mark.slow  # three short recipe runs per mode (~1 min quiet, several when the machine is loaded)
@pytest.mark.parametrize(
    "mode, extra, ctrl_c_in_step",
    [
        pytest.param("r3", [], 2, marks=pytest.mark.ci),  # CI runs R3's; make test-all PR2's too
        # PR2 with 2 updates per generation batch: Ctrl-C in step 1 waits for the batch's end, step 2
        ("pr2", ["--routing_replay", "pr2", "--num_iterations", "2"], 1),
    ],
)
def test_interrupted_then_resumed_run_continues_the_uninterrupted_one(
    recipe, tmp_path, capsys, monkeypatch, mode, extra, ctrl_c_in_step
):
    """docs/demo.md: the resumed steps log what the uninterrupted run logs (loss, grad norm, samples, rewards), bit
    for bit."""
    cache = tmp_path / "cache"
    recipe.main(*recipe.parse_args(small_args(tmp_path / "full", cache, *extra)))
    capsys.readouterr()

    def ctrl_c(self, args, state, control, **kwargs):  # a Ctrl-C while step `ctrl_c_in_step` runs
        if state.global_step == ctrl_c_in_step - 1:
            signal.raise_signal(signal.SIGINT)

    handler_before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs in a background job
    with monkeypatch.context() as patch:
        patch.setattr(recipe.SaveOnInterrupt, "on_step_begin", ctrl_c, raising=False)
        patch.setattr(sys, "argv", ["recipes/grpo_r3.py", *small_args(tmp_path / "cut", cache, *extra)])
        trainer = recipe.main(*recipe.parse_args())
    assert trainer.state.global_step == 2
    out = capsys.readouterr().out
    checkpoint = tmp_path / "cut" / "checkpoint-2"
    assert "stopped at step 2 of 4 (" in out
    assert f" s after Ctrl-C); checkpoint saved in {checkpoint}; resume with: " in out
    assert "recipes/grpo_r3.py --output_dir" in out
    assert out.rstrip().endswith(" --resume_from_checkpoint") and "mean reward" not in out  # no final save, no summary
    assert not (tmp_path / "cut" / "model.safetensors").exists()
    assert signal.getsignal(signal.SIGINT) is handler_before  # Ctrl-C behaves as it did before the run
    if mode == "pr2":
        assert (checkpoint / "pr2_predictors.safetensors").is_file()

    recipe.main(*recipe.parse_args([*small_args(tmp_path / "cut", cache, *extra), "--resume_from_checkpoint"]))
    assert f"resuming {tmp_path / 'cut'} from {checkpoint}" in capsys.readouterr().out

    full, resumed = trained_logs(tmp_path / "full"), trained_logs(tmp_path / "cut")
    assert [entry["step"] for entry in resumed] == [entry["step"] for entry in full]
    for a, b in zip(full, resumed, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMINGS} == {k: v for k, v in b.items() if k not in TIMINGS}


@pytest.mark.slow  # two short recipe runs
def test_a_stop_at_the_last_step_says_the_run_is_complete_and_a_resume_trains_nothing(
    recipe, tmp_path, capsys, monkeypatch
):
    """Ctrl-C (or SIGTERM) in the last step: the checkpoint holds the finished run, so the stop line says so instead
    of printing a resume command; a resume anyway trains no step (transformers' loop would train step 3 of 2) and
    writes the final model and the summary."""
    run = tmp_path / "run"
    args = small_args(run, tmp_path / "cache", "--max_steps", "2")

    def ctrl_c(self, args, state, control, **kwargs):  # a Ctrl-C while the last step runs
        if state.global_step == 1:
            signal.raise_signal(signal.SIGINT)

    with monkeypatch.context() as patch:
        patch.setattr(recipe.SaveOnInterrupt, "on_step_begin", ctrl_c, raising=False)
        trainer = recipe.main(*recipe.parse_args(args))
    out = capsys.readouterr().out
    assert trainer.state.global_step == 2
    assert (
        f"s after Ctrl-C): the run is complete; its final weights are in {run / 'checkpoint-2'} (the final save "
        f"into {run} and the summary were skipped)"
    ) in out
    assert "stopped at step 2 of 2 (" in out and "resume with" not in out
    trainer = recipe.main(*recipe.parse_args([*args, "--resume_from_checkpoint"]))
    out = capsys.readouterr().out
    assert trainer.state.global_step == 2 and "mean reward" in out
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [1, 2]
    saved = load_file(run / "model.safetensors")
    restored = load_file(run / "checkpoint-2" / "model.safetensors")
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)


@pytest.mark.slow  # a recipe run (~30 s)
def test_rerun_into_an_output_dir_says_it_starts_over_and_drops_the_old_checkpoints(recipe, tmp_path, capsys):
    run = tmp_path / "run"
    fake_checkpoint(run, 150, max_steps=200)  # an earlier, unfinished run
    recipe.main(*recipe.parse_args(small_args(run, tmp_path / "cache", "--max_steps", "2")))
    out = capsys.readouterr().out
    assert (
        f"{run} holds an unfinished run (last checkpoint at step 150 of 200): starting over, its checkpoints are "
        "deleted when training starts; to continue it instead, stop and run: "
    ) in out
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]
    recipe.main(*recipe.parse_args(small_args(run, tmp_path / "cache", "--max_steps", "2")))
    assert f"{run} holds a finished run of 2 steps: starting over" in capsys.readouterr().out


def stop_when_printed(
    command: list[str], env: dict, cwd, trigger: str, sig: int, *, first: tuple[int, ...] = (), timeout: float = 300
) -> tuple[list[str], int]:
    """Run ``command`` in a session of its own and, when a line of its output contains ``trigger``, send ``sig`` to
    the process groups ``first`` (e.g. the vLLM server's) and then to the command's whole group, as a terminal (Ctrl-C)
    or a scheduler stopping a job (SLURM's scancel: SIGTERM) does. Returns its output lines, read until every process
    has closed its output, and its exit status."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd, start_new_session=True
    )
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if trigger in line:
                for group in (*first, process.pid):
                    os.killpg(group, sig)
                break
        lines += process.stdout.readlines()
        return lines, process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def ctrl_c_at_step_10(command: list[str], env: dict, cwd, sig: int = signal.SIGINT) -> tuple[list[str], int]:
    """One Ctrl-C (or ``sig``) to the whole process group when the run prints "step 10:" (the progress line may
    follow a redrawn bar, stderr, on the same pipe line)."""
    return stop_when_printed(command, env, cwd, "step 10:", sig)


def saved_once(lines: list[str], run) -> str:
    """The one "stopped at step N ..." line; checkpoint-N, at step 10 or later, holds its trainer state."""
    stopped = [line for line in lines if line.startswith("stopped at step")]
    assert len(stopped) == 1, "".join(lines)[-3000:]
    step = int(stopped[0].split()[3])
    assert step >= 10 and (run / f"checkpoint-{step}" / "trainer_state.json").is_file()
    return stopped[0]


@pytest.mark.slow  # the recipe as `make demo` runs it, stopped with a real Ctrl-C (~1 min)
def test_ctrl_c_saves_and_prints_the_resume_command(tmp_path):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        str(RECIPE),
        *small_args(tmp_path / "run", tmp_path / "cache", "--max_steps", "1000", "--save_steps", "1000"),
    ]
    lines, returncode = ctrl_c_at_step_10(command, env, tmp_path)
    assert returncode == 130
    output = "".join(lines)
    stopped = saved_once(lines, tmp_path / "run")
    assert stopped.rstrip().endswith(f"{RECIPE} {' '.join(command[2:])} --resume_from_checkpoint")
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]


def test_sigterm_saves_like_ctrl_c_and_says_what_a_kill_before_the_save_loses(tmp_path, capsys, monkeypatch):
    """docs/demo.md, "Preemption": SIGTERM requests the save Ctrl-C does, at the generation batch's end; its line names
    the checkpoint a kill before then resumes from; a repeated SIGTERM never stops at once (a second Ctrl-C does)."""
    monkeypatch.setattr(checkpoints, "FORCE_AFTER_S", 0.0)
    args = SimpleNamespace(
        output_dir=str(tmp_path),
        steps_per_generation=4,
        num_iterations=1,
        gradient_accumulation_steps=2,
        world_size=1,
        device="cpu",
    )  # generation period: 2 steps
    state, control = SimpleNamespace(is_world_process_zero=True, global_step=2), TrainerControl()
    fake_checkpoint(tmp_path, 2)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    callback = SaveOnInterrupt()
    callback.on_train_begin(args, state, control)
    try:
        signal.raise_signal(signal.SIGTERM)  # in step 3
        signal.raise_signal(signal.SIGTERM)  # a scheduler's second SIGTERM: no KeyboardInterrupt, the save goes on
        assert capsys.readouterr().err == (
            f"\nSIGTERM: saving a checkpoint at the end of step 4, then stopping; killed before, the run resumes from "
            f"{tmp_path / 'checkpoint-2'} and steps 3-4 are lost\n"
        )
        state.global_step = 3  # inside the generation batch: no stop
        callback.on_step_end(args, state, control)
        assert not control.should_save and not control.should_training_stop
        state.global_step = 4
        callback.on_step_end(args, state, control)
        assert control.should_save and control.should_training_stop
        assert callback.checkpoint == str(tmp_path / "checkpoint-4") and callback.exit_status == 143
        assert callback.took().startswith(" (") and callback.took().endswith(" s after SIGTERM)")
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C after the request still stops at once
            signal.raise_signal(signal.SIGINT)
    finally:
        callback.on_train_end(args, state, control)
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_sigterm_whose_line_cannot_be_built_still_saves(tmp_path, capsys, monkeypatch):
    """The handler runs inside whatever the main thread was doing: an error listing output_dir (a stale NFS handle)
    must not escape into it (rank 0 dying there leaves the other ranks waiting in the boundary all-reduce)."""

    def unlistable(output_dir):
        raise OSError("Stale file handle")

    monkeypatch.setattr(checkpoints, "newest_checkpoint", unlistable)
    args = SimpleNamespace(
        output_dir=str(tmp_path),
        steps_per_generation=4,
        num_iterations=1,
        gradient_accumulation_steps=2,
        world_size=1,
        device="cpu",
    )
    state, control = SimpleNamespace(is_world_process_zero=True, global_step=2), TrainerControl()
    callback = SaveOnInterrupt()
    callback.on_train_begin(args, state, control)
    try:
        signal.raise_signal(signal.SIGTERM)  # nothing raised here
        assert capsys.readouterr().err == (
            "\nSIGTERM: saving a checkpoint at the end of this generation batch, then "
            "stopping (the newest checkpoint could not be listed: OSError)\n"
        )
        state.global_step = 4
        callback.on_step_end(args, state, control)
        assert control.should_save and control.should_training_stop
    finally:
        callback.on_train_end(args, state, control)


def test_a_server_gone_during_a_sigterm_stop_is_one_line_naming_the_checkpoint(tmp_path):
    """docs/recipes.md, "Preemption of the whole job": a scheduler that signals the server before the trainer can
    take it away in the middle of a generation batch's weight sync or generation; the step cannot finish and nothing
    is saved by the stop. One line says so and names the checkpoint the run resumes from (the recipe exits 143, no
    traceback). A server failure with no stop requested is no stop: None, the error is raised on. The trainer's own
    SIGTERM may land an instant after the server vanished: it is awaited."""
    import threading

    from trl_moe_replay.weight_sync.server_requests import VLLMServerUnavailableError

    args = SimpleNamespace(
        output_dir=str(tmp_path),
        steps_per_generation=4,
        num_iterations=1,
        gradient_accumulation_steps=1,
        world_size=1,
        device="cpu",
    )  # generation period: 4 steps
    state, control = SimpleNamespace(is_world_process_zero=True, global_step=4), TrainerControl()
    fake_checkpoint(tmp_path, 4)
    callback = SaveOnInterrupt()
    callback.on_train_begin(args, state, control)
    try:
        assert callback.engine_gone(ConnectionError("refused"), 4, wait_s=0.0) is None and not callback.engine_lost
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()  # this process's SIGTERM, just after
        line = callback.engine_gone(VLLMServerUnavailableError("did not answer"), 4, wait_s=30.0)
    finally:
        callback.on_train_end(args, state, control)
    assert line == (
        "SIGTERM: the vLLM server stopped before step 5 could finish (it was stopped too: "
        "VLLMServerUnavailableError), so no checkpoint was saved by this stop; the run resumes from "
        f"{tmp_path / 'checkpoint-4'} and step 5 is lost. Stop the trainer before the server: "
        'docs/recipes.md, "Preemption of the whole job"'
    )
    assert callback.engine_lost and callback.exit_status == 143 and not callback.interrupted


@pytest.mark.slow  # a real vLLM CPU server (started twice) and two short recipe runs against it (~4 min quiet)
@pytest.mark.serial
def test_sigterm_to_the_whole_job_server_first_saves_and_the_run_resumes(tmp_path, vllm_checkpoint):
    """Issue 55, "preemption, whole job": SIGTERM to the vLLM server and then to the trainer, as a scheduler stopping
    the job does. The trainer is inside a generation batch (4 steps from one generation; signalled when step 1 is
    logged), which needs the server no more: it finishes the batch, saves checkpoint-4 and prints the resume command;
    that command, against a restarted server, resumes from checkpoint-4 and trains step 5."""
    from tests.vllm_server import VLLMServer

    server = VLLMServer(vllm_checkpoint, tmp_path / "server.log")
    url = server.start()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        **CPU_ONLY_ENV,
    }
    run = tmp_path / "run"
    command = [
        sys.executable,
        str(RECIPE),
        "--model_name_or_path",
        vllm_checkpoint,
        "--use_vllm",
        "true",
        "--vllm_mode",
        "server",
        "--vllm_server_base_url",
        url,
        "--output_dir",
        str(run),
        "--max_steps",
        "1000",
        "--save_steps",
        "1000",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--steps_per_generation",
        "4",
        "--max_completion_length",
        "8",
        "--synthetic_samples",
        "64",
        "--plot",
        "false",
        "--disable_tqdm",
        "true",
        "--logging_steps",
        "1",
    ]
    try:
        # the server first, then the trainer, once step 1 is logged (transformers' printer): steps 2-4 train on its
        # rollouts
        lines, returncode = stop_when_printed(
            command, env, tmp_path, "'loss'", signal.SIGTERM, first=(server.process.pid,), timeout=600
        )
        output = "".join(lines)
        assert returncode == 143 and "Traceback" not in output, output[-4000:]
        stopped = [x for x in lines if x.startswith("stopped at step")]
        assert len(stopped) == 1 and stopped[0].startswith("stopped at step 4 of 1000 ("), output[-4000:]
        assert (run / "checkpoint-4" / "trainer_state.json").is_file()
        server.process.wait(timeout=60)  # the server exited on its SIGTERM
        server.start()  # a new job: the server again (same port), then the printed command
        resume = stopped[0].split("resume with: ", 1)[1].split()
        result = subprocess.run(
            [sys.executable, *resume[1:], "--max_steps", "5"],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
            cwd=tmp_path,
        )
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        assert f"resuming {run} from {run / 'checkpoint-4'}" in result.stdout
        assert json.loads((run / "trainer_state.json").read_text())["global_step"] == 5
    finally:
        server.stop()


@pytest.mark.serial  # torchrun, two processes
def test_a_sigterm_to_one_rank_stops_every_rank_at_the_same_boundary(tmp_path):
    """SLURM and torchrun signal every process, a Kubernetes pod only its own: a SIGTERM to rank 1 alone stops both
    ranks at the end of the generation batch (the all-reduce), each naming the same checkpoint."""
    result = run_two_ranks(Path(__file__).parents[1] / "scripts" / "stop_signal_ranks.py", tmp_path)
    # the two ranks share one stdout pipe: a rank's line can land right after the other's, before its newline
    reports = [json.JSONDecoder().raw_decode(chunk)[0] for chunk in result.stdout.split("REPORT ")[1:]]
    assert sorted(r["rank"] for r in reports) == [0, 1], result.stdout + result.stderr[-2000:]
    for report in reports:
        assert report["stopped_at"] == 4 and report["save"] and report["exit_status"] == 143, report
        assert report["checkpoint"] == str(tmp_path / "checkpoint-4") and report["sigterm_restored"], report
    assert "SIGTERM on another process: saving a checkpoint at the end of step 4, then stopping" in result.stderr


@pytest.mark.slow  # the recipe under torchrun on two CPU processes, SIGTERM to the process group, resumed (~1-2 min)
@pytest.mark.serial
def test_sigterm_under_torchrun_saves_and_the_printed_command_resumes(tmp_path):
    """docs/demo.md, "Preemption": SIGTERM to the launcher and both ranks (torchrun forwards its own, too) saves one
    checkpoint at the same step on both ranks, prints the resume command, and that command resumes to the next step."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        **CPU_ONLY_ENV,
    }
    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(RECIPE),
        *small_args(run, tmp_path / "cache", "--max_steps", "1000", "--save_steps", "1000"),
    ]
    lines, _ = ctrl_c_at_step_10(command, env, tmp_path, signal.SIGTERM)
    output = "".join(lines)
    stopped = saved_once(lines, run)  # one line: the forwarded second SIGTERM did not stop the ranks without a save
    step = int(stopped.split()[3])
    assert f"SIGTERM: saving a checkpoint at the end of step {step}, then stopping; killed before, " in output
    assert " s after SIGTERM); checkpoint saved in " in stopped
    assert "KeyboardInterrupt" not in output and "no checkpoint saved" not in output, output[-3000:]
    resume = stopped.split("resume with: ", 1)[1].split()
    assert resume[0].endswith("torchrun") and resume[1:4] == ["--standalone", "--nproc_per_node", "2"], stopped
    result = subprocess.run(
        [*resume, "--max_steps", str(step + 1)], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert f"resuming {run} from {run / f'checkpoint-{step}'}" in result.stdout
    assert json.loads((run / "trainer_state.json").read_text())["global_step"] == step + 1


@pytest.fixture(scope="module")
def saved_tiny_model(tmp_path_factory):
    from trl_moe_replay.testing import tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny")
    tiny_moe_model("qwen3_moe").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:1000])


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda f: save_file({}, f / "model.safetensors"), "'model.embed_tokens.weight' is missing from it"),
        (lambda f: truncate(f / "model.safetensors"), "model.safetensors cannot be read (SafetensorError: "),
        (
            lambda f: (
                torch.save(load_file(f / "model.safetensors"), f / "pytorch_model.bin"),
                (f / "model.safetensors").unlink(),
                truncate(f / "pytorch_model.bin"),
            ),
            "pytorch_model.bin cannot be read",
        ),
        (
            lambda f: (
                (f / "model.safetensors").unlink(),
                (f / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n."),
            ),
            "pytorch_model.bin cannot be read (UnpicklingError: ",
        ),
    ],
    ids=["empty safetensors", "truncated safetensors", "truncated bin", "pickle that runs code"],
)
def test_a_refused_resume_is_one_line_on_the_recipe(recipe, saved_tiny_model, tmp_path, capsys, damage, says):
    """docs/failure_behaviour.md: an empty, truncated or hostile weights file ends the recipe with exit status 2 and
    one line naming the checkpoint, no traceback, and no training at initial weights."""
    checkpoint = tmp_path / "run" / "checkpoint-2"
    tiny_moe_model("qwen3_moe", seed=3).save_pretrained(checkpoint)
    damage(checkpoint)
    argv = [
        "--model_name_or_path",
        str(saved_tiny_model),
        "--output_dir",
        str(tmp_path / "run"),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "8",
        "--synthetic_samples",
        "16",
        "--plot",
        "false",
        "--resume_from_checkpoint",
        str(checkpoint),
    ]
    capsys.readouterr()
    assert recipe.run(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().split("\n")  # as a terminal shows them: progress bars redraw their line with \r
    assert "Traceback" not in err and len(lines) <= 3, err
    assert f": error: checkpoint {checkpoint} refused: " in lines[-1], err
    assert says in lines[-1], lines[-1]
    assert not (tmp_path / "run" / "checkpoint-4").exists()


# accelerate's launchers: one process (its simple launcher, a Popen), several (torchrun's agent, which forwards the
# signal to every rank; with --multi_gpu on a CPU machine the ranks train on the CPU, as the recipe's use_cpu default;
# two processes take accelerate's default port, so that one runs serially)
ACCELERATE_LAUNCHES = [
    pytest.param(["--num_processes", "1", "--cpu"], id="one process"),
    pytest.param(["--num_processes", "2", "--multi_gpu"], id="two processes", marks=pytest.mark.serial),
]


@pytest.mark.slow  # the recipe under `accelerate launch`, stopped with a real Ctrl-C (~1-2 min)
@pytest.mark.parametrize("launch", ACCELERATE_LAUNCHES)
def test_ctrl_c_under_accelerate_launch_saves_and_prints_the_resume_command(tmp_path, launch):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launch,
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(RECIPE),
        *small_args(tmp_path / "run", tmp_path / "cache", "--max_steps", "1000", "--save_steps", "1000"),
    ]
    lines, _ = ctrl_c_at_step_10(command, env, tmp_path)
    output = "".join(lines)
    # the launcher's forwarded signal did not count as a second Ctrl-C: every rank saved, then the resume line
    stopped = saved_once(lines, tmp_path / "run")
    assert stopped.rstrip().endswith(" --resume_from_checkpoint") and " launch " in stopped
    assert "interrupted; no checkpoint saved" not in output
    # The launchers print a traceback of their own on SIGINT (accelerate's simple launcher: KeyboardInterrupt in
    # Popen.wait, returning before the run has saved; torchrun's agent: SignalException): no script can stop those.
    # None comes from the training processes.
    for block in output.split("Traceback (most recent call last):")[1:]:
        frames = []
        for line in block.splitlines()[1:]:
            if not line.startswith(" "):  # the exception line ends the traceback
                break
            frames.append(line)
        frames = "\n".join(frames)
        assert "accelerate/commands/launch.py" in block and "grpo_r3.py" not in frames, output[-3000:]
