"""``bench/gpu_check.py --smoke``: the GPU check's whole code path at tiny sizes on CPU, so the script cannot rot.

The full mode needs one CUDA GPU (``make gpu-check``); here the smoke run must produce the same JSON and table, with
the properties the full run is read for.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    gpu_check = load_gpu_check()
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = gpu_check.main(["--smoke", "--out", str(out)])
    return status, json.loads(out.read_text()), printed.getvalue()


def test_smoke_runs_every_part_without_error(smoke):
    status, result, _ = smoke
    assert status == 0, result["failures"]
    assert result["mode"] == "smoke" and result["failures"] == []
    for part in ("exactness", "syncs", "timing", "generate", "sampler", "grpo"):
        assert "error" not in result[part], result[part]
        assert not result[part]["timed_out"], f"{part} ran out of its smoke budget"
    env = result["environment"]
    assert env["torch"] == torch.__version__ and env["transformers"] and env["trl"] and env["date"]


def test_replaying_own_routes_is_exact_and_other_routes_differ(smoke):
    _, result, _ = smoke
    ran = [row for row in result["exactness"]["rows"] if "unavailable" not in row]
    assert {row["width"] for row in ran} == {"Qwen3-30B-A3B", "OLMoE-1B-7B", "Mixtral-8x7B"}
    assert {"eager", "grouped_mm"} <= {row["experts_impl"] for row in ran}
    for row in ran:
        assert row["own_routes_max_diff"] == 0.0, row
        assert row["other_routes_max_diff"] > 0.0, row


def test_ratios_and_mismatch_figures_are_present(smoke):
    _, result, _ = smoke
    timed = result["timing"]["rows"]
    assert len(timed) == 3
    for row in timed:
        for kind in ("fwd", "fwd_bwd"):
            assert 0 < row[kind]["low"] <= row[kind]["median"] <= row[kind]["high"]
    assert result["generate"]["recording_over_plain"]["median"] > 0
    assert [row["layers"] for row in result["sampler"]["rows"]] == list(result["sizes"]["sampler_depths"])
    for row in result["sampler"]["rows"]:
        assert 0 <= row["router_decisions_differ"] <= row["tokens_any_layer_differs"] <= 1
        assert row["none"]["kl_k3"] >= 0 and row["r3"]["kl_k3"] >= 0
    assert result["grpo"]["r3_over_none"] > 0
    assert all(len(times) >= 1 for times in result["grpo"]["median_step_s"].values())
    assert [row["natural"] for row in result["syncs"]["rows"]] == [None] * 3  # sync counting is CUDA's


def test_one_table_is_printed(smoke):
    _, result, printed = smoke
    assert printed.count("| part | case | result |") == 1
    for part in ("exactness", "syncs", "timing", "generate", "sampler", "grpo"):
        assert f"\n| {part} |" in printed
    assert "{'loss'" not in printed  # the trainer's log stays out of the table


def test_a_replay_that_changes_logits_fails_the_check():
    gpu_check = load_gpu_check()
    results = {"exactness": {"rows": [
        {"width": "W", "experts_impl": "grouped_mm", "own_routes_max_diff": 0.0, "other_routes_max_diff": 1.0},
        {"width": "W", "experts_impl": "eager", "own_routes_max_diff": 0.5, "other_routes_max_diff": 1.0},
        {"width": "W", "experts_impl": "batched_mm", "own_routes_max_diff": 0.0, "other_routes_max_diff": 0.0},
    ]}, "grpo": {"error": "RuntimeError: boom"}}
    problems = gpu_check.failures(results)
    assert len(problems) == 3 and "W eager" in problems[1] and "unchanged" in problems[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the full mode would run, not refuse")
def test_the_full_mode_refuses_in_one_line_without_cuda(tmp_path, capsys):
    status = load_gpu_check().main(["--out", str(tmp_path / "x.json")])
    printed = capsys.readouterr().out
    assert status == 2 and printed.count("\n") == 1 and "no CUDA" in printed and "--smoke" in printed
    assert not (tmp_path / "x.json").exists()


def test_the_expert_parallel_part_says_it_skipped_without_two_gpus(smoke):
    _, result, printed = smoke
    ep = result["expert_parallel"]
    assert "needs at least 2 GPUs" in ep["skipped"] and "smoke mode" in ep["skipped"] and "error" not in ep
    assert "\n| expert_parallel | skipped | needs at least 2 GPUs" in printed
