"""R3 training against a real vLLM CPU engine, checked token by token; writes a JSON report for the test.

    python vllm_train.py REPORT.json colocate FAMILY [key=value ...]          # TRL's colocate mode (this process)
    python vllm_train.py REPORT.json server URL CHECKPOINT [key=value ...]    # a running `vllm serve` on CHECKPOINT
    python vllm_train.py --runs RUNS.json    # each argument list of RUNS.json in turn, in this process (run_all)

Colocate mode needs RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (TRL's external launcher runs the engine in
this process). The trainer (tests/route_checks.py) checks, in every old-logprob, reference and training forward,
that the experts actually used equal the routes vLLM returned for those tokens. Around every weight sync it scores a
probe with the engine and the trainer: before the sync (the engine still has the previous step's weights) and after.
Extra arguments go to MoEReplayGRPOConfig (e.g. routing_replay=r2, max_steps=2).
"""

import functools
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: tiny configs vLLM's CPU build runs (its attention needs head_dim >= 32)
FAMILIES = {
    "qwen3_moe": dict(head_dim=32, num_hidden_layers=3),
    "mixtral": dict(head_dim=32, num_hidden_layers=3),
}


def checkpoint(family: str, directory: str, tools: bool = False) -> str:
    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    tiny_moe_model(family, **FAMILIES[family]).save_pretrained(directory)
    tiny_tokenizer(tools=tools).save_pretrained(directory)  # the engine reads the same vocabulary
    return directory


@functools.cache
def colocate_checkpoint(family: str, tools: bool) -> str:
    """The checkpoint of this process's colocate runs of ``family``: one folder, so their engines' arguments match."""
    return checkpoint(family, tempfile.mkdtemp(), tools=tools)


def share_colocated_engines() -> None:
    """Colocate runs in one process share an engine: TRL's VLLMGeneration builds a new ``vllm.LLM`` per trainer (a
    minute on a CPU); built again with the same arguments (so the same checkpoint and tokenizer), the first one is
    returned instead. A reused engine starts a run as a fresh one does, for all the run checks: the trainer syncs its
    weights into the engine before its first generation (TRL's ``_last_loaded_step`` starts at -1: the sync trigger
    of trl_moe_replay's trainer) and the reload resets the prefix cache; sleep mode is off in these runs; and the
    random generators, which the in-process engine samples from, are seeded as vLLM seeds them when it builds one
    (``seed``), so a run's tokens do not depend on the runs before it."""
    import trl.generation.vllm_generation as generation
    from transformers import set_seed

    engines = {}

    class SharedLLM(generation.LLM):
        def __new__(cls, *args, **kwargs):
            key = repr((args, sorted(kwargs.items())))
            if key in engines:  # an instance of an earlier subclass (trl_moe_replay's, per trainer): no __init__
                set_seed(kwargs.get("seed", 0))
                return engines[key]
            engine = super().__new__(cls)
            engine.shared_key = key
            return engine

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines[self.shared_key] = self  # once built: an engine that failed to start is not reused

    generation.LLM = SharedLLM


def parse(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def main(argv: list[str], end: bool = True) -> None:
    """One run: ``argv`` as on the command line (REPORT.json MODE ...); ``end``: end the trainer (and with it the
    process group) afterwards."""
    import torch
    from datasets import Dataset

    from trl_moe_replay import MoEReplayGRPOConfig
    from trl_moe_replay.routing import has_route
    from trl_moe_replay.routing.codec import decode_routed_experts
    from trl_moe_replay.testing import tiny_tokenizer

    from tests.route_checks import RouteCheckingTrainer, RouteOracle

    out, mode = argv[0], argv[1]
    rest = argv[3:] if mode == "colocate" else argv[4:]
    overrides = {key: parse(value) for key, value in (arg.split("=", 1) for arg in rest)}
    fuzz_seed = overrides.pop("fuzz", None)  # corrupt a random share of the server's route payloads
    with_tools = overrides.pop("tools", False)  # tool-calling rollouts (TRL's tool loop), forced by a regex
    turns = overrides.pop("turns", None)  # with tools: N turns per sample (a tool call in each of the first N - 1)
    with_lora = overrides.pop("lora", False)  # a PEFT LoRA policy on attention, the router and the fused experts
    count_only = overrides.pop("count_mismatches", False)  # count positions off the engine's routes, don't assert
    if mode == "colocate":
        model_path = colocate_checkpoint(argv[2], bool(with_tools))
        engine = dict(vllm_mode="colocate")
    else:
        url, model_path = argv[2], argv[3]
        # A seeded sampler per request (vLLM seeds the n completions of a prompt with seed, seed + 1, ...): the server
        # is shared by a module's tests, and unseeded it samples from one generator that every earlier request (and
        # the order requests share a batch in) moved on, so each run scored other tokens and a metric of them, such
        # as routing/mismatch_frac, came out differently from run to run. Colocate mode needs no seed: the engine
        # lives in this fresh process, seeded by TRL (LLM(seed=0)) and by set_seed, and TRL sends the num_generations
        # copies of a prompt with n=1 each, so one fixed seed would make them identical there.
        engine = dict(vllm_mode="server", vllm_server_base_url=url, generation_kwargs={"seed": 0})

    class EngineChecked(RouteCheckingTrainer):
        syncs: list = []
        batches: list = []
        later_turns = 0  # tool turns generated (a sample's second or third turn)
        rows_received: list = []  # per sample of each generation batch: [engine rows, positions, turns]

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            state = self._routes.batch if self._routes is not None else None
            if state is not None and state.generated_turns == 1:
                self.oracle.routes.clear()  # a new generation batch: the engine holds new weights
            elif state is not None:
                self.later_turns += len(prompt_ids)
            if state is not None and state.turns is not None and fuzz_seed is None:  # what vLLM returned, per sample
                for sample, turns in enumerate(state.turns.turns):  # (a later tool turn adds to some samples only)
                    turn, sequence = turns[-1], state.turns._sequences[sample]
                    if turn.rows is not None:
                        tokens = sequence[: turn.prompt_length + turn.completion_length]
                        self.oracle.add(tokens, turn.rows, start=turn.prompt_start)
            return completion_ids, logprobs

        def _generate(self, prompts):
            output = super()._generate(prompts)
            state = self._routes.batch if self._routes is not None else None
            if state is not None and state.turns is not None and fuzz_seed is None:
                for turns, sequence in zip(state.turns.turns, state.turns._sequences, strict=True):
                    rows = [decode_routed_experts(t.rows) if isinstance(t.rows, str) else t.rows for t in turns]
                    # engine rows received for this sample over all its turns, and its routable positions
                    self.rows_received.append(
                        [sum(len(r) for r in rows if r is not None), len(sequence) - 1, len(turns)]
                    )
            return output

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            replayed = self.replayed_routes(output)
            if replayed is not None:  # before TRL shuffles the batch: sample i is the engine's completion i
                attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
                self.batches.append(
                    {
                        "routable": (attention.sum(1) - 1).tolist(),
                        "routed": has_route(replayed).any(-1).sum(1).tolist(),
                    }
                )
            return output

        def _sync_vllm_weights(self):
            model = self.accelerator.unwrap_model(self.model)
            # the first sync sends the weights the engine started from: nothing to compare before it
            before = self._sync_check.measure(model) if self.syncs else None
            super()._sync_vllm_weights()
            after = self._sync_check.measure(model)
            self.syncs.append({"step": self.state.global_step, "before": before, "after": after})

    settings = dict(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=3,
        logging_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=3e-2,
        save_strategy="no",
        seed=0,
        routing_replay="r3",
        use_vllm=True,
        vllm_sync_check=True,
        beta=0.04,
        vllm_gpu_memory_utilization=0.5,
        **engine,
    )
    settings.update(overrides)
    prompts = [f"{a}+{b}=" for a in range(4) for b in range(4)]
    tool_kwargs = {}
    if with_tools:  # every turn either calls the tool or answers: the engine picks, the regex keeps the format
        from trl_moe_replay.extras.math.tools import calculator

        prompts = [[{"role": "user", "content": prompt}] for prompt in prompts]
        tool_kwargs = {"tools": [calculator]}
        settings.update(
            vllm_structured_outputs_regex=r'(<tool_call>\n\{"name": "calculator", "arguments": \{"expression": '
            r'"[0-9]\+[0-9]"\}\}\n</tool_call>|\\boxed\{[0-9]{1,2}\})',
            max_completion_length=96,
            max_tool_calling_iterations=2,
        )
        if turns is not None:  # long conversations: room for N turns of ~60 tokens (a call and its tool result)
            settings.update(max_completion_length=56 * int(turns), max_tool_calling_iterations=int(turns) - 1)
    if with_lora:
        from peft import LoraConfig

        # attention, the router (PEFT wraps its weight parameter) and transformers' fused 3-D expert weights;
        # lora_B starts at zero, so the first sync sends the base weights and the later ones W + BA
        tool_kwargs["peft_config"] = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "gate"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )
    args = MoEReplayGRPOConfig(**settings)
    EngineChecked.count_mismatches = bool(count_only)
    trainer = EngineChecked(
        model=model_path,
        args=args,
        processing_class=tiny_tokenizer(tools=bool(with_tools)),
        reward_funcs=lambda completions, **kw: [float(len(str(c))) for c in completions],
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        **tool_kwargs,
    )
    rr = trainer._route_replay
    client = getattr(trainer.vllm_generation, "vllm_client", None)
    if turns is not None and client is not None:  # server mode, main process: the one request of each turn
        call, answer = settings["vllm_structured_outputs_regex"][1:-1].split("|", 1)
        tokenizer = trainer.processing_class
        tool_result = tokenizer.convert_tokens_to_ids("<tool_response>")
        # the markup's word tokens get a logit bias (as in async_train.py): the engine writes a call in ~45 tokens
        markup = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>", '"name": ', '"arguments": '])
        generate = client.generate

        def generate_turn(prompts, **kwargs):  # a call while fewer than N - 1 tool results are in the prompt
            results = min(list(prompt).count(tool_result) for prompt in prompts)
            kwargs["structured_outputs_regex"] = call if results < int(turns) - 1 else answer
            kwargs["generation_kwargs"] = {
                **(kwargs.get("generation_kwargs") or {}),
                "logit_bias": {str(token): 30.0 for token in markup},
            }
            # the test server's --max-model-len is 512 (tests/vllm_server.py); the regex bounds the output anyway
            kwargs["max_tokens"] = min(kwargs["max_tokens"], 512 - max(len(prompt) for prompt in prompts))
            return generate(prompts, **kwargs)

        client.generate = generate_turn
    trainer.oracle = RouteOracle(rr.num_layers, rr.top_k)
    fuzzer = None
    if fuzz_seed is not None:  # corrupt payloads as they arrive, before the trainer sees them
        import numpy as np

        from trl_moe_replay.routing.codec import encode_routed_experts
        from trl_moe_replay.testing import RouteFuzzer

        fuzzer = RouteFuzzer(int(fuzz_seed), num_experts=rr.num_experts, moe_layers=rr.moe_layers, rate=0.5)
        hook, calls = trainer._route_source._hook, iter(range(1_000_000))
        take = hook.take

        def take_corrupted():  # the hook decodes as the body arrives: the fuzzer corrupts the payloads as sent
            payloads, call = take(), next(calls)
            if payloads is None:
                return None
            sent = [encode_routed_experts(p) if isinstance(p, np.ndarray) else p for p in payloads]
            return [fuzzer(call, i, p) for i, p in enumerate(sent)]

        hook.take = take_corrupted
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in trainer.model.named_parameters())
    report = {
        "log_history": trainer.state.log_history,
        "forwards": trainer.forwards,
        "checked_positions": trainer.checked_positions,
        "syncs": trainer.syncs,
        "weight_sync": type(trainer._weight_sync).__name__ if trainer._weight_sync is not None else "trl",
        "max_param_change": moved,
        "engine_dtype": str(trainer.vllm_generation.llm.llm_engine.model_config.dtype) if mode == "colocate" else None,
        "batches": trainer.batches,
        "corrupted": [[call, choice, kind] for (call, choice), kind in fuzzer.corrupted.items()] if fuzzer else [],
        "later_turns": trainer.later_turns,
        "mismatched_positions": trainer.mismatched_positions,
        "lora_b_change": max(
            (float(p.detach().abs().max()) for n, p in trainer.model.named_parameters() if "lora_B" in n), default=None
        ),
        "peft": type(trainer.model).__name__,
        "rows_received": trainer.rows_received,
    }
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one report per rank
        out = f"{out}.rank{os.environ['RANK']}"
    Path(out).write_text(json.dumps(report))
    if end:
        trainer.end()


def run_all(runs: str) -> None:
    """Each argument list of the JSON file ``runs`` in turn (colocate ones: one engine per family and tokenizer,
    share_colocated_engines); the trainer of the last one ends the process group. A run that raises writes its
    traceback to REPORT.json.error, and the next one goes on."""
    share_colocated_engines()
    argvs = json.loads(Path(runs).read_text())
    for i, argv in enumerate(argvs):
        try:
            main(argv, end=i == len(argvs) - 1)
        except Exception:
            Path(f"{argv[0]}.error").write_text(traceback.format_exc())


if __name__ == "__main__":
    if sys.argv[1] == "--runs":
        run_all(sys.argv[2])
    else:
        main(sys.argv[1:])
