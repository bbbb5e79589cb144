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
from packaging.version import Version


SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


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
    assert [row["layers"] for row in result["sampler"]["rows"]] == list(result["sizes"]["sampler_depths"])
    for row in result["sampler"]["rows"]:
        assert 0 <= row["router_decisions_differ"] <= row["tokens_any_layer_differs"] <= 1
        assert row["none"]["kl_k3"] >= 0 and row["r3"]["kl_k3"] >= 0
    # off CUDA the syncs are the HostReads proxy: replay adds none to a forward+backward
    assert all(row["replay"] == row["natural"] >= 0 for row in result["syncs"]["rows"])


def test_the_grpo_rows_compare_like_with_like_and_price_the_correction(smoke):
    """r3/none runs neither side's extra forward; the importance-sampling correction's forward is its own row."""
    _, result, printed = smoke
    grpo = result["grpo"]
    sides = grpo["sides"]
    assert {name: side["extra_forwards"] for name, side in sides.items()} == {"none": 0, "r3": 0, "r3_correction": 1}
    assert not any(side["routing_metrics"] for side in sides.values())
    assert sides["r3"]["transformers_importance_sampling_correction"] is False
    assert sides["r3_correction"]["transformers_importance_sampling_correction"] is True
    pairs = result["sizes"]["grpo_pairs"]
    assert all(len(times) == pairs for times in grpo["cycle_s"].values())
    for row in ("r3_over_none", "correction_cost"):
        r = grpo[row]
        assert r["pairs"] == pairs and 0 < r["low"] <= r["q1"] <= r["median"] <= r["q3"] <= r["high"]
    assert "\n| grpo | cycle r3/none, no correction | " in printed
    assert "\n| grpo | IS correction: r3 with/without | " in printed


def test_the_generate_row_carries_its_spread_and_one_host_copy(smoke):
    _, result, printed = smoke
    gen, sizes = result["generate"], result["sizes"]
    r = gen["recording_over_plain"]
    assert r["pairs"] == sizes["gen_pairs"] >= 2 and gen["warmup"] == sizes["gen_warmup"] >= 1
    assert 0 < r["low"] <= r["q1"] <= r["median"] <= r["q3"] <= r["high"]
    # min_new_tokens = max_new_tokens: both sides generate the same lengths
    assert gen["new_tokens_seen"] == {"plain": [sizes["gen_new_tokens"]], "recorded": [sizes["gen_new_tokens"]]}
    # record() copies its routes to the host once per call, not once per MoE layer (the model has 2)
    assert gen["syncs_recorded"] - gen["syncs_plain"] == 1, gen
    row = next(line for line in printed.splitlines() if line.startswith("| generate | recording/plain |"))
    assert "IQR" in row and f"{sizes['gen_pairs']} ABBA pairs" in row and "syncs per call" in row


def test_one_table_is_printed(smoke):
    _, result, printed = smoke
    assert printed.count("| part | case | result |") == 1
    for part in ("exactness", "syncs", "timing", "generate", "sampler", "grpo"):
        assert f"\n| {part} |" in printed
    assert "{'loss'" not in printed  # the trainer's log stays out of the table


def test_a_replay_that_changes_logits_fails_the_check():
    gpu_check = load_gpu_check()
    results = {
        "exactness": {
            "rows": [
                {"width": "W", "experts_impl": "grouped_mm", "own_routes_max_diff": 0.0, "other_routes_max_diff": 1.0},
                {"width": "W", "experts_impl": "eager", "own_routes_max_diff": 0.5, "other_routes_max_diff": 1.0},
                {"width": "W", "experts_impl": "batched_mm", "own_routes_max_diff": 0.0, "other_routes_max_diff": 0.0},
            ]
        },
        "grpo": {"error": "RuntimeError: boom"},
    }
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


def test_batched_mm_does_not_fit_where_its_estimate_exceeds_memory(monkeypatch):
    """A fake memory limit one byte under batched_mm's gathered weights: "does not fit", not an error; at the
    estimate it runs (and replays exactly); an OutOfMemoryError the estimate missed reads the same."""
    gpu_check = load_gpu_check()
    monkeypatch.setattr(gpu_check, "experts_implementations", lambda: ["grouped_mm", "batched_mm"])
    name, model = gpu_check.width_model("qwen3", gpu_check.SMOKE, torch.device("cpu"))
    rr = gpu_check.RouterReplay(model)
    x = gpu_check.tokens(2, 8, "cpu")
    need = gpu_check.experts_bytes(model, "batched_mm", x.numel(), rr.top_k)
    assert need == x.numel() * rr.top_k * 2 * 32 * 64 * 4  # tokens x top_k x gate_up [2 x 32, 64] x fp32
    assert gpu_check.experts_bytes(model, "grouped_mm", x.numel(), rr.top_k) is None

    short = {row["experts_impl"]: row for row in gpu_check.exactness_rows(name, model, rr, x, memory=need - 1)}
    assert short["batched_mm"]["does_not_fit"] == {"needs_bytes": need, "memory_bytes": need - 1, "estimated": True}
    assert short["grouped_mm"]["own_routes_max_diff"] == 0.0
    enough = {row["experts_impl"]: row for row in gpu_check.exactness_rows(name, model, rr, x, memory=need)}
    assert enough["batched_mm"]["own_routes_max_diff"] == 0.0 and "does_not_fit" not in enough["batched_mm"]

    chosen = {}
    setter = model.set_experts_implementation
    monkeypatch.setattr(model, "set_experts_implementation", lambda impl: (chosen.update(impl=impl), setter(impl)))

    def allocator(module, args):
        if chosen.get("impl") == "batched_mm":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 GiB")

    model.register_forward_pre_hook(allocator)
    missed = {row["experts_impl"]: row for row in gpu_check.exactness_rows(name, model, rr, x, memory=None)}
    assert missed["batched_mm"]["does_not_fit"]["estimated"] is False

    results = {"mode": "full", "exactness": {"rows": [short["grouped_mm"], short["batched_mm"], missed["batched_mm"]]}}
    rows = [result for part, case, result in gpu_check.table(results) if case == f"{name} batched_mm"]
    assert rows[0].startswith("does not fit at this size: needs ") and "for one tensor" in rows[0]
    assert rows[1] == "does not fit at this size: CUDA out of memory. Tried to allocate 768.00 GiB"
    assert gpu_check.failures(results) == []
    results["exactness"]["rows"] = [short["batched_mm"]]  # nothing ran at this width: that is a failure
    assert gpu_check.failures(results) == [f"no experts implementation could run {name}"]


def test_host_reads_count_the_calls_that_wait_for_a_device():
    gpu_check = load_gpu_check()
    x = torch.arange(6.0)
    with gpu_check.HostReads() as reads:
        x.sum().item(), x.tolist(), x.to("cpu"), x[x > 2], bool(x.any())  # 5 host reads
        x.to("cpu", non_blocking=True), x + 1, x[1:3], x.to(torch.float64)  # none
    assert reads.count == 5


def test_abba_pairs_alternate_the_order_and_pair_the_rounds():
    sys.path.insert(0, str(SCRIPT.parent))
    from _harness import abba_pairs, pair_spread

    calls = []

    def side(name, seconds):
        def run(round_):
            calls.append((name, round_))
            return seconds[round_] if round_ > 0 else 0.0

        return run

    times = abba_pairs(
        {"a": side("a", {1: 1.0, 2: 3.0, 3: 2.0, 4: 2.0}), "b": side("b", {1: 2.0, 2: 2.0, 3: 2.0, 4: 6.0})},
        pairs=2,
        warmup=1,
    )
    assert calls == [
        ("a", -1),
        ("b", -1),
        ("a", 1),
        ("b", 1),
        ("b", 2),
        ("a", 2),
        ("a", 3),
        ("b", 3),
        ("b", 4),
        ("a", 4),
    ]
    assert times == {"a": [2.0, 2.0], "b": [2.0, 4.0]}
    spread = pair_spread(times, "a", "b")
    assert (spread.median, spread.low, spread.high, spread.pairs) == (1.5, 1.0, 2.0, 2)
    assert abba_pairs({"a": side("a", {}), "b": side("b", {})}, pairs=3, keep_going=lambda: False) == {
        "a": [],
        "b": [],
    }


def test_a_budget_counts_the_charge_in_progress():
    """The generate and GRPO parts ask between pairs, inside one charge: the time spent so far must count."""
    import time

    budget = load_gpu_check().Budget(0.05)
    with budget.charge():
        assert not budget.spent()
        time.sleep(0.1)
        assert budget.spent()
    assert budget.ran_out and budget.used >= 0.1


def test_the_table_says_whether_hub_kernels_were_on(smoke):
    _, result, printed = smoke
    kernels = result["hub_kernels"]
    assert kernels["both_ways"] is False and "no CUDA" in kernels["why_not"]  # smoke runs on a CPU
    assert all(row["hub_kernels"] is False for row in result["exactness"]["rows"])
    line = next(line for line in printed.splitlines() if line.startswith("| hub_kernels | state |"))
    assert "exactness: off (no CUDA" in line and "USE_HUB_KERNELS=" in line


@pytest.mark.skipif(
    Version(__import__("transformers").__version__) < Version("5.25"),
    reason="gpu_check runs the kernels-on pass from transformers 5.25 (Hub kernels on by default there)",
)
def test_the_exactness_rows_run_again_with_hub_kernels_on_and_the_model_is_reset(monkeypatch):
    """The kernels-on pass, on a CPU: transformers' mapping replaces nothing here, so replay stays exact and the rows
    say 0 layers were replaced; the model is back to use_kernels False after it. A replayed forward that a kernel
    changed fails the check under its own name."""
    gpu_check = load_gpu_check()
    monkeypatch.setattr(gpu_check, "experts_implementations", lambda: ["grouped_mm"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name, model = gpu_check.width_model("qwen3", gpu_check.SMOKE, torch.device("cpu"))
    rr = gpu_check.RouterReplay(model)
    rows = gpu_check.exactness_rows_with_kernels(name, model, rr, gpu_check.tokens(2, 8, "cpu"), memory=None)
    assert len(rows) == 1 and rows[0]["hub_kernels"] is True and rows[0]["own_routes_max_diff"] == 0.0
    assert rows[0]["kernelized_layers"] in (0, None) and model.use_kernels is False
    cases = [case for part, case, _ in gpu_check.table({"exactness": {"rows": rows}}) if part == "exactness"]
    assert cases[0].startswith(f"{name} grouped_mm, hub kernels on")
    rows[0]["own_routes_max_diff"] = 1e-3
    assert gpu_check.failures({"exactness": {"rows": rows}}) == [
        f"replaying its own routes changed {name} grouped_mm (hub kernels on)'s logits"
    ]


def test_use_hub_kernels_no_turns_the_second_pass_off(monkeypatch):
    gpu_check = load_gpu_check()
    monkeypatch.setenv("USE_HUB_KERNELS", "NO")
    plan = gpu_check.hub_kernels_plan(torch.device("cpu"))
    assert plan["USE_HUB_KERNELS"] == "NO" and plan["from_pretrained_default"] is False and not plan["both_ways"]
    assert gpu_check.hub_kernels_env_on() is False
    monkeypatch.setenv("USE_HUB_KERNELS", "yes")
    assert gpu_check.hub_kernels_env_on() is True
