"""`trl-moe-replay audit` measures engine/trainer mismatch: in process, against vLLM-contract servers, and in one line
for every bad argument or unreachable server. (`plot`: tests/cli/test_plotting.py.)"""

import json
import math
import os
import socket
import subprocess
import sys
import time
from unittest import mock

import numpy as np
import pytest
import torch

from trl_moe_replay.cli import main
from trl_moe_replay.cli.audit import AuditReport, AuditRow, run_audit
from trl_moe_replay.routing.codec import decode_routed_experts, encode_routed_experts
from trl_moe_replay.routing.errors import RouteAlignmentError
from trl_moe_replay.testing import FakeVLLMServer, tiny_moe_model

from tests.cli.test_plotting import one_line_error
from tests.helpers import silent_server


@pytest.fixture(scope="module")
def bf16_audit():
    return run_audit("tiny:qwen3_moe", num_prompts=3, num_generations=2, max_new_tokens=12, seed=0)


def test_audit_bf16_engine_vs_fp32_trainer(bf16_audit):
    report = bf16_audit
    none, r3 = report.row("none"), report.row("r3")
    assert report.completion_tokens > 0 and report.routed_pairs > 0
    for row in (none, r3):
        assert all(math.isfinite(v) for v in (row.kl_k1, row.kl_k3, row.extreme_frac, row.max_abs_log_ratio))
        assert row.kl_k3 >= 0 and 0 <= row.extreme_frac <= 1 and row.fallback_frac == 0.0
    # bf16 sampling vs fp32 scoring routes some (token, layer) pairs differently without replay ...
    assert none.route_mismatch_frac > 0 and none.topk_agreement < 1
    assert none.route_mismatch_frac == none.natural_mismatch_frac  # `none` uses the router's own routes
    # ... and R3 uses the engine's routes everywhere, which brings the trainer's log-probs closer to the engine's
    assert r3.route_mismatch_frac == 0.0 and r3.topk_agreement == 1.0
    assert r3.kl_k3 < none.kl_k3 and r3.max_abs_log_ratio <= none.max_abs_log_ratio
    assert "R3" in report.verdict() and "x lower" in report.verdict()


def test_audit_same_dtype_is_numerically_tight():
    report = run_audit("tiny:mixtral", num_prompts=2, num_generations=2, max_new_tokens=8, engine_dtype="float32")
    for row in report.rows:
        assert row.kl_k3 < 1e-8 and row.extreme_frac == 0.0 and row.max_abs_log_ratio < 1e-4
    assert report.row("r3").route_mismatch_frac == 0.0


@pytest.mark.parametrize(
    "r3_kl_k3, says",
    [(6.81e-08, "(10x lower)"), (7.99e-07, "(1.17x higher)"), (6.81e-07, "(unchanged)"), (0.0, "(down to 0)")],
)
def test_audit_verdict_says_which_way_kl_moved(r3_kl_k3, says):
    rows = [
        AuditRow("none", 0.0, 6.81e-07, 0.01, 0.1, 0.05, 0.9, 0.05, 0.0),
        AuditRow("r3", 0.0, r3_kl_k3, 0.01, 0.1, 0.0, 1.0, 0.05, 0.0),
    ]
    report = AuditReport("tiny:qwen3_moe", "bfloat16", "float32", 1, 2, 10, 40, rows)
    assert f"kl_k3 from 6.81e-07 to {r3_kl_k3:.3g} {says}" in report.verdict()


def test_audit_cli_prints_table_and_json(capsys):
    args = ["audit", "--model", "tiny:olmoe", "--num_prompts", "2", "--max_new_tokens", "6"]
    assert main(args) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].startswith("Routing audit of tiny:olmoe: engine bfloat16 generate vs trainer float32")
    header = next(i for i, line in enumerate(lines) if line.startswith("mode"))
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[header + 1 : header + 3]}
    assert set(rows) == {"none", "r3"}
    columns = lines[header].split()[1:]
    assert rows["r3"][columns.index("route_mismatch")] == 0.0
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in report["rows"]] == ["none", "r3"] and report["model"] == "tiny:olmoe"


def test_audit_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        run_audit("tiny:qwen3_moe", engine_dtype="int8")
    with pytest.raises(SystemExit):
        main(["audit"])  # --model is required


# ----------------------------------------------------------------------------- audit of a vLLM server
# FakeVLLMServer answers TRL's real VLLMClient over HTTP the way vLLM does (routed_experts included); it serves
# tiny_moe_model("qwen3_moe") with the default seed, the very weights `tiny:qwen3_moe` loads for the trainer.
# The audit only speaks HTTP: it must work on a machine without vLLM, so TRL's check for vLLM answers False here.
WITHOUT_LOCAL_VLLM = mock.patch("trl.generation.vllm_client.is_vllm_available", lambda *args, **kw: False)


def audit_server(server, **kwargs):
    settings = dict(num_prompts=2, num_generations=3, max_new_tokens=8)
    with server, WITHOUT_LOCAL_VLLM:
        return run_audit("tiny:qwen3_moe", vllm_server_url=server.url, **{**settings, **kwargs})


def test_audit_of_a_vllm_server_replays_its_routes_exactly():
    server = FakeVLLMServer(tiny_moe_model("qwen3_moe"), model_name="tiny:qwen3_moe")
    report = audit_server(server)
    # TRL's client path only: no weight sync; sampling as TRL's trainer asks for it
    assert "POST /v1/completions" in server.endpoint_calls
    assert not any("weight" in call for call in server.endpoint_calls)
    request = server.batches[0].request
    assert request["n"] == 3 and request["logprobs"] == 0 and request["temperature"] == 1.0
    assert request["top_p"] == 1.0 and request["top_k"] == 0 and request["max_tokens"] == 8
    assert len(request["prompt"]) == 2
    served = server.batches[0].completions
    assert report.num_completions == len(served) == 6
    assert report.completion_tokens == sum(len(c.token_ids) for c in served)
    assert report.engine == "vllm" and report.routes_available and report.notes == []
    r3 = report.row("r3")
    assert r3.route_mismatch_frac == 0.0 and r3.fallback_frac == 0.0 and r3.topk_agreement == 1.0
    # fp32 server vs fp32 trainer with the server's routes replayed: the same distribution up to rounding
    assert r3.kl_k3 < 1e-6 and r3.max_abs_log_ratio < 1e-4 and r3.extreme_frac == 0.0
    assert report.routed_pairs > 0
    head = report.format_table().splitlines()[0]
    assert head.startswith(f"Routing audit of tiny:qwen3_moe: engine vLLM server at {server.url} (unknown) vs")


def test_audit_of_a_bf16_vllm_server_shows_what_r3_removes():
    server = FakeVLLMServer(tiny_moe_model("qwen3_moe", dtype=torch.bfloat16), model_name="tiny:qwen3_moe")
    report = audit_server(server, num_prompts=3, num_generations=2, max_new_tokens=12)
    none, r3 = report.row("none"), report.row("r3")
    assert none.route_mismatch_frac > 0 and none.route_mismatch_frac == none.natural_mismatch_frac
    assert r3.route_mismatch_frac == 0.0 and r3.fallback_frac == 0.0
    # misaligned routes (an off-by-one column, another sample's rows) would not bring the log-probs closer
    assert r3.kl_k3 < none.kl_k3 and r3.max_abs_log_ratio <= none.max_abs_log_ratio
    assert "x lower" in report.verdict()


def test_audit_cli_of_a_server_without_routes_gives_the_server_command(capsys):
    server = FakeVLLMServer(tiny_moe_model("qwen3_moe"), return_routes=False)
    with server, WITHOUT_LOCAL_VLLM:
        args = [
            "audit",
            "--model",
            "tiny:qwen3_moe",
            "--num_prompts",
            "2",
            "--max_new_tokens",
            "6",
            "--vllm_server_url",
            server.url,
        ]
        assert main(args) == 0
        table = capsys.readouterr().out
        assert main([*args, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    command = "trl vllm-serve --model tiny:qwen3_moe --enable-return-routed-experts"
    assert command in table and "R3 row is unavailable" in table
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("mode"))
    none = lines[header + 1].split()
    assert none[0] == "none" and math.isfinite(float(none[2])) and none[5:] == ["n/a"] * 4
    assert lines[header + 2].startswith("r3") and "unavailable" in lines[header + 2]
    assert "the server serves 'tiny-moe'" in table  # served name differs from --model: said, not fatal
    assert [r["mode"] for r in report["rows"]] == ["none"] and report["routes_available"] is False
    assert report["server_command"] == command and report["rows"][0]["route_mismatch_frac"] is None
    assert report["num_completions"] == 4 and report["rows"][0]["kl_k3"] < 1e-6


def test_audit_of_a_server_with_misfit_or_missing_routes():
    def drop_top_k(call, choice, payload):  # a server routing top-1: another checkpoint than --model
        return encode_routed_experts(np.ascontiguousarray(decode_routed_experts(payload)[:, :, :1]))

    with pytest.raises(RouteAlignmentError, match="same checkpoint"):
        audit_server(FakeVLLMServer(tiny_moe_model("qwen3_moe"), tamper=drop_top_k), num_prompts=1)

    # one completion without routes among others: routed by the trainer itself under r3, counted as fallback
    server = FakeVLLMServer(tiny_moe_model("qwen3_moe"), tamper=lambda call, choice, p: None if choice == 1 else p)
    report = audit_server(server, num_prompts=1)
    r3 = report.row("r3")
    assert 0 < r3.fallback_frac < 1 and r3.route_mismatch_frac == 0.0
    assert any("1 of 3 completions came without routes" in note for note in report.notes)


def test_audit_of_a_server_that_never_answers_times_out_with_one_line(capsys):
    with silent_server() as url, WITHOUT_LOCAL_VLLM:
        # without the timeout the silent server would close the connection after a minute: another error than this
        with pytest.raises(TimeoutError, match=f"vLLM server at {url} did not answer within 1 s"):
            run_audit("tiny:qwen3_moe", vllm_server_url=url, vllm_timeout=1, num_prompts=1, max_new_tokens=4)
        line = one_line_error(
            capsys,
            [
                "audit",
                "--model",
                "tiny:qwen3_moe",
                "--vllm_server_url",
                url,
                "--vllm_timeout",
                "1",
                "--num_prompts",
                "1",
            ],
        )
    assert "did not answer within 1 s" in line and "--vllm_timeout" in line


def test_audit_of_a_local_model_path_that_does_not_exist(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "checkpoints" / "step-100"
    for model in (str(missing), "./no/such/model"):
        line = one_line_error(capsys, ["audit", "--model", model])
        assert "no model folder" in line and "Repo id" not in line
    # `runs/dmeo` is a Hub id (no such folder), refused at once offline, pointing at the folder probably meant
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    line = one_line_error(capsys, ["audit", "--model", "runs/dmeo"])
    assert "runs/dmeo is not a local folder, and offline mode (HF_HUB_OFFLINE=1)" in line
    assert "did you mean runs/demo?" in line
    # a folder without config.json (a run's output_dir before its final save) is named as such, not a tokenizer error
    line = one_line_error(capsys, ["audit", "--model", "runs/demo"])
    assert "runs/demo holds no config.json" in line


def test_audit_of_an_unreachable_server_is_one_line(capsys):
    with socket.socket() as probe:  # a port nothing listens on any more
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with WITHOUT_LOCAL_VLLM:
        line = one_line_error(capsys, ["audit", "--model", "tiny:qwen3_moe", "--vllm_server_url", url])
    assert "can't be reached" in line and url in line


@pytest.mark.slow  # processes with the Hub settings of a fresh shell: HF_HUB_OFFLINE unset
def test_audit_of_a_hub_id_without_network_answers_at_once(tmp_path):
    from tests.core.test_launch import closed_port_endpoint

    def audit(**hub_settings) -> tuple[float, subprocess.CompletedProcess]:
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
        env.update(HF_HOME=str(tmp_path / "hf"), PYTHONPATH=os.getcwd(), **hub_settings)
        start = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "trl_moe_replay.cli", "audit", "--model", "runs/typo"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return time.monotonic() - start, result

    offline_s, offline = audit(HF_HUB_OFFLINE="1")  # the baseline: imports, then the cache alone
    elapsed_s, result = audit(HF_ENDPOINT=closed_port_endpoint())  # online, but nothing answers
    for outcome in (offline, result):
        lines = outcome.stderr.strip().splitlines()
        assert outcome.returncode == 2 and len(lines) == 1 and "Traceback" not in outcome.stderr, outcome.stderr
    assert "runs/typo is not a local folder and the Hub" in result.stderr and "HF_HUB_OFFLINE=1" in result.stderr
    # one refused connection, no retries (transformers' took 50-55 s); measured against the same imports offline,
    # as the imports alone take from seconds to a minute on a busy machine
    assert elapsed_s - offline_s < 25, (elapsed_s, offline_s)


@pytest.mark.parametrize(
    ("name", "engine_copy", "expected"),
    [
        # Qwen3-30B-A3B, 30.5B parameters, on an 80 GB GPU (72 GB usable): float32 needs 4 x 30.5 = 122 GB (+ 61 GB for
        # generate's bf16 copy), bf16 2 x 30.5 = 61 GB, shared with the bf16 engine
        ("Qwen/Qwen3-30B-A3B", True, "bfloat16"),
        ("Qwen/Qwen3-30B-A3B", False, "bfloat16"),  # a vLLM server holds the engine's copy
        # OLMoE, 6.9B: 4 x 6.9 + 2 x 6.9 = 41 GB fits
        ("allenai/OLMoE-1B-7B-0924-Instruct", True, "float32"),
    ],
)
def test_the_default_trainer_dtype_is_the_one_that_fits(name, engine_copy, expected, monkeypatch, tmp_path):
    from trl_moe_replay.cli.audit import fitting_trainer_dtype
    from trl_moe_replay.cli.plan import model_numbers

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # the plan's table, not a cached config.json
    params = model_numbers(name).params_total
    dtype, note = fitting_trainer_dtype(
        name, torch.device("cuda"), "bfloat16", engine_copy=engine_copy, memory=80 * 10**9
    )
    assert dtype == expected and note.startswith(f"trainer dtype {expected} (auto: {params / 1e9:.1f}B parameters")
    fp32_need = 4 * params + (2 * params if engine_copy else 0)
    assert (fp32_need <= 0.9 * 80e9) == (expected == "float32")


def test_a_model_that_fits_in_no_dtype_is_one_line(monkeypatch, tmp_path, capsys):
    from trl_moe_replay.cli.audit import AuditMemoryError, fitting_trainer_dtype

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    # Mixtral-8x7B, 46.7B parameters: 93 GB in bf16, more than 72 GB usable of 80
    with pytest.raises(AuditMemoryError, match="need 93 GB in bfloat16, more than the 72 GB usable"):
        fitting_trainer_dtype(
            "mistralai/Mixtral-8x7B-Instruct-v0.1",
            torch.device("cuda"),
            "bfloat16",
            engine_copy=True,
            memory=80 * 10**9,
        )
    # a model the plan cannot count keeps float32, and says why
    dtype, note = fitting_trainer_dtype("nobody/unknown", torch.device("cpu"), "bfloat16", engine_copy=True)
    assert dtype == "float32" and "the model's size is unknown here" in note
    from trl_moe_replay.cli.commands import build_parser

    assert build_parser().parse_args(["audit", "--model", "m"]).trainer_dtype == "auto"
