"""Issue 43, health and install: the progress line's replay-health signals, `trl-moe-replay env`, the list of defaults
that differ from plain TRL, Hub pushes without the reload sync's folder, the model card's routing mode and citations."""

import dataclasses
from pathlib import Path

import pytest

from trl_moe_replay.cli.progress import KEY_METRICS, CompactProgressCallback

ROOT = Path(__file__).resolve().parents[1]


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
    logs = {"reward": 0.781, "routing/fallback_frac": 0.0, "mismatch/kl_k3": 1.2e-13,
            "vllm/sync_max_logprob_diff": 3.1e-6, "routing/mismatch_frac": 0.02, "loss": 0.0062}
    callback.on_log(None, _State(), None, logs=logs)
    assert callback.training_bar.lines == ["step 10: reward=0.781 fallback=0 kl_k3=1.2e-13 sync_diff=3.1e-06 "
                                           "loss=0.0062"]
    assert "routing/mismatch_frac" not in KEY_METRICS  # R3 does not lower it: not a health signal
    # without vLLM's sync check (the transformers path) the key is simply absent
    callback.training_bar = _Bar()
    callback.on_log(None, _State(), None, logs={k: v for k, v in logs.items() if not k.startswith("vllm/")})
    assert callback.training_bar.lines == ["step 10: reward=0.781 fallback=0 kl_k3=1.2e-13 loss=0.0062"]


# ----------------------------------------------------------------------------- docs/usage.md "What the swap changes"
def swap_section() -> str:
    text = (ROOT / "docs" / "usage.md").read_text()
    start = text.index("## What the swap changes")
    return text[start:text.index("\n## ", start + 1)]


def test_the_swap_list_names_every_default_that_differs_from_plain_trl():
    """Every field whose default differs from trl.GRPOConfig's under some mode, and every field TRL lacks, is named in
    docs/usage.md's list (a new field, or a TRL default we change, fails here until the list says so)."""
    import trl

    from trl_moe_replay import MoEReplayGRPOConfig
    from trl_moe_replay.trainer.routing_options import MODES

    cpu = dict(output_dir="unused", use_cpu=True, bf16=False)
    plain = trl.GRPOConfig(**cpu)
    shared = {f.name for f in dataclasses.fields(plain)}
    differing = set()
    for mode in MODES:
        ours = MoEReplayGRPOConfig(routing_replay=mode, **cpu)
        differing |= {f.name for f in dataclasses.fields(ours)
                      if f.name not in shared or getattr(ours, f.name) != getattr(plain, f.name)}
    section = swap_section()
    assert "routing_replay" in differing and "transformers_importance_sampling_correction" in differing
    missing = sorted(name for name in differing if f"`{name}" not in section)
    assert not missing, f"docs/usage.md 'What the swap changes' does not name {missing}"
    for mode in MODES:  # one column per mode
        assert f"`{mode}`" in section.splitlines()[next(i for i, line in enumerate(section.splitlines())
                                                        if line.startswith("| what |"))]


def test_the_readme_links_the_swap_list():
    assert "docs/usage.md#what-the-swap-changes" in (ROOT / "README.md").read_text()


# ----------------------------------------------------------------------------- Hub pushes and the model card
def tiny_trainer(tmp_path, **overrides):
    from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    from .test_trainer import prompts_dataset, reward_len

    settings = dict(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, report_to="none", max_steps=1,
                    per_device_train_batch_size=4, num_generations=4, max_completion_length=4, save_strategy="no")
    return MoEReplayGRPOTrainer(model=tiny_moe_model("qwen3_moe"), reward_funcs=reward_len,
                                args=MoEReplayGRPOConfig(**{**settings, **overrides}),
                                train_dataset=prompts_dataset(), processing_class=tiny_tokenizer())


def test_push_to_hub_leaves_out_the_reload_syncs_folder_and_the_card_names_the_mode(tmp_path, monkeypatch):
    """transformers' push_to_hub uploads output_dir but its names matching "_*" and "checkpoint-*"; the reload sync
    writes a full copy of the weights into output_dir unless vllm_sync_dir says otherwise, so its folder is _vllm_sync."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from trl_moe_replay.engines.weight_reload import sync_dir_of

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


@pytest.mark.parametrize("overrides, cited, not_cited", [
    (dict(routing_replay="r2", loss_type="rspo"), ["2507.18071", "2512.01374", "2510.23027"], ["2510.11370"]),
    (dict(routing_replay="none", loss_type="minirl"), ["2512.01374"], ["2510.11370", "2507.18071"]),
    (dict(routing_replay="pr2"), ["2606.00395"], ["2510.11370"]),
])
def test_the_model_card_cites_the_methods_a_run_used(tmp_path, overrides, cited, not_cited):
    trainer = tiny_trainer(tmp_path, **overrides)
    trainer.create_model_card(model_name="tiny")
    card = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert f"routing_replay={overrides['routing_replay']}" in card
    assert f"routing-replay-{overrides['routing_replay']}" in card
    assert all(f"arXiv:{paper}" in card for paper in ["2402.03300", *cited]), card
    assert not [paper for paper in not_cited if paper in card]
    assert trainer._name == "MoE Replay GRPO"  # the class's own again after the card is written
