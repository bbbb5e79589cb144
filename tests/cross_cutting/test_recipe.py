"""recipes/grpo_r3.py: the offline default runs end to end (cold start cached, trainer_state, plots), flags and
config files take precedence over the offline defaults, and every shipped config parses into the config objects."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from trl import get_peft_config

from trl_moe_replay.extras.math.data import HUB_DATASETS
from trl_moe_replay.trainer.grpo_config import ROUTING_REPLAY_MODES

from tests.helpers import load_script, run_two_ranks


ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_r3.py"
# real-model configs; the offline ones (tiny_*.yaml, no model named) are tested where their feature is
RECIPE_CONFIGS = sorted(p for p in (ROOT / "recipes" / "configs").glob("*.yaml") if not p.stem.startswith("tiny_"))
ACCELERATE_CONFIGS = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def recipe():
    module = load_script(RECIPE, "grpo_r3_recipe")
    return module


def small_run_args(output_dir, cache_dir, *extra):
    return [
        "--output_dir",
        str(output_dir),
        "--sft_cache_dir",
        str(cache_dir),
        "--max_steps",
        "2",
        "--sft_steps",
        "30",
        "--per_device_train_batch_size",
        "16",
        "--synthetic_samples",
        "64",
        *extra,
    ]


@pytest.mark.slow  # runs the recipe: cold start and training
@pytest.mark.ci
def test_default_recipe_trains_logs_and_plots(recipe, tmp_path, capsys):
    script_args, training_args, model_args = recipe.parse_args(small_run_args(tmp_path / "run", tmp_path / "cache"))
    assert model_args.model_name_or_path is None and training_args.routing_replay == "r3"
    recipe.main(script_args, training_args, model_args)
    out = capsys.readouterr().out
    assert "cold start: saved" in out and "mean reward:" in out

    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "reward" in h]
    assert [h["step"] for h in logged] == [1, 2]
    assert all(0.0 <= h["reward"] <= 1.0 for h in logged)
    assert all(h["routing/mismatch_frac"] == 0.0 for h in logged)  # fp32, R3: the rollout's routes everywhere
    plots = {p.name: p for p in (tmp_path / "run" / "plots").glob("*.png")}
    assert {"reward.png", "mismatch.png", "routing.png", "loss.png"} <= set(plots)
    assert all(p.read_bytes()[:8] == PNG_SIGNATURE for p in plots.values())

    # the cold start is cached under a key of its settings, with what it measured
    (entry,) = (tmp_path / "cache").iterdir()
    record = json.loads((entry / "cold_start.json").read_text())
    assert record["settings"]["sft"]["steps"] == 30 and 0.0 <= record["report"]["sampled_accuracy"] <= 1.0


# printed on every run, and nothing a user could do about them (issue 31)
UPSTREAM_NOISE = (
    "is_gradient_checkpointing is deprecated",
    "Setting accelerator to CPU",
    "FutureWarning",
    "as a TOML table is deprecated",
)


@pytest.mark.slow  # runs the recipe as `make demo` does, in a process of its own (the warnings of a fresh one)
def test_a_demo_run_prints_no_upstream_noise(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(RECIPE), *small_run_args(tmp_path / "run", tmp_path / "cache", "--plot", "false")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cold start: saved" in result.stdout  # a fresh cold start: DeepSpeed is first imported there
    printed = result.stdout + result.stderr
    assert not [noise for noise in UPSTREAM_NOISE if noise in printed], printed[-3000:]


@pytest.mark.slow  # accelerate launch subprocess
def test_accelerate_launch_reuses_the_cached_cold_start(tmp_path):
    # first run builds the cache (in this process, fast); the launched one must find and reuse it
    recipe = load_script(RECIPE, "grpo_r3_recipe_b")
    recipe.main(
        *recipe.parse_args(small_run_args(tmp_path / "a", tmp_path / "cache", "--max_steps", "1", "--plot", "false"))
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HF_HUB_OFFLINE", None)  # the recipe itself must go offline when no model is named
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--cpu",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(RECIPE),
        *small_run_args(tmp_path / "b", tmp_path / "cache", "--max_steps", "1", "--routing_replay", "none"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cold start: reusing" in result.stdout and "cold start: saved" not in result.stdout
    assert len(list((tmp_path / "cache").iterdir())) == 1
    args = json.loads((tmp_path / "b" / "trainer_state.json").read_text())
    assert args["global_step"] == 1
    assert (tmp_path / "b" / "plots" / "reward.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow  # torchrun, two processes
@pytest.mark.serial
def test_recipe_runs_data_parallel_on_two_cpu_processes(tmp_path):
    result = run_two_ranks(
        RECIPE,
        *small_run_args(tmp_path / "run", tmp_path / "cache", "--max_steps", "2", "--plot", "false"),
        cwd=tmp_path,
    )
    # one data-parallel run (only the main process reports), not two single-process runs on one output_dir
    assert result.stdout.count("mean reward:") == 1
    assert json.loads((tmp_path / "run" / "trainer_state.json").read_text())["global_step"] == 2


def test_without_matplotlib_the_plots_are_skipped_in_one_line_before_training(recipe, tmp_path, capsys, monkeypatch):
    """`plot` is on by default; without matplotlib (a plain install) the run says so in one line, with how to draw the
    plots later, before any work, and trains on (issue 42: it trained, then exited 1 with a MatplotlibMissingError
    traceback). The whole run, exit status 0, in a plain virtualenv: tests/cross_cutting/test_plain_install.py."""

    class Reached(Exception):
        pass

    def load_datasets(*args):  # the first work after the checks: stop here, training would follow
        raise Reached

    monkeypatch.setattr(recipe, "load_datasets", load_datasets)
    run_dir = tmp_path / "my run"
    args = recipe.parse_args(["--output_dir", str(run_dir)])
    with monkeypatch.context() as without:
        without.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError, as without it
        with pytest.raises(Reached):
            recipe.main(*args)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"plots: skipped, matplotlib is not installed; to draw them after the run: pip install "
        f"\"trl-moe-replay[plot]\", then trl-moe-replay plot '{run_dir}'"
    ]
    with pytest.raises(Reached):  # installed (the test extra): nothing said
        recipe.main(*args)
    assert capsys.readouterr().out == ""


def test_offline_defaults_apply_only_without_a_model(recipe, tmp_path):
    _, offline, _ = recipe.parse_args([])
    assert offline.learning_rate == recipe.OFFLINE_DEFAULTS["learning_rate"] and offline.bf16 is False
    assert offline.max_steps == recipe.OFFLINE_DEFAULTS["max_steps"] and offline.max_completion_length == 8
    _, named, model_args = recipe.parse_args(["--model_name_or_path", "some/moe"])
    assert model_args.model_name_or_path == "some/moe"
    assert named.learning_rate == 1e-6 and named.max_steps == -1  # GRPOConfig's own defaults
    if not torch.cuda.is_available():  # ... but still float32 on the CPU (TRL's bf16 default needs a GPU)
        assert named.use_cpu and named.bf16 is False
    # command line beats everything
    _, cli, _ = recipe.parse_args(["--max_steps", "7", "--routing_replay", "r2", "--learning_rate", "0.01"])
    assert (cli.max_steps, cli.routing_replay, cli.learning_rate) == (7, "r2", 0.01)
    # a config file beats the offline defaults, the command line beats the file
    config = tmp_path / "c.yaml"
    config.write_text("max_steps: 9\nlearning_rate: 0.5\nrouting_replay: none\n")
    _, from_file, _ = recipe.parse_args(["--config", str(config), "--max_steps", "3"])
    assert (from_file.max_steps, from_file.learning_rate, from_file.routing_replay) == (3, 0.5, "none")
    with pytest.raises(SystemExit):
        recipe.parse_args(["--routing_replay", "r9"])


def test_model_path_mistakes_are_one_line_before_the_hub(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo" / "checkpoint-50").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "checkpoint-50" / "config.json").write_text("{}")
    for model, says in [
        (
            "runs/dmeo",
            "runs/dmeo is not a local folder, and offline mode (HF_HUB_OFFLINE=1) reads only the Hub "
            "cache, which holds no copy of it (no folder runs/dmeo here either; did you mean runs/demo?)",
        ),
        ("./nowhere", "no model folder at ./nowhere"),
        ("runs/demo/checkpoint-9", "no model folder at runs/demo/checkpoint-9"),
        (
            "runs/demo",
            "runs/demo holds no config.json, so it is not a transformers checkpoint; its newest checkpoint "
            "is runs/demo/checkpoint-50",
        ),
    ]:
        assert recipe.run(["--model_name_or_path", model, "--synthetic_samples", "16"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and ": error: " in lines[0] and says in lines[0], lines


def test_a_hub_id_without_network_is_one_line_at_once(recipe, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    from tests.core.test_launch import closed_port_endpoint

    monkeypatch.chdir(tmp_path)
    endpoint = closed_port_endpoint()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # what a fresh shell has, with nothing answering
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    assert recipe.run(["--model_name_or_path", "someorg/no-such-moe", "--output_dir", "run"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "someorg/no-such-moe is not a local folder and the Hub" in lines[0], lines
    assert "HF_HUB_OFFLINE=1" in lines[0] and captured.out == "" and not (tmp_path / "run").exists()


def test_a_live_runs_output_dir_is_refused_first_and_nothing_else_runs(recipe, tmp_path, capsys):
    import socket

    from trl_moe_replay.core.output_lock import LOCK_NAME

    output_dir = tmp_path / "run"
    checkpoint = output_dir / "checkpoint-1"
    checkpoint.mkdir(parents=True)  # an unfinished run, whose owner is still alive (this test's parent process)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 1, "max_steps": 2}))
    (output_dir / LOCK_NAME).write_text(
        json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "token": "live", "started": "earlier"})
    )
    assert recipe.run(small_run_args(output_dir, tmp_path / "cache")) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and f"output_dir {output_dir} is in use by another trainer: pid {os.getppid()}" in lines[0]
    assert captured.out == ""  # no "holds an unfinished run ...: starting over", no cold start
    assert not (tmp_path / "cache").exists() and checkpoint.is_dir()
    assert json.loads((output_dir / LOCK_NAME).read_text())["token"] == "live"


def test_help_shows_our_arguments_first_in_groups(recipe):
    text = recipe.make_parser().format_help()
    titles = [line for line in text.splitlines() if line[:1].isalpha() and line.endswith(":") and "--" not in line]
    assert titles[:2] == ["this recipe:", "routing replay and MoE objectives:"]
    assert titles[-1] == "options:" and len(titles) == 6
    assert text.splitlines()[0].endswith(" [--config FILE.yaml] [--ARGUMENT VALUE ...]")  # not 238 lines of usage
    where = {
        name: text.index(f"  --{name} ")
        for name in ("tiny_model_type", "routing_replay", "model_name_or_path", "learning_rate")
    }
    assert where["tiny_model_type"] < where["routing_replay"] < where["model_name_or_path"] < where["learning_rate"]
    # TRL's and transformers' descriptions are cut to their first sentence (1,459 lines in all before)
    assert len(text.splitlines()) < 1000


def test_reward_function_registry(recipe):
    from trl_moe_replay.extras.math.rewards import accuracy_reward, format_reward

    assert recipe.reward_functions(["accuracy_reward", "format_reward"]) == [accuracy_reward, format_reward]
    assert recipe.reward_functions(["trl_moe_replay.extras.math.rewards.format_reward"]) == [format_reward]
    with pytest.raises(ValueError, match="Unknown reward function"):
        recipe.reward_functions(["no_such_reward"])


def test_the_offline_demo_rewards_the_stop_with_trls_overlong_punishment(recipe):
    """The offline default: accuracy plus TRL's soft overlong punishment at the run's length limit (DAPO's cache of a
    fifth, at least a token), with nothing masked: a completion cut at max_completion_length scores -1 and stays in
    the loss, so writing on past the answer is pushed down (docs/demo.md, "Why these settings")."""
    script_args, training_args, _ = recipe.parse_args([])
    assert script_args.reward_funcs == ["accuracy_reward", "soft_overlong_punishment"]
    assert training_args.mask_truncated_completions is False
    accuracy, punishment = recipe.reward_functions(script_args.reward_funcs, training_args.max_completion_length)
    # max_completion_length 8, cache 1: a stopped "\boxed{7}<eos>" (4 tokens) or 7 tokens is not punished, a cut one is
    assert punishment(completion_ids=[[1] * 4, [1] * 7, [1] * 8]) == [0.0, 0.0, -1.0]
    assert recipe.reward_functions(["soft_overlong_punishment"], 100)[0](completion_ids=[[1] * 90]) == [-0.5]
    with pytest.raises(ValueError, match="Unknown reward function 'soft_overlong_punishment'"):
        recipe.reward_functions(["soft_overlong_punishment"])  # no length limit known: nothing to punish against


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: p.stem)
def test_recipe_config_builds_the_config_objects(recipe, path):
    # bf16 configs are for GPUs; --use_cpu lets TrainingArguments validate them on this CPU-only machine
    script_args, training_args, model_args = recipe.parse_args(["--config", str(path), "--use_cpu", "true"])
    assert model_args.model_name_or_path and "/" in model_args.model_name_or_path
    assert script_args.dataset_name in HUB_DATASETS
    assert training_args.routing_replay in ROUTING_REPLAY_MODES
    assert len(recipe.reward_functions(script_args.reward_funcs)) == len(script_args.reward_funcs)
    if training_args.reward_weights is not None:
        assert len(training_args.reward_weights) == len(script_args.reward_funcs)
    assert training_args.bf16 and training_args.learning_rate <= 1e-5 and training_args.beta == 0.0
    assert training_args.generation_batch_size % training_args.num_generations == 0
    assert training_args.steps_per_generation % training_args.gradient_accumulation_steps == 0
    peft = get_peft_config(model_args)
    assert (peft is not None) == model_args.use_peft
    if peft is not None:
        assert set(peft.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    # the launch line in the file's comments names an accelerate config that exists
    launch = re.findall(r"--config_file (recipes/accelerate/\S+\.yaml)", path.read_text())
    assert launch and all((ROOT / p).is_file() for p in launch)


PREEMPTION_LINE = re.compile(
    r"^#\s*preemption: TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+), SLURM --signal=TERM@(\d+), "
    r"k8s terminationGracePeriodSeconds: (\d+)$"
)


def launches_several_processes(header: str) -> bool:
    """Whether a config header's launch line starts several processes: torchrun, or an accelerate config file with
    num_processes above 1."""
    files = re.findall(r"--config_file (recipes/accelerate/\S+\.yaml)", header)
    return "torchrun" in header or any(yaml.safe_load((ROOT / f).read_text())["num_processes"] > 1 for f in files)


def test_multi_gpu_config_headers_carry_the_preemption_settings():
    """docs/demo.md, "Preemption": every config launched on several processes names, in one header line, torchrun's
    wait before SIGKILL and scheduler grace periods longer than it (SIGTERM saves at the generation batch's end)."""
    several = []
    for path in RECIPE_CONFIGS:
        header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        found = [m for line in header.splitlines() if (m := PREEMPTION_LINE.match(line))]
        if not launches_several_processes(header):
            continue
        several.append(path.name)
        assert len(found) == 1, f"{path.name}: no single '# preemption: ...' header line"
        shutdown, slurm, kubernetes = map(int, found[0].groups())
        assert 30 < shutdown < slurm and shutdown < kubernetes, f"{path.name}: {found[0].group(0)}"
    assert "qwen3_30b_a3b_vllm_server_zero3.yaml" in several and "granite_1b_a400m_single_gpu.yaml" not in several


def test_qwen3_config_is_the_papers_off4_server_setup(recipe):
    path = ROOT / "recipes" / "configs" / "qwen3_30b_a3b_vllm_server_zero3.yaml"
    script_args, args, model_args = recipe.parse_args(["--config", str(path), "--use_cpu", "true"])
    assert model_args.model_name_or_path == "Qwen/Qwen3-30B-A3B"
    assert script_args.dataset_name == "BytedTsinghua-SIA/DAPO-Math-17k"
    assert args.use_vllm and args.vllm_mode == "server" and args.routing_replay == "r3"
    assert (args.epsilon, args.epsilon_high, args.learning_rate) == (0.2, 0.28, 1e-6)
    # 4 optimizer updates per rollout batch; 512 completions (64 prompts x 8) per rollout batch on 8 GPUs
    assert args.steps_per_generation // args.gradient_accumulation_steps == 4
    assert args.per_device_train_batch_size * 8 * args.steps_per_generation == 64 * args.num_generations


def test_minirl_config_resolves_the_papers_loss_settings(recipe):
    path = ROOT / "recipes" / "configs" / "qwen3_30b_a3b_minirl_r3_vllm_server_zero3.yaml"
    _, args, _ = recipe.parse_args(["--config", str(path), "--use_cpu", "true"])
    assert (args.loss_type, args.routing_replay, args.use_vllm) == ("minirl", "r3", True)
    assert (args.epsilon, args.epsilon_high, args.scale_rewards, args.minirl_is_cap) == (0.2, 0.27, "none", 5.0)
    assert args.steps_per_generation // args.gradient_accumulation_steps == 4  # large off-policiness: R3


def test_pr2_config_is_off4_with_ddp(recipe):
    path = ROOT / "recipes" / "configs" / "granite_1b_a400m_pr2_off4_ddp.yaml"
    _, args, _ = recipe.parse_args(["--config", str(path), "--use_cpu", "true"])
    assert args.routing_replay == "pr2" and args.pr2_lr_multiplier == 1e3
    assert args.steps_per_generation // args.gradient_accumulation_steps == 4
    assert args.pr2_cached_tokens_per_sequence >= args.max_completion_length
    launch = re.findall(r"--config_file (recipes/accelerate/\S+\.yaml)", path.read_text())
    assert launch == ["recipes/accelerate/ddp.yaml"]


EXPECTED_ACCELERATE = {
    "single": ("NO", 1, {}),
    "ddp": ("MULTI_GPU", 8, {}),
    "zero2": ("DEEPSPEED", 8, {"zero_stage": 2, "zero3_init_flag": False}),
    "zero3": ("DEEPSPEED", 8, {"zero_stage": 3, "zero3_init_flag": True, "zero3_save_16bit_model": True}),
    "fsdp2": (
        "FSDP",
        8,
        {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "FULL_STATE_DICT",
        },
    ),
}


def test_accelerate_configs_are_the_expected_set():
    assert sorted(p.stem for p in ACCELERATE_CONFIGS) == sorted(EXPECTED_ACCELERATE)


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_config_loads(path):
    config = load_config_from_file(str(path))
    distributed, processes, extra = EXPECTED_ACCELERATE[path.stem]
    assert config.distributed_type.value == distributed and config.num_processes == processes
    # precision follows the training arguments (bf16: true in the recipe configs, false offline): a config saying
    # bf16 would turn on autocast for a bf16=False run, and under DeepSpeed fail against it
    assert config.mixed_precision == "no" and config.use_cpu is False
    section = config.fsdp_config if distributed == "FSDP" else config.deepspeed_config
    for key, value in extra.items():
        assert section[key] == value, key


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_tiny_overrides_build_the_requested_moe(recipe, family):
    from trl_moe_replay.routing import RouterReplay
    from trl_moe_replay.testing import tiny_moe_model

    model = tiny_moe_model(family, **recipe.tiny_overrides(family, 32, 2, 4, 1))
    replay = RouterReplay(model)
    assert (replay.num_experts, replay.top_k, model.config.hidden_size) == (4, 1, 32)
    with pytest.raises(ValueError, match="no tiny config"):
        recipe.tiny_overrides("llama", 32, 2, 4, 1)


def test_server_mode_without_requests_ends_the_recipe_in_one_line(recipe, capsys, monkeypatch):
    from trl_moe_replay.weight_sync.server_requests import ServerModeDependencyError, http_client

    def main(*args):
        return http_client()  # as the first request to a vLLM server would

    monkeypatch.setattr(recipe, "main", main)
    monkeypatch.setattr(recipe, "parse_args", lambda argv: ())
    monkeypatch.setitem(sys.modules, "requests", None)  # `import requests` raises ImportError, as without it
    assert recipe.run([]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "vLLM server mode needs the requests package" in line and 'pip install "trl-moe-replay[vllm]"' in line
    assert issubclass(ServerModeDependencyError, ImportError)


# ----------------------------------------------------------------------------- an evaluation set of its own (issue 43)
def test_the_eval_dataset_is_its_own_set_with_its_split_config_and_size(recipe, monkeypatch):
    """--eval_dataset_name loads that set (its split and config, the train set's prompt form), not the train set's
    test split (DAPO-Math-17k has none); --eval_samples keeps its first rows; 'synthetic' is the offline set."""
    import datasets

    import trl_moe_replay.extras.math.data as data

    loaded = []

    def load_math_dataset(name, split=None, *, config=None, **kwargs):
        loaded.append((name, split, config, kwargs["conversational"]))
        return datasets.Dataset.from_dict({"prompt": [f"{name} {i}" for i in range(40)], "solution": ["1"] * 40})

    monkeypatch.setattr(data, "load_math_dataset", load_math_dataset)
    args = recipe.parse_args(
        [
            "--model_name_or_path",
            "some/moe",
            "--dataset_name",
            "BytedTsinghua-SIA/DAPO-Math-17k",
            "--eval_dataset_name",
            "HuggingFaceH4/MATH-500",
            "--eval_dataset_split",
            "test",
            "--eval_samples",
            "25",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "50",
        ]
    )
    train, evaluation = recipe.load_datasets(args[0], args[1])
    assert loaded == [
        ("BytedTsinghua-SIA/DAPO-Math-17k", "train", None, True),
        ("HuggingFaceH4/MATH-500", "test", None, True),
    ]
    assert len(train) == 40 and len(evaluation) == 25 and evaluation[0]["prompt"] == "HuggingFaceH4/MATH-500 0"

    script_args, training_args, _ = recipe.parse_args(
        ["--eval_dataset_name", "synthetic", "--eval_samples", "32", "--eval_strategy", "steps", "--eval_steps", "5"]
    )
    train, evaluation = recipe.load_datasets(script_args, training_args)
    assert len(evaluation) == 32 and evaluation["prompt"] != train["prompt"][:32]  # rows drawn with another seed
    script_args, training_args, _ = recipe.parse_args([])  # the demo: no evaluation
    assert recipe.load_datasets(script_args, training_args)[1] is None


def test_an_eval_dataset_without_an_eval_strategy_is_refused_in_one_line(recipe, tmp_path, capsys):
    status = recipe.run(["--output_dir", str(tmp_path / "run"), "--eval_dataset_name", "synthetic"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert "--eval_dataset_name synthetic is evaluated only when TRL evaluates: pass --eval_strategy steps" in err


@pytest.mark.slow  # runs the recipe: cold start, two steps and two evaluations
def test_the_recipe_evaluates_its_eval_set_every_n_steps(recipe, tmp_path):
    script_args, training_args, model_args = recipe.parse_args(
        small_run_args(
            tmp_path / "run",
            tmp_path / "cache",
            "--plot",
            "false",
            "--eval_dataset_name",
            "synthetic",
            "--eval_samples",
            "16",
            "--per_device_eval_batch_size",
            "16",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "1",
        )
    )
    recipe.main(script_args, training_args, model_args)
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    evaluations = [h for h in state["log_history"] if "eval_reward" in h]
    assert [h["step"] for h in evaluations] == [1, 2]
    assert all(0.0 <= h["eval_reward"] <= 1.0 for h in evaluations)
