"""A colocated vLLM CPU engine as TRL 1.16's colocate mode builds it, routes and weight syncs; writes JSON.

``python vllm_colocate_sync.py FAMILY OUT.json`` with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set (one
process, ``distributed_executor_backend="external_launcher"``: the engine runs in this process). Records, for the test
to check: the engine's routes for a few prompts and transformers' top-k on the same tokens; the engine's prompt
log-probs and routes before a weight sync, after syncing the unchanged weights, after syncing perturbed weights (with
transformers' log-probs and routes for those), and after syncing the original weights back. Weights are synced in
memory with vLLM's ``reload_weights`` under their checkpoint names (``checkpoint_named_tensors``).
"""

import copy
import json
import os
import sys
import tempfile

import torch


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

FAMILIES = {
    "qwen3_moe": dict(head_dim=32, num_hidden_layers=3),
    "mixtral": dict(head_dim=32, num_hidden_layers=3),
}
PROMPTS = [[1, 20, 21, 22, 23], [1, 30, 31, 32, 33, 34, 35, 36, 37]]
SCORED_PROMPT = [1, 20, 21, 22, 23, 40, 41, 42, 50, 51, 60, 61]


def hf_routes(model, tokens):
    from trl_moe_replay.routing import RouterReplay

    replay = RouterReplay(model)
    with torch.no_grad(), replay.record() as recording:
        model(torch.tensor([tokens]))
    replay.remove()
    return recording.routes[0].tolist()


def hf_logprobs(model):
    with torch.no_grad():
        logits = model(torch.tensor([SCORED_PROMPT])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(SCORED_PROMPT[1:])[:, None])[:, 0].tolist()


def score(llm):
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    request = llm.generate([{"prompt_token_ids": SCORED_PROMPT}], params, use_tqdm=False)[0]
    logprobs = [
        entry[token].logprob for entry, token in zip(request.prompt_logprobs[1:], SCORED_PROMPT[1:], strict=True)
    ]
    return {"logprobs": logprobs, "routes": request.outputs[0].routed_experts.tolist()}


def sync(llm, model):
    from trl_moe_replay.weight_sync.vllm_weights import checkpoint_named_tensors

    # In-process engine: collective_rpc calls the worker directly, the tensors are not copied.
    llm.collective_rpc(
        "reload_weights", kwargs=dict(weights_iterator=checkpoint_named_tensors(model), is_checkpoint_format=True)
    )


def main():
    from vllm import LLM, SamplingParams

    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    family, out = sys.argv[1], sys.argv[2]
    model = tiny_moe_model(family, **FAMILIES[family])
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    llm = LLM(
        path,
        enable_return_routed_experts=True,
        dtype="float32",
        max_model_len=128,
        seed=0,
        distributed_executor_backend="external_launcher",  # what TRL 1.16's colocate mode passes
    )
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
    generations = []
    for prompt, request in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params), strict=True):
        completion = request.outputs[0]
        tokens = prompt + list(completion.token_ids)
        rows = completion.routed_experts
        generations.append(
            {"tokens": tokens, "dtype": str(rows.dtype), "rows": rows.tolist(), "hf_routes": hf_routes(model, tokens)}
        )

    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(7)
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    result = {"generations": generations, "hf_logprobs": hf_logprobs(model), "before": score(llm)}
    sync(llm, model)
    result["after_same"] = score(llm)
    sync(llm, perturbed)
    result["after_perturbed"] = score(llm)
    result["hf_perturbed"] = {"logprobs": hf_logprobs(perturbed), "routes": hf_routes(perturbed, SCORED_PROMPT)}
    sync(llm, model)
    result["after_restore"] = score(llm)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
