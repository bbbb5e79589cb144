"""`trl-moe-replay plan`: every shipped GPU config fits the GPUs its header names, the parameter count is the one
transformers builds, and layouts whose sizes cannot divide are refused in one line."""

import re
from pathlib import Path

import pytest
import yaml

from trl_moe_replay.cli import main
from trl_moe_replay.cli.plan import (
    CARD_PARAMETERS,
    KNOWN_MODELS,
    MARGIN,
    ModelNumbers,
    PlanError,
    check_batch,
    estimate,
    header_of,
)

from tests.parallel.test_expert_parallel import has_expert_parallelism


ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "recipes" / "configs"


def uses_expert_parallelism(path: Path) -> bool:
    values = yaml.safe_load(path.read_text()) or {}
    return bool(values.get("ep_size") or (values.get("model_init_kwargs") or {}).get("distributed_config"))


GPU_CONFIGS = sorted(
    p for p in (ROOT / "recipes" / "configs").glob("*.yaml") if yaml.safe_load(p.read_text()).get("model_name_or_path")
)


def test_the_gpu_configs_are_the_expected_set():
    assert len(GPU_CONFIGS) >= 11
    names = {p.stem for p in GPU_CONFIGS}
    assert {
        "qwen3_30b_a3b_1node_zero3_offload",
        "qwen3_30b_a3b_1node_fsdp2_offload",
        "granite_1b_a400m_vllm_colocate",
    } <= names


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_every_gpu_config_fits_the_gpus_its_header_names(path, capsys):
    header = header_of(path.read_text())
    (plan_line,) = re.findall(r"^# plan: (.*)$", header, re.MULTILINE)  # one machine-readable line, in the header
    gpus, memory = int(re.search(r"--gpus (\d+)", plan_line)[1]), float(re.search(r"--gpu-memory (\d+)", plan_line)[1])
    if uses_expert_parallelism(path) and not has_expert_parallelism():
        # the oldest end of the ranges (transformers 5.16.1) has no expert parallelism: plan says so in one line
        with pytest.raises(PlanError, match="has no expert parallelism"):
            estimate(path)
        assert main(["plan", str(path)]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
        return
    plan = estimate(path)
    assert plan.fits, f"{path.name}: {plan.train_total:.1f} GB per training GPU, budget {plan.budget:.1f}"
    assert plan.warnings == [], path.name  # save_steps a multiple of the generation period, in every shipped config
    assert plan.layout.processes + plan.layout.vllm_gpus * (plan.layout.vllm_gpus > 0) <= gpus
    assert plan.budget <= (1 - MARGIN) * memory
    # the header states the split, the batch arithmetic, the budget and the lengths, and its batch numbers are the
    # plan's
    assert "Per-GPU budget" in header or "Memory (trl-moe-replay plan)" in header, path.name
    assert "Context:" in header or "context:" in header, path.name
    assert f"= {plan.batch['update']} completions" in header or f"{plan.batch['update']} completions" in header
    assert str(plan.batch["rollout"]) in header
    # the budget the header states is the plan's total, within rounding
    prose = " ".join(line.lstrip("#").strip() for line in header.splitlines())
    (stated,) = re.findall(r"\(trl-moe-replay plan\): about (\d+) GB", prose)
    assert abs(int(stated) - plan.train_total) <= 0.5, f"{path.name}: header {stated}, plan {plan.train_total:.1f}"
    # the command prints the same verdict, exit status 0
    assert main(["plan", str(path)]) == 0
    assert "verdict: fits" in capsys.readouterr().out


def test_the_one_node_qwen_layouts_use_8_gpus_and_need_their_offload():
    for name, sharding in (
        ("qwen3_30b_a3b_1node_zero3_offload", "zero3"),
        ("qwen3_30b_a3b_1node_fsdp2_offload", "fsdp2"),
    ):
        path = ROOT / "recipes" / "configs" / f"{name}.yaml"
        plan = estimate(path)
        assert (plan.layout.sharding, plan.layout.processes, plan.layout.vllm_gpus) == (sharding, 6, 2)
        assert plan.layout.offload_optimizer and plan.batch["rollout"] // plan.batch["update"] == 4
        # without the offload the same layout does not fit: the header's "why"
        text = path.read_text().replace(" --offload_optimizer_device cpu", "")
        text = text.replace(" --fsdp_offload_params true", "")
        bare = tmp_copy(path, text)
        assert not estimate(bare).fits and estimate(bare).train_total > 80
        assert main(["plan", str(bare)]) == 1


def tmp_copy(path: Path, text: str) -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp())
    copy = folder / path.name
    copy.write_text(text)
    return copy


def test_the_plan_counts_the_parameters_transformers_builds():
    """The count from config.json's sizes equals sum(numel) of the model transformers builds, per family."""
    from trl_moe_replay.testing import tiny_moe_model

    for family in ("qwen3_moe", "mixtral", "olmoe", "granitemoe"):
        model = tiny_moe_model(family)
        numbers = ModelNumbers.from_config(model.config.to_dict(), family, "tiny")
        assert numbers.params_total == sum(p.numel() for p in model.parameters()), family


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_the_table_gives_the_model_cards_counts(name):
    numbers = ModelNumbers.from_config(KNOWN_MODELS[name], name, "table")
    total, active = CARD_PARAMETERS[name]
    assert abs(numbers.params_total - total) / total < 0.03, numbers.params_total
    assert abs(numbers.params_active - active) / active < 0.08, numbers.params_active


def test_a_local_config_json_is_read(tmp_path):
    from trl_moe_replay.testing import tiny_moe_model

    tiny_moe_model("qwen3_moe").config.save_pretrained(tmp_path / "m")
    config = tmp_copy(
        ROOT / "recipes" / "configs" / "granite_1b_a400m_single_gpu.yaml",
        (ROOT / "recipes" / "configs" / "granite_1b_a400m_single_gpu.yaml")
        .read_text()
        .replace("ibm-granite/granite-3.1-1b-a400m-instruct", str(tmp_path / "m")),
    )
    plan = estimate(config)
    assert plan.model.source.endswith("config.json") and plan.model.params_total < 1e7


def test_sizes_that_cannot_divide_are_refused_in_one_line(capsys):
    ep = (ROOT / "recipes" / "configs" / "qwen3_30b_a3b_ep8_vllm_server.yaml").read_text()
    # expert parallelism 8 on 6 training processes (the issue's example): transformers' rule, one line, exit 2
    six = tmp_copy(
        Path("ep6.yaml"),
        ep.replace("--nproc_per_node 8", "--nproc_per_node 6").replace("fsdp_size: 8", "fsdp_size: 6"),
    )
    assert main(["plan", str(six)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ep_size" in err
    # an ep_size that does not divide the experts (128 / 3)
    three = tmp_copy(
        Path("ep3.yaml"),
        ep.replace("ep_size: 8", "ep_size: 3")
        .replace("--nproc_per_node 8", "--nproc_per_node 6")
        .replace("fsdp_size: 8", "fsdp_size: 6"),
    )
    with pytest.raises(PlanError):
        estimate(three)
    # a rollout batch that is no whole number of prompt groups
    with pytest.raises(PlanError, match="num_generations 8"):
        check_batch(
            dict(
                per_device_train_batch_size=1, gradient_accumulation_steps=1, num_generations=8, steps_per_generation=1
            ),
            processes=6,
        )
    # more GPUs than the node has
    with pytest.raises(PlanError, match="more than the 8 given"):
        estimate(ROOT / "recipes" / "configs" / "qwen3_30b_a3b_vllm_server_zero3.yaml", gpus=8)


@pytest.mark.parametrize(
    ("values", "refused"),
    [
        (dict(per_device_train_batch_size=3, gradient_accumulation_steps=1, num_generations=4), True),
        (dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=8), False),
        (
            dict(
                per_device_train_batch_size=2, gradient_accumulation_steps=1, steps_per_generation=3, num_generations=6
            ),
            False,
        ),
        (
            dict(
                per_device_train_batch_size=2, gradient_accumulation_steps=1, steps_per_generation=3, num_generations=4
            ),
            True,
        ),
        # evaluation on (no test split needed): the eval batch must hold whole groups of num_generations_eval
        (
            dict(
                per_device_train_batch_size=8,
                gradient_accumulation_steps=1,
                num_generations=8,
                eval_strategy="steps",
                per_device_eval_batch_size=3,
                num_generations_eval=2,
            ),
            True,
        ),
        (
            dict(
                per_device_train_batch_size=8,
                gradient_accumulation_steps=1,
                num_generations=8,
                eval_strategy="steps",
                per_device_eval_batch_size=4,
                num_generations_eval=2,
            ),
            False,
        ),
        (
            dict(
                per_device_train_batch_size=8,
                gradient_accumulation_steps=1,
                num_generations=8,
                eval_strategy="no",
                per_device_eval_batch_size=3,
                num_generations_eval=2,
            ),
            False,
        ),
    ],
)
def test_the_batch_rule_is_trls(values, refused):
    """On one process, check_batch refuses exactly what TRL's GRPOConfig refuses."""
    from trl import GRPOConfig

    try:
        GRPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none", **values)
        trl_refused = False
    except ValueError:
        trl_refused = True
    try:
        check_batch(values, processes=1)
        ours = False
    except PlanError:
        ours = True
    assert ours == trl_refused == refused


def test_the_optimizer_step_temporaries_are_counted_where_the_optimizer_runs_on_the_gpu():
    """torch's foreach AdamW (optim adamw_torch) makes one temporary of the local trainable shard (in the states'
    dtype) on the GPU; an optimizer offloaded to CPU makes none there."""

    def foreach(name: str) -> Path:
        path = CONFIGS / f"{name}.yaml"
        return tmp_copy(path, path.read_text() + "\noptim: adamw_torch\n")

    cases = [
        ("olmoe_1b_7b", lambda P: 4 * P / 8),  # ZeRO-2: the fp32 partition of 8
        ("granite_1b_a400m_single_gpu", lambda P: 4 * P),
    ]  # loaded in float32
    if has_expert_parallelism():  # (the oldest end's transformers has none: plan refuses EP configs there)
        cases.append(("qwen3_30b_a3b_ep8_vllm_server", lambda P: 4 * P / 8))  # fsdp_size 8
    for name, expected in cases:
        plan = estimate(foreach(name))
        lines = {what: gb for what, gb, _ in plan.train_lines}
        assert lines["optimizer-step temporaries"] == pytest.approx(expected(plan.model.params_total) / 1e9), name
    offloaded = estimate(foreach("qwen3_30b_a3b_1node_zero3_offload"))
    assert "optimizer-step temporaries" not in {what for what, _, _ in offloaded.train_lines}
    # without the offload the same layout has them, on its 6 ranks
    bare = tmp_copy(
        Path("bare.yaml"),
        foreach("qwen3_30b_a3b_1node_zero3_offload").read_text().replace(" --offload_optimizer_device cpu", ""),
    )
    lines = {what: gb for what, gb, _ in estimate(bare).train_lines}
    assert lines["optimizer-step temporaries"] == pytest.approx(4 * offloaded.model.params_total / 6 / 1e9)


def test_a_context_longer_than_the_engines_max_model_length_is_refused_in_one_line(capsys):
    configs = ROOT / "recipes" / "configs"
    server = (configs / "qwen3_30b_a3b_1node_zero3_offload.yaml").read_text()
    assert estimate(configs / "qwen3_30b_a3b_1node_zero3_offload.yaml").layout.vllm_max_model_len == 9216
    short = tmp_copy(Path("short.yaml"), server.replace("--max-model-len 9216", "--max-model-len 8192"))
    assert main(["plan", str(short)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-model-len 8192 is below prompt 1024 + completion 8192" in err
    # with the completions shortened to leave room for the prompt, the same engine is accepted
    fits = tmp_copy(
        Path("fits.yaml"),
        server.replace("--max-model-len 9216", "--max-model-len 8192").replace(
            "max_completion_length: 8192", "max_completion_length: 7168"
        ),
    )
    assert estimate(fits).layout.vllm_max_model_len == 8192
    colocate = (configs / "granite_1b_a400m_vllm_colocate.yaml").read_text()
    low = tmp_copy(Path("low.yaml"), colocate.replace("vllm_max_model_length: 1536", "vllm_max_model_length: 1535"))
    with pytest.raises(PlanError, match="vllm_max_model_length 1535 is below prompt 1024 \\+ completion 512"):
        estimate(low)


def test_the_server_lines_gpu_memory_utilization_sizes_the_kv_cache():
    configs = ROOT / "recipes" / "configs"
    text = (configs / "qwen3_30b_a3b_1node_zero3_offload.yaml").read_text()
    assert "--gpu-memory-utilization 0.9" in text
    tokens = {}
    for util in ("0.9", "0.8"):
        plan = estimate(
            tmp_copy(Path("u.yaml"), text.replace("--gpu-memory-utilization 0.9", f"--gpu-memory-utilization {util}"))
        )
        assert plan.layout.vllm_utilization == float(util)
        (line,) = plan.vllm_lines
        assert f"at --gpu-memory-utilization {util} =" in line
        tokens[util] = int(re.search(r"= ([\d,]+) tokens", line)[1].replace(",", ""))
    # 0.1 x 80 GB less per GPU, over 2 GPUs of tensor parallel 2 (one replica): K and V, bf16, 48 layers, 4 x 128
    per_token = 2 * 48 * 4 * 128 * 2 / 2
    assert tokens["0.9"] - tokens["0.8"] == pytest.approx(0.1 * 80e9 / per_token, abs=2)


def test_route_bytes_and_activation_formulas():
    plan = estimate(ROOT / "recipes" / "configs" / "qwen3_30b_a3b_1node_zero3_offload.yaml")
    routes = plan.route_lines[0]
    # 480 completions x 9215 tokens x 48 layers x top-8 x 1 byte (uint8: 128 experts <= 256)
    raw = 480 * 9215 * 48 * 8
    assert f"= {raw / 1e9:.2f} GB raw" in routes and f"{raw * 4 / 3 / 1e9:.2f} GB as base64" in routes
    lines = {what: gb for what, gb, _ in plan.train_lines}
    assert lines["logits"] == pytest.approx(8 * 2 * 8192 * 151936 / 1e9)
    assert lines["checkpointed layer inputs"] == pytest.approx(2 * 9216 * 48 * 2048 * 2 / 1e9)
    assert lines["weights"] == pytest.approx(2 * plan.model.params_total / 6 / 1e9)


def test_an_unknown_model_or_no_model_is_one_line_and_nothing_is_downloaded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    source = (ROOT / "recipes" / "configs" / "olmoe_1b_7b.yaml").read_text()
    unknown = tmp_copy(Path("u.yaml"), source.replace("allenai/OLMoE-1B-7B-0924-Instruct", "nobody/no-such-moe"))
    assert main(["plan", str(unknown)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no config.json for 'nobody/no-such-moe'" in err
    assert (
        main(["plan", str(ROOT / "recipes" / "configs" / "tiny_lora_r3.yaml"), "--gpus", "1", "--gpu-memory", "80"])
        == 2
    )
    assert "names no model" in capsys.readouterr().err


# ------------------------------------------------------------------------------ inputs: one line each, exit status 2


def refused_in_one_line(capsys, argv: list[str], phrase: str) -> str:
    """``plan`` refuses ``argv`` with exit status 2 and one stderr line holding ``phrase`` (no traceback)."""
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and phrase in err, err
    assert "verdict" not in captured.out
    return err


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["--gpus", "0"], "--gpus must be an integer from 1"),
        (["--gpus", "-8"], "--gpus must be an integer from 1"),
        (["--gpu-memory", "0"], "--gpu-memory must be a finite number above 0"),
        (["--gpu-memory", "-80"], "--gpu-memory must be a finite number above 0"),
        (["--gpu-memory", "inf"], "--gpu-memory must be a finite number above 0"),
        (["--gpu-memory", "nan"], "--gpu-memory must be a finite number above 0"),
        (["--prompt-length", "0"], "--prompt-length must be an integer from 1"),
        (["--prompt-length", "-5"], "--prompt-length must be an integer from 1"),
    ],
)
def test_a_command_line_value_is_checked_never_replaced_by_the_header(argv, phrase, capsys):
    refused_in_one_line(capsys, [str(CONFIGS / "olmoe_1b_7b.yaml"), *argv], phrase)


def test_a_command_line_value_is_used_as_given():
    path = CONFIGS / "qwen3_30b_a3b_1node_zero3_offload.yaml"  # its header: --gpus 8 --gpu-memory 80
    plan = estimate(path, gpu_memory=40, prompt_length=100)
    assert (plan.gpu_memory, plan.prompt_length, plan.budget) == (40, 100, pytest.approx(0.9 * 40))
    with pytest.raises(PlanError, match="more than the 7 given"):
        estimate(path, gpus=7)


def edited(path: Path, old: str, new: str) -> Path:
    source = path.read_text()
    assert old in source, old
    return tmp_copy(path, source.replace(old, new))


@pytest.mark.parametrize(
    ("old", "new", "phrase"),
    [
        ("# plan: --gpus 8 --gpu-memory 80", "# plan: --gpus 0 --gpu-memory 80", "`# plan:` line: --gpus must be"),
        ("# plan: --gpus 8 --gpu-memory 80", "# plan: --gpus eight --gpu-memory 80", "--gpus must be an integer"),
        ("# plan: --gpus 8 --gpu-memory 80", "# plan: --gpus 8 --gpu-memory -1", "--gpu-memory must be a finite"),
        ("--num_processes 6", "--num_processes six", "launch line: --num_processes must be an integer"),
        ("--num_processes 6", "--num_processes 0", "launch line: --num_processes must be an integer from 1"),
        ("--tensor-parallel-size 2", "--tensor-parallel-size 0", "--tensor-parallel-size must be an integer from 1"),
        ("--gpu-memory-utilization 0.9", "--gpu-memory-utilization 1.5", "--gpu-memory-utilization must be a finite"),
        ("--max-model-len 9216", "--max-model-len -9216", "--max-model-len must be an integer from 1"),
        ("--max-model-len 9216", "--max-model-len '9216", "cannot be split into words"),
    ],
)
def test_every_number_of_the_header_is_checked(old, new, phrase, capsys):
    refused_in_one_line(capsys, [str(edited(CONFIGS / "qwen3_30b_a3b_1node_zero3_offload.yaml", old, new))], phrase)


@pytest.mark.parametrize(
    ("old", "new", "phrase"),
    [
        ("num_generations: 8", "num_generations: 0", "num_generations must be an integer from 2"),
        ("num_generations: 8", "num_generations: eight", "num_generations must be an integer"),
        ("num_generations: 8", "num_generations: null", "num_generations must be an integer"),
        ("per_device_train_batch_size: 2", "per_device_train_batch_size: -2", "per_device_train_batch_size must be"),
        ("per_device_train_batch_size: 2", "per_device_train_batch_size: 2.5", "per_device_train_batch_size must be"),
        (
            "gradient_accumulation_steps: 10",
            "gradient_accumulation_steps: .inf",
            "gradient_accumulation_steps must be",
        ),
        ("steps_per_generation: 40", "steps_per_generation: 0", "steps_per_generation must be an integer from 1"),
        ("max_completion_length: 8192", "max_completion_length: null", "max_completion_length must be an integer"),
        ("max_completion_length: 8192", "max_completion_length: '8192'", "max_completion_length must be an integer"),
        ("use_vllm: true", "use_vllm: 'no'", "use_vllm must be true or false"),
        ("vllm_mode: server", "vllm_mode: [server]", "vllm_mode must be one of ['server', 'colocate']"),
        ("beta: 0.0", "beta: -0.1", "beta must be a finite number >= 0"),
        ("beta: 0.0", "beta: .nan", "beta must be a finite number >= 0"),
        (
            "model_name_or_path: Qwen/Qwen3-30B-A3B",
            "model_name_or_path: [Qwen/Qwen3-30B-A3B]",
            "model_name_or_path must be a text",
        ),
    ],
)
def test_every_config_value_the_plan_reads_is_checked(old, new, phrase, capsys):
    refused_in_one_line(capsys, [str(edited(CONFIGS / "qwen3_30b_a3b_1node_zero3_offload.yaml", old, new))], phrase)


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        ("model_name_or_path: [unclosed\n", "is not valid YAML"),
        ("- a list\n- of keys\n", "must hold a YAML mapping"),
        ("just text\n", "must hold a YAML mapping"),
        ("deep: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests YAML lists or mappings too deeply"),
        ("x: 1\n" + "#" * (2**20) + "\n", "holds more than 1 MiB"),
    ],
)
def test_a_config_file_that_is_no_mapping_is_one_line(tmp_path, content, phrase, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    refused_in_one_line(capsys, [str(path), "--gpus", "8", "--gpu-memory", "80"], phrase)


def test_a_folder_or_a_missing_file_is_one_line(tmp_path, capsys):
    refused_in_one_line(capsys, [str(tmp_path)], "is a folder, not a regular file")
    refused_in_one_line(capsys, [str(tmp_path / "none.yaml")], "is not a file")


def tiny_config_json(tmp_path: Path, change) -> Path:
    """A recipe config naming a local folder whose config.json is the tiny Qwen3-MoE's, changed by ``change``."""
    import json

    from trl_moe_replay.testing import tiny_moe_model

    folder = tmp_path / "model"
    tiny_moe_model("qwen3_moe").config.save_pretrained(folder)
    values = json.loads((folder / "config.json").read_text())
    text = change(values)
    (folder / "config.json").write_text(text if isinstance(text, str) else json.dumps(text))
    return edited(
        CONFIGS / "granite_1b_a400m_single_gpu.yaml", "ibm-granite/granite-3.1-1b-a400m-instruct", str(folder)
    )


def with_value(key, value):
    return lambda values: {**values, key: value}


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        (lambda values: "[" * 100_000 + "]" * 100_000, "nests JSON arrays or objects too deeply"),
        (lambda values: [values], "must hold a JSON object of the model's sizes"),
        (lambda values: "{not json", "is not valid JSON"),
        (with_value("num_attention_heads", 0), "num_attention_heads must be an integer from 1"),
        (with_value("hidden_size", -2048), "hidden_size must be an integer from 1"),
        (with_value("hidden_size", "2048"), "hidden_size must be an integer from 1"),
        (with_value("hidden_size", None), "has no hidden_size"),
        (with_value("vocab_size", 1e400), "vocab_size must be an integer"),  # json.dumps writes Infinity
        (with_value("num_key_value_heads", 0), "num_key_value_heads must be an integer from 1"),
        (with_value("num_experts", 0), "num_experts must be an integer from 1"),
        (with_value("num_experts_per_tok", 1000), "num_experts_per_tok 1000 is more than the"),
        (with_value("mlp_only_layers", 3), "mlp_only_layers must be a list"),
        (with_value("tie_word_embeddings", "yes"), "tie_word_embeddings must be true or false"),
        (lambda values: {"text_config": 5}, "text_config must be an object"),
        (lambda values: {"text_config": {**values, "num_hidden_layers": -1}}, "num_hidden_layers must be an integer"),
    ],
)
def test_a_damaged_config_json_is_one_line(tmp_path, change, phrase, capsys):
    refused_in_one_line(capsys, [str(tiny_config_json(tmp_path, change))], phrase)


def test_a_text_config_is_read(tmp_path):
    plain = estimate(tiny_config_json(tmp_path / "a", lambda values: values))
    nested = estimate(tiny_config_json(tmp_path / "b", lambda values: {"text_config": values}))
    assert nested.model.params_total == plain.model.params_total < 1e7


# ------------------------------------------------------------------------------ the plan agrees with the trainer, vLLM
def test_a_layout_the_trainer_refuses_is_refused_by_the_plan_with_the_trainers_line(monkeypatch, capsys):
    """Colocated vLLM >= 0.31 with tensor parallelism 8: the trainer's config refuses it (routes reach only the first
    tensor-parallel rank); plan raises the same exception with the same line."""
    from trl_moe_replay.trainer import grpo_config
    from trl_moe_replay.trainer.grpo_config import MoEReplayGRPOConfig, UnprovenEngineSetupError

    monkeypatch.setattr(grpo_config, "installed_vllm_version", lambda: "0.31.0")
    config = edited(
        CONFIGS / "granite_1b_a400m_vllm_colocate.yaml",
        "vllm_gpu_memory_utilization: 0.3",
        "vllm_gpu_memory_utilization: 0.3\nvllm_tensor_parallel_size: 8",
    )
    with pytest.raises(UnprovenEngineSetupError) as trainer:
        MoEReplayGRPOConfig(
            output_dir="/tmp/unused",
            use_cpu=True,
            report_to="none",
            use_vllm=True,
            vllm_mode="colocate",
            vllm_tensor_parallel_size=8,
        )
    with pytest.raises(UnprovenEngineSetupError) as planned:
        estimate(config, gpus=8)
    assert str(planned.value) == str(trainer.value)
    assert refused_in_one_line(capsys, [str(config), "--gpus", "8"], "vllm_tensor_parallel_size=8 on vLLM 0.31.0")
    # on vLLM 0.30 the trainer takes it, and so does the plan
    monkeypatch.setattr(grpo_config, "installed_vllm_version", lambda: "0.30.0")
    assert estimate(config, gpus=8).model.name == "ibm-granite/granite-3.1-1b-a400m-instruct"
    # a value of ours the trainer refuses by its range: the trainer's line too
    bad = edited(
        CONFIGS / "granite_1b_a400m_vllm_colocate.yaml",
        "routing_replay: r3",
        "routing_replay: r3\nextreme_token_threshold: 0.5",
    )
    refused_in_one_line(capsys, [str(bad)], "extreme_token_threshold must be")


def test_kv_cache_per_gpu_follows_vllms_head_replication():
    """Qwen3-30B-A3B has 4 KV heads of 128: K and V, bf16, 48 layers. Up to TP 4 the heads split; beyond, vLLM keeps
    one whole head per GPU."""
    from trl_moe_replay.cli.plan import kv_bytes_per_token, model_numbers

    qwen = model_numbers("Qwen/Qwen3-30B-A3B")
    per_head = 2 * 48 * 128 * 2  # K and V x layers x head_dim x bf16 = 24,576 bytes
    assert {tp: kv_bytes_per_token(qwen, tp) for tp in (1, 2, 4, 8)} == {
        1: 4 * per_head,
        2: 2 * per_head,
        4: per_head,
        8: per_head,
    }
    assert kv_bytes_per_token(qwen, 8) == 24_576
    # a server of TP 8 over GPUs 0-7: the KV tokens the plan prints are free bytes / 24,576
    text = (
        (CONFIGS / "qwen3_30b_a3b_1node_zero3_offload.yaml")
        .read_text()
        .replace("CUDA_VISIBLE_DEVICES=0,1 trl vllm-serve", "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 trl vllm-serve")
        .replace("--tensor-parallel-size 2", "--tensor-parallel-size 8")
    )
    plan = estimate(tmp_copy(Path("tp8.yaml"), text), gpus=14)
    (line,) = plan.vllm_lines
    free = 0.9 * 80e9 - 2 * plan.model.params_total / 8 - 2e9  # utilization x memory - bf16 weights / 8 - buffers
    assert f"= {free / 24_576:,.0f} tokens at 24,576 bytes/token per GPU" in line
    assert "1 x tensor parallel 8" in line


def test_a_server_line_asking_more_gpus_than_it_sees_is_refused(capsys):
    config = edited(
        CONFIGS / "qwen3_30b_a3b_1node_zero3_offload.yaml", "--tensor-parallel-size 2", "--tensor-parallel-size 8"
    )
    refused_in_one_line(
        capsys,
        [str(config)],
        "tensor parallel 8 x data parallel 1 = 8 GPUs under CUDA_VISIBLE_DEVICES=0,1 (2 GPUs): vLLM refuses it",
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # ZeRO-3 over 6 ranks: the reference model is sharded as the policy, bf16: 2 bytes x P / 6
        ("qwen3_30b_a3b_1node_zero3_offload", lambda P: 2 * P / 6),
        # ZeRO-2 on 8 ranks: TRL prepares it with ZeRO stage 0, whole on each GPU, bf16
        ("olmoe_1b_7b", lambda P: 2 * P),
        # one process, loaded in float32: 4 bytes x P
        ("granite_1b_a400m_single_gpu", lambda P: 4 * P),
    ],
)
def test_the_reference_model_is_counted_when_beta_is_above_0(name, expected):
    path = CONFIGS / f"{name}.yaml"
    without = estimate(path)
    with_ref = estimate(edited(path, "beta: 0.0", "beta: 0.04"))
    lines = {what: gb for what, gb, _ in with_ref.train_lines}
    assert "reference model (beta > 0)" not in {what for what, _, _ in without.train_lines}
    assert lines["reference model (beta > 0)"] == pytest.approx(expected(without.model.params_total) / 1e9)
    assert with_ref.train_total - without.train_total == pytest.approx(expected(without.model.params_total) / 1e9)
    if name.startswith("qwen3"):  # the figure: about +10 GB per training GPU on the 1-node configs
        assert 10 < lines["reference model (beta > 0)"] < 10.5


def test_no_reference_model_under_peft():
    lora = CONFIGS / "mixtral_8x7b_lora.yaml"
    plan = estimate(edited(lora, "beta: 0.0", "beta: 0.04"))
    assert "reference model (beta > 0)" not in {what for what, _, _ in plan.train_lines}


def test_the_optimizers_temporaries_are_its_own(capsys):
    """transformers' default optimizer on torch >= 2.8, adamw_torch_fused, steps in place: no temporaries;
    adamw_torch (foreach) makes one of the local trainable shard; another optimizer is not modelled: one line."""
    path = CONFIGS / "olmoe_1b_7b.yaml"  # ZeRO-2 on 8 GPUs, bf16 weights, fp32 partition of the optimizer
    default = estimate(path)
    assert "optimizer-step temporaries" not in {what for what, _, _ in default.train_lines}
    foreach = estimate(edited(path, "beta: 0.0", "beta: 0.0\noptim: adamw_torch"))
    lines = {what: gb for what, gb, _ in foreach.train_lines}
    assert lines["optimizer-step temporaries"] == pytest.approx(4 * default.model.params_total / 8 / 1e9)
    assert foreach.train_total - default.train_total == pytest.approx(4 * default.model.params_total / 8 / 1e9)
    refused_in_one_line(
        capsys, [str(edited(path, "beta: 0.0", "beta: 0.0\noptim: adamw_8bit"))], "the plan models torch's AdamW only"
    )


def test_colocate_with_and_without_sleep_mode():
    """Without sleep mode vLLM's share is held all the time: training gets (1 - 0.3 - 0.1) x 80 GB. With it (TRL's
    sleep level 2 after generating) training gets 0.9 x 80 GB less ~1 GB of vLLM buffers, and while generating the
    state that outlives a step (fp32 weights, Adam m and v, the fixed 3 GB) sits beside vLLM's 0.3 x 80 GB."""
    path = CONFIGS / "granite_1b_a400m_vllm_colocate.yaml"  # one GPU, loaded in float32, bf16 autocast
    awake = estimate(path)
    assert awake.budget == pytest.approx((1 - 0.3 - 0.1) * 80) and awake.generation_phase is None
    asleep = estimate(
        edited(
            path, "vllm_gpu_memory_utilization: 0.3", "vllm_gpu_memory_utilization: 0.3\nvllm_enable_sleep_mode: true"
        )
    )
    P = awake.model.params_total
    assert asleep.budget == pytest.approx(0.9 * 80)
    assert asleep.train_total - awake.train_total == pytest.approx(1.0)  # the sleeping engine's buffers
    resident = (4 * P + 2 * 4 * P) / 1e9 + 3.0  # fp32 weights + Adam m, v + CUDA context
    assert asleep.generation_phase == (pytest.approx(resident + 0.3 * 80), pytest.approx(0.9 * 80))
    assert asleep.fits and f"= {resident + 24:.1f} GB of a budget of 72.0 GB" in asleep.vllm_lines[-1]


def test_the_plan_prints_the_trainers_save_interval_warning(capsys):
    """save_steps 50 with a new generation batch every 64 / 16 = 4 optimizer steps (the 30B server configs before
    they were fixed): the config check's line, printed by plan; the verdict is unchanged."""
    path = edited(CONFIGS / "qwen3_30b_a3b_vllm_server_zero3.yaml", "save_steps: 48", "save_steps: 50")
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning: save_steps 50 is not a multiple of the generation period, 4 optimizer steps" in out
    assert out.count("save_steps 50") == 1 and "verdict: fits" in out


def test_the_checkpoint_size_and_its_write_time(capsys):
    """The 1-node ZeRO-3 layout saves the 16-bit model (2 bytes/param) and DeepSpeed's fp32 masters and Adam m, v
    (12 bytes/param): 14 x 30.53B = 427 GB, 427 s at the stated 1 GB/s (the issue's ~430 GB)."""
    path = CONFIGS / "qwen3_30b_a3b_1node_zero3_offload.yaml"
    plan = estimate(path)
    P = plan.model.params_total
    assert plan.checkpoint_gb == (pytest.approx(2 * P / 1e9), pytest.approx(12 * P / 1e9))
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        f"checkpoint: about {14 * P / 1e9:.0f} GB (weights {2 * P / 1e9:.0f} GB + optimizer state "
        f"{12 * P / 1e9:.0f} GB), {14 * P / 1e9:.0f} s to write at 1 GB/s" in out
    )
    assert 425 < 14 * P / 1e9 < 430
    # LoRA: the adapters (fp32) and their Adam state only
    lora = estimate(CONFIGS / "mixtral_8x7b_lora.yaml")
    assert sum(lora.checkpoint_gb) < 1


def test_tensor_parallelism_without_ep_divides_only_what_the_installed_plan_shards(capsys):
    """From transformers 5.25 the MoE models' tensor-parallel plans leave the routed experts out: at tp_size 2 x
    fsdp_size 4 with ep_size 1 each GPU holds a quarter of the experts (FSDP2's shards only), an eighth of what the plan
    splits (attention projections, embeddings, LM head) and a quarter of the rest. Qwen3-30B-A3B by hand, fp32 (the
    config's dtype): 7.44B parameters per GPU, not 30.53B / 8 = 3.82B."""
    from packaging.version import Version
    from transformers import __version__

    from trl_moe_replay.cli.plan import tensor_parallel_parts

    if not has_expert_parallelism() or Version(__version__) < Version("5.25"):
        pytest.skip("the routed experts leave the TP plans in transformers 5.25 (EP from 5.24)")
    assert tensor_parallel_parts("qwen3_moe") == {"attention", "dense_mlp", "embed_tokens", "lm_head"}
    assert "experts" not in tensor_parallel_parts("mixtral")
    path = edited(
        CONFIGS / "qwen3_30b_a3b_ep8_vllm_server.yaml",
        "ep_size: 8\nfsdp_size: 8",
        "ep_size: 1\nfsdp_size: 4\ntp_size: 2",
    )
    plan = estimate(path)
    experts = 48 * 128 * 3 * 2048 * 768  # layers x experts x (gate, up, down) x hidden x moe_intermediate
    split = 48 * (2 * 2048 * 32 * 128 + 2 * 2048 * 4 * 128) + 2 * 151936 * 2048  # q, o; k, v; embeddings, LM head
    rest = 30_532_122_624 - experts - split  # routers, norms, q/k norms
    local = experts / 4 + split / 8 + rest / 4
    assert round(local) == 7_441_993_216
    lines = {what: gb for what, gb, _ in plan.train_lines}
    assert lines["weights"] == pytest.approx(4 * local / 1e9) and lines["Adam m, v"] == pytest.approx(8 * local / 1e9)
    assert lines["gradients"] == pytest.approx(4 * local / 1e9)
    # FSDP2 unshards a whole decoder layer over its own shards, its experts too (no EP), the current one and the
    # prefetched, fp32; the attention projections stay split over the TP group (half of them on each GPU)
    layer = (30_532_122_624 - 2 * 151936 * 2048 - 2048) / 48  # a layer: less embeddings, LM head, final norm
    attention = 2 * 2048 * 32 * 128 + 2 * 2048 * 4 * 128  # q, o; k, v
    assert lines["gathered layers"] == pytest.approx(2 * 4 * (layer - attention / 2) / 1e9)
    assert main(["plan", str(path)]) == 1  # 158 GB of a 127 GB budget: the experts do not shrink with TP
    out = capsys.readouterr().out
    assert "fp32 / 8 for attention, embed_tokens, lm_head, / 4 for the rest (tp_size 2, ep_size 1)" in out
    assert "verdict: does NOT fit" in out
