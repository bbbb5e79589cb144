"""A compact progress bar for GRPO runs that log every step.

transformers' ``ProgressCallback`` prints every logged dict (GRPO logs ~40 numbers a step); with ``logging_steps=1``
that buries the bar. :class:`CompactProgressCallback` keeps the tqdm bar, shows the key numbers as its postfix and
prints one short line every ``print_every`` logged steps.
"""

from __future__ import annotations

from transformers import ProgressCallback


#: Metrics shown (when logged), with their short names: the reward, then the signals that say replay is working
#: (docs/metrics.md, "What healthy looks like"): the share of positions that had no route to replay and fell back to
#: the router's own choice, under threshold replay the share of replayed choices the trainer's router replaced, the
#: sampler-vs-trainer KL, and (vLLM with ``vllm_sync_check``) the largest log-prob
#: difference after a weight sync. ``routing/mismatch_frac`` is left off: R3 does not lower it (it measures how much
#: routing replay overrides), so on the line it read as a health signal that it is not; it stays in the logs and plots.
KEY_METRICS = {
    "reward": "reward",
    "routing/fallback_frac": "fallback",
    "routing/replace_rate": "replace",  # logged only under threshold replay (replay_score_threshold > 0)
    "mismatch/kl_k3": "kl_k3",
    "vllm/sync_max_logprob_diff": "sync_diff",
    "loss": "loss",
}


class CompactProgressCallback(ProgressCallback):
    def __init__(self, print_every: int = 10, metrics: dict[str, str] | None = None):
        super().__init__()
        self.print_every = print_every
        self.metrics = dict(KEY_METRICS if metrics is None else metrics)

    def _summary(self, logs: dict) -> dict[str, str]:
        return {
            short: f"{logs[name]:.3g}" for name, short in self.metrics.items() if isinstance(logs.get(name), float)
        }

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        summary = self._summary(logs)
        if summary:
            self.training_bar.set_postfix(summary, refresh=False)
            if self.print_every and state.global_step % self.print_every == 0:
                text = " ".join(f"{k}={v}" for k, v in summary.items())
                self.training_bar.write(f"step {state.global_step}: {text}")
        elif "train_runtime" in logs:
            self.training_bar.write(f"train_runtime {logs['train_runtime']:.1f} s")
