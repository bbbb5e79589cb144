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


def uses_expert_parallelism(path: Path) -> bool:
    values = yaml.safe_load(path.read_text()) or {}
    return bool(values.get("ep_size") or (values.get("model_init_kwargs") or {}).get("distributed_config"))


GPU_CONFIGS = sorted(p for p in (ROOT / "recipes" / "configs").glob("*.yaml")
                     if yaml.safe_load(p.read_text()).get("model_name_or_path"))


def test_the_gpu_configs_are_the_expected_set():
    assert len(GPU_CONFIGS) >= 11
    names = {p.stem for p in GPU_CONFIGS}
    assert {"qwen3_30b_a3b_1node_zero3_offload", "qwen3_30b_a3b_1node_fsdp2_offload",
            "granite_1b_a400m_vllm_colocate"} <= names


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
    for name, sharding in (("qwen3_30b_a3b_1node_zero3_offload", "zero3"), ("qwen3_30b_a3b_1node_fsdp2_offload",
                                                                              "fsdp2")):
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
    config = tmp_copy(ROOT / "recipes" / "configs" / "granite_1b_a400m_single_gpu.yaml",
                      (ROOT / "recipes" / "configs" / "granite_1b_a400m_single_gpu.yaml").read_text().replace(
                          "ibm-granite/granite-3.1-1b-a400m-instruct", str(tmp_path / "m")))
    plan = estimate(config)
    assert plan.model.source.endswith("config.json") and plan.model.params_total < 1e7


def test_sizes_that_cannot_divide_are_refused_in_one_line(capsys):
    ep = (ROOT / "recipes" / "configs" / "qwen3_30b_a3b_ep8_vllm_server.yaml").read_text()
    # expert parallelism 8 on 6 training processes (the issue's example): transformers' rule, one line, exit 2
    six = tmp_copy(Path("ep6.yaml"), ep.replace("--nproc_per_node 8", "--nproc_per_node 6").replace(
        "fsdp_size: 8", "fsdp_size: 6"))
    assert main(["plan", str(six)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ep_size" in err
    # an ep_size that does not divide the experts (128 / 3)
    three = tmp_copy(Path("ep3.yaml"), ep.replace("ep_size: 8", "ep_size: 3").replace("--nproc_per_node 8",
                                                                                         "--nproc_per_node 6")
                     .replace("fsdp_size: 8", "fsdp_size: 6"))
    with pytest.raises(PlanError):
        estimate(three)
    # a rollout batch that is no whole number of prompt groups
    with pytest.raises(PlanError, match="num_generations 8"):
        check_batch(dict(per_device_train_batch_size=1, gradient_accumulation_steps=1, num_generations=8,
                         steps_per_generation=1), processes=6)
    # more GPUs than the node has
    with pytest.raises(PlanError, match="more than the 8 given"):
        estimate(ROOT / "recipes" / "configs" / "qwen3_30b_a3b_vllm_server_zero3.yaml", gpus=8)


@pytest.mark.parametrize(("values", "refused"), [
    (dict(per_device_train_batch_size=3, gradient_accumulation_steps=1, num_generations=4), True),
    (dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=8), False),
    (dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, steps_per_generation=3, num_generations=6),
     False),
    (dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, steps_per_generation=3, num_generations=4),
     True),
    # evaluation on (no test split needed): the eval batch must hold whole groups of num_generations_eval
    (dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=8, eval_strategy="steps",
          per_device_eval_batch_size=3, num_generations_eval=2), True),
    (dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=8, eval_strategy="steps",
          per_device_eval_batch_size=4, num_generations_eval=2), False),
    (dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=8, eval_strategy="no",
          per_device_eval_batch_size=3, num_generations_eval=2), False),
])
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
    """torch's foreach AdamW makes one temporary of the local trainable shard (in the states' dtype) on the GPU; an
    optimizer offloaded to CPU makes none there."""
    configs = ROOT / "recipes" / "configs"
    cases = [("olmoe_1b_7b", lambda P: 4 * P / 8),  # ZeRO-2: the fp32 partition of 8
             ("granite_1b_a400m_single_gpu", lambda P: 4 * P)]  # loaded in float32
    if has_expert_parallelism():  # (the oldest end's transformers has none: plan refuses EP configs there)
        cases.append(("qwen3_30b_a3b_ep8_vllm_server", lambda P: 4 * P / 8))  # fsdp_size 8
    for name, expected in cases:
        plan = estimate(configs / f"{name}.yaml")
        lines = {what: gb for what, gb, _ in plan.train_lines}
        assert lines["optimizer-step temporaries"] == pytest.approx(expected(plan.model.params_total) / 1e9), name
    offloaded = estimate(configs / "qwen3_30b_a3b_1node_zero3_offload.yaml")
    assert "optimizer-step temporaries" not in {what for what, _, _ in offloaded.train_lines}
    # without the offload the same layout has them, on its 6 ranks
    bare = tmp_copy(configs / "qwen3_30b_a3b_1node_zero3_offload.yaml", (configs / "qwen3_30b_a3b_1node_zero3_offload"
                                                                        ".yaml").read_text().replace(
        " --offload_optimizer_device cpu", ""))
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
    fits = tmp_copy(Path("fits.yaml"), server.replace("--max-model-len 9216", "--max-model-len 8192").replace(
        "max_completion_length: 8192", "max_completion_length: 7168"))
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
        plan = estimate(tmp_copy(Path("u.yaml"), text.replace("--gpu-memory-utilization 0.9",
                                                              f"--gpu-memory-utilization {util}")))
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
    assert main(["plan", str(ROOT / "recipes" / "configs" / "tiny_lora_r3.yaml"), "--gpus", "1",
                 "--gpu-memory", "80"]) == 2
    assert "names no model" in capsys.readouterr().err
