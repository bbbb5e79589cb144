"""Issue 43, health and install: the progress line's replay-health signals, `trl-moe-replay env`, the list of defaults
that differ from plain TRL, Hub pushes without the reload sync's folder, the model card's routing mode and citations."""

import dataclasses
from pathlib import Path

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
