"""Issue 43, health and install: the progress line's replay-health signals, `trl-moe-replay env`, the list of defaults
that differ from plain TRL, Hub pushes without the reload sync's folder, the model card's routing mode and citations."""

from trl_moe_replay.cli.progress import KEY_METRICS, CompactProgressCallback


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
