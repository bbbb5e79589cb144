"""Async R3 against a real vLLM CPU server (tests/cross_cutting/test_async_engine.py runs this in a subprocess).

    python tests/scripts/async_train.py OUT.json URL CHECKPOINT [routing_replay=r3|none] [max_steps=N]
        [fault=none|kill_worker|kill_server|restart_server|noop_transfer] [server_pid=PID] [tools=true]
        [replay_score_threshold=T]

Trains MoEReplayAsyncGRPOTrainer with TRL's rollout worker (a spawned child) against the server, and checks in every
training forward, token by token, that the experts used at each packed position equal the rows the engine returned
for that sample (tests/async_checks.py); for a multi-turn row, each position's row of the first turn that forwarded
it. Writes a JSON report. The `__main__` guard matters: the rollout worker is a spawned child that re-imports this
file (the reward function and the tool loop are pickled by reference).

``fault=restart_server``: when step 3 begins (after the second sync) the run writes ``OUT.json.paused`` and waits for
``OUT.json.resume``; the test restarts the server in between.
Under ``torchrun --nproc_per_node 2`` (CPU, gloo) rank 0 runs the rollout worker and TRL's dispatcher sends row i of
each micro-batch to rank i: every rank records its own forwards, rank 0 broadcasts the engine rows after training, and
each rank checks its own forwards and writes its report (rank 0 to ``OUT.json``, rank r to ``OUT.rank<r>.json``).

``ep=true`` (two ranks): the model sharded at load time, experts split between the ranks (``distributed_config``).

``tools=true [turns=N]``: TRL's tool loop with a short adding tool (short names keep 8 turns inside the server's 512
tokens); vLLM's structured outputs make each of the first N - 1 turns (default 2) a tool call and the last one an
answer (the engine picks the tokens, a regex keeps the format).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trl_moe_replay.async_grpo.async_rollout_worker import RoutedRolloutLoop  # noqa: E402


RESTART_WAIT = 900  # seconds the run waits for the test to restart the server
EXPERT_PARALLEL = {"fsdp_size": 2, "ep_size": 2, "ep_implementation": "all_to_all"}  # ep=true, two ranks


def even_tokens(completions, completion_ids, **kwargs):
    """Toy reward a tiny random model can learn: the share of even token ids."""
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


TOOL_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"x": "[0-9]\+[0-9]"\}\}\n</tool_call>'


def add(x: str) -> str:
    """Add two digits.

    Args:
        x: two digits joined by a plus sign, for example "3+4".
    """
    first, second = x.split("+")
    return str(int(first) + int(second))


ANSWER = r"\\boxed\{[0-9]{1,2}\}"


class ToolCallingLoop(RoutedRolloutLoop):
    """Our rollout loop; every request asks vLLM for a tool call (the first ``tool_turns - 1`` turns) or an answer
    (the last), by regex. The tool markup's word tokens get a logit bias, so the engine writes the markup as the chat
    template renders it and TRL chains the turns into one row (a clean append) instead of re-aligning them."""

    def __init__(self, *, tool_turns: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.tool_turns = tool_turns

    async def _post(self, path, payload, timeout, max_retries=3):
        if path == "/v1/completions":
            markup = self.tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>", '"name": ', '"arguments": '])
            results = payload["prompt"].count(self.tokenizer.convert_tokens_to_ids("<tool_response>"))
            payload = {
                **payload,
                "structured_outputs": {"regex": ANSWER if results >= self.tool_turns - 1 else TOOL_CALL},
                "logit_bias": {str(token): 30.0 for token in markup},
            }
        return await super()._post(path, payload, timeout, max_retries)


def first_forward_rows(turns, length: int, disagreements: list | None = None):
    """A row's expected engine routes, ``[length - 1, L, K]``: each position's row from the first turn that forwarded
    it (what the synchronous trainer replays for multi-turn rows); -1 where no turn did (counted as a mismatch).
    Appends to ``disagreements`` how many positions a later turn re-forwarded with other experts (where the rule
    matters)."""
    import numpy as np

    expected, filled = None, np.zeros(length - 1, dtype=bool)
    for turn in turns:
        if not isinstance(turn.rows, np.ndarray):
            return None
        if expected is None:
            expected = np.full((length - 1, *turn.rows.shape[1:]), -1, dtype=np.int64)
        covered = turn.prompt_length + turn.completion_length - 1
        # the rows start at the turn's routed_experts_prompt_start, or at 0 where the engine ignored it
        first = turn.prompt_start if len(turn.rows) == covered - turn.prompt_start else 0
        rows = turn.rows[: max(min(covered, length - 1) - first, 0)]
        span = slice(first, first + len(rows))
        new = ~filled[span]
        if disagreements is not None and not new.all():
            again = ~new
            other = np.sort(rows[again], -1) != np.sort(expected[span][again], -1)
            disagreements.append(int(other.any(axis=(-2, -1)).sum()))
        expected[span][new] = rows[new]
        filled[span] = True
    return expected


def main(out: str, url: str, checkpoint: str, *overrides: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.chat_template_utils import qwen3_template

    from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayAsyncGRPOTrainer
    from trl_moe_replay.parallel.sharded import full_tensor
    from trl_moe_replay.testing.async_workers import NoOpWeightTransfer

    from tests.async_checks import check_row, recording_trainer

    options = dict(item.split("=", 1) for item in overrides)
    fault = options.pop("fault", "none")
    server_pid = int(options.pop("server_pid", 0))
    with_tools = options.pop("tools", "false") == "true"
    tool_turns = int(options.pop("turns", 2))  # with tools: the turns of a conversation (calls, then an answer)
    with_lora = options.pop("lora", "false") == "true"  # a PEFT LoRA policy: attention, router, fused experts
    expert_parallel = options.pop("ep", "false") == "true"  # two ranks: experts sharded at load (ep 2, fsdp 2)
    engine_rows: dict[tuple, list] = {}
    consumed: list[int] = []
    turn_counts: list[int] = []
    rows_per_position: list[float] = []  # engine rows received for a sample over its positions (1.0: each once)
    disagreements: list[int] = []  # per later turn: re-forwarded positions routed unlike their first forward

    class RecordingQueue:
        """TRL's rollout queue: keeps each sample's engine rows (decoded in the worker, not aligned) for the check."""

        def __init__(self, inner):
            self.inner = inner

        def get(self, *args, **kwargs):
            sample = self.inner.get(*args, **kwargs)
            consumed.append(sample.model_version)
            turns = getattr(sample, "route_turns", [])
            turn_counts.append(len(turns))
            if turns and all(hasattr(turn.rows, "shape") for turn in turns):
                rows_per_position.append(sum(len(turn.rows) for turn in turns) / (len(sample.input_ids) - 1))
            expected = first_forward_rows(turns, len(sample.input_ids), disagreements) if turns else None
            if expected is not None:
                engine_rows.setdefault(tuple(sample.input_ids.tolist()), []).append(expected)
            return sample

        def __getattr__(self, name):
            return getattr(self.inner, name)

    forwards = []  # (packed row, experts used) of this rank's training forwards, checked after training

    CheckedTrainer = recording_trainer(MoEReplayAsyncGRPOTrainer, forwards)

    class Faults(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if fault != "restart_server" or state.global_step != 2:
                return
            # step 3 begins (its batch is taken): the second sync is done; the test restarts the server now
            Path(out + ".paused").touch()
            deadline = time.monotonic() + RESTART_WAIT
            while not Path(out + ".resume").exists() and time.monotonic() < deadline:
                time.sleep(0.5)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step != 2:
                return
            if fault == "kill_worker":
                os.kill(trainer.rollout_worker._process.pid, signal.SIGKILL)
            elif fault == "kill_server":
                os.killpg(server_pid, signal.SIGKILL)

    if with_tools:
        from trl_moe_replay.testing import tiny_tokenizer

        tokenizer = tiny_tokenizer(tools=True)  # the tool template, TRL's Qwen3 parser, one token per markup word
    else:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        tokenizer.response_template = qwen3_template  # TRL's add_response_schema does not know the ChatML template
    prompts = [[{"role": "user", "content": f"{a}+{b}="}] for a in range(4) for b in range(4)]
    settings = dict(
        output_dir=str(Path(out).parent / f"run_{Path(out).stem}"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=6,
        logging_steps=1,
        per_device_train_batch_size=6,
        num_generations=4,
        max_completion_length=16,
        learning_rate=1e-2,
        save_strategy="no",
        seed=0,
        vllm_server_base_url=url,
        max_staleness=4,
        max_inflight_tasks=4,
        queue_maxsize=2,
        token_budget=0,
        gradient_checkpointing=True,
        vllm_server_timeout=60,
        request_timeout=120,
        vllm_request_attempts=2,
        heartbeat_stale_after_s=120,
        replay_score_threshold=0.0,
    )
    if with_tools:  # tool_turns - 1 calls, then the answer after the last tool result
        # max_completion_length is each request's max_tokens: every turn's prompt plus it must fit the server's 512
        settings.update(max_completion_length=48, max_tool_calling_iterations=tool_turns - 1)
    for key, value in options.items():
        if value == "none" and isinstance(settings.get(key), int):  # e.g. vllm_request_attempts=none: TRL's count
            settings[key] = None
        elif value in ("true", "false"):
            settings[key] = value == "true"
        elif key in settings and not isinstance(settings[key], str):
            settings[key] = type(settings[key])(value)
        else:
            settings[key] = value
    if expert_parallel:
        settings["model_init_kwargs"] = {"dtype": "float32", "distributed_config": EXPERT_PARALLEL}
    args = MoEReplayAsyncGRPOConfig(**settings)
    transfer = NoOpWeightTransfer() if fault == "noop_transfer" else None
    peft_config = None
    if with_lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "gate"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )
    trainer = CheckedTrainer(
        model=checkpoint,
        reward_funcs=even_tokens,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        weight_transfer=transfer,
        callbacks=[Faults()],
        tools=[add] if with_tools else None,
        peft_config=peft_config,
    )
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    if trainer.rollout_worker is not None:  # the main process only
        if with_tools:
            trainer.rollout_worker._loop_cls = ToolCallingLoop
            trainer.rollout_worker._loop_kwargs["tool_turns"] = tool_turns  # the loop is built in the spawned child
        trainer.rollout_queue = RecordingQueue(trainer.rollout_queue)
        # small buffers (one group in flight, one being scored, two samples queued), and 1.5 groups per micro-batch:
        # micro-batches then hold samples of the versions before and after a sync
        trainer.rollout_worker._loop_kwargs["score_queue_maxsize"] = 1
    # full values (a collective on every rank where the model is sharded at load time)
    before = {name: full_tensor(p.detach()).clone() for name, p in trainer.model.named_parameters()}
    start = time.monotonic()
    error = None
    try:
        trainer.train()
    except Exception as exc:  # the fault runs report what ended them
        error = {
            "type": type(exc).__name__,
            "message": str(exc)[:2000],
            "cause": repr(exc.__cause__)[:2000] if exc.__cause__ else None,
        }
    if world > 1:  # the engine rows live where the queue is: rank 0
        shared = [engine_rows]
        torch.distributed.broadcast_object_list(shared, src=0)
        engine_rows.update(shared[0])
    checks = [check_row(row, used, engine_rows, trainer._route_replay.moe_layers) for row, used in forwards]
    report = {
        "rank": rank,
        "world": world,
        "error": error,
        "seconds": time.monotonic() - start,
        "log_history": trainer.state.log_history,
        "checks": checks,
        "consumed_versions": consumed,
        "model_version": trainer.model_version,
        "route_turns_per_sample": turn_counts,
        "rows_per_position": rows_per_position,
        "reforwarded_positions_routed_otherwise": disagreements,
        "max_param_change": max(
            float((full_tensor(p.detach()) - before[n]).abs().max()) for n, p in trainer.model.named_parameters()
        ),
        "weight_transfer": type(trainer.weight_transfer).__name__,
        "delivered": getattr(trainer.weight_transfer, "delivered", None),
        "peft": type(trainer.model).__name__,
        "lora_b_change": max(
            (float(p.detach().abs().max()) for n, p in trainer.model.named_parameters() if "lora_B" in n), default=None
        ),
    }
    if world > 1:
        report["final_params"] = {
            n: full_tensor(p.detach()).flatten()[:8].tolist() for n, p in trainer.model.named_parameters()
        }
    Path(out if rank == 0 else str(Path(out).with_suffix(f".rank{rank}.json"))).write_text(
        json.dumps(report, indent=1, default=str)
    )
    if trainer.rollout_worker is not None:
        trainer.rollout_worker.stop()
    del torch


if __name__ == "__main__":
    main(*sys.argv[1:])
