"""Pre-training audit: how far apart are the generation engine and the trainer, with and without routing replay?

The engine is either

- transformers ``generate`` in the engine's dtype (``bfloat16``, as inference engines run), recorded by
  :class:`~trl_moe_replay.rollouts.TransformersRolloutRecorder` exactly as the trainer records rollouts, or
- a running vLLM server (``trl vllm-serve --model M --enable-return-routed-experts``), sampled through TRL's own
  ``VLLMClient`` (with :class:`~trl_moe_replay.rollouts.route_stream.CompletionRoutesHook` on its session, which
  takes each choice's ``routed_experts``, decoded), with ``logprobs=0`` as TRL's trainer asks: vLLM's ``processed_logprobs`` of the sampled
  tokens, i.e. ``log_softmax(logits / temperature)``.

Either gives, per completion, the prompt and completion token ids, the sampled tokens' log-probabilities and the
routes the engine used (vLLM's ``[p + c - 1, L, K]`` row layout). The trainer is the same checkpoint in the
trainer's dtype, fed the whole batch in TRL's layout (left-padded prompts, right-padded completions) in one
forward, as TRL's old-logprob pass does. Two trainer passes are compared with the engine:

- ``none``: the trainer routes by its own router (plain GRPO);
- ``r3``: the trainer replays the engine's routes (:meth:`RouterReplay.replay`).

For each: the sampler-vs-trainer KL estimators and the fraction of extreme tokens over the completion tokens
(:func:`~trl_moe_replay.core.metrics.logprob_mismatch_sums`), and how the routes the trainer *used* compare with the
engine's over every routable position and MoE layer (:func:`~trl_moe_replay.core.metrics.routing_agreement_sums`).
Under ``r3`` the used routes are the engine's by construction (mismatch 0 unless a position lacked a route: see
``fallback_frac``); its ``natural_mismatch`` column says how often the trainer's router would have chosen otherwise.

A vLLM server that returns no routes at all (started without ``--enable-return-routed-experts``) still gets the
``none`` row's log-prob numbers; the routing columns are ``None`` (``n/a``), there is no ``r3`` row, and the verdict
gives the command that starts the server with routes. Completions that come without routes while others have them
count as ``fallback``. A payload that does not fit the trainer's model (another checkpoint, layer count, top-k,
expert count) raises :class:`~trl_moe_replay.routing.errors.RouteAlignmentError`: the numbers would be meaningless.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import pickle
import threading
from dataclasses import asdict, dataclass, field

import torch
from transformers import GenerationConfig

from ..core.launch import check_model_path
from ..core.metrics import (
    check_extreme_threshold,
    logprob_mismatch_sums,
    routable_positions,
    routing_agreement_sums,
)
from ..core.routing_options import ReplayMode
from ..errors import TrlMoeReplayError
from ..rollouts import TransformersRolloutRecorder
from ..rollouts.route_intake import RouteIntake, RoutesUnavailableError
from ..routing import RouterReplay, has_route
from ..routing.codec import EngineTurn
from ..routing.errors import RouteAlignmentError
from ..upstream import pad


TINY_PREFIX = "tiny:"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class AuditRow:
    """Engine-vs-trainer numbers of one trainer pass (means over completion tokens / (position, layer) pairs)."""

    mode: str
    kl_k1: float
    kl_k3: float
    extreme_frac: float
    max_abs_log_ratio: float
    # The routing columns are None when the engine returned no routes at all (nothing to compare with).
    route_mismatch_frac: float | None  # routes the trainer used differ from the engine's (position x MoE layer pairs)
    topk_agreement: float | None  # mean |used top-k ∩ engine top-k| / k
    natural_mismatch_frac: float | None  # the trainer's own router (recorded in this pass) vs the engine's routes
    fallback_frac: float | None  # routable positions without an engine route (the router chose by itself there)


@dataclass
class AuditReport:
    model: str
    engine_dtype: str  # the transformers engine's dtype; for a vLLM server, what it reports (or "unknown")
    trainer_dtype: str
    num_prompts: int
    num_completions: int
    completion_tokens: int
    routed_pairs: int
    rows: list[AuditRow]
    engine: str = "transformers"  # "transformers" (generate) or "vllm" (a server)
    engine_url: str | None = None  # the vLLM server's base URL
    routes_available: bool = True  # False: the engine returned no routes, so there is no r3 row
    server_command: str | None = None  # how to start the vLLM server with routes (vLLM engine only)
    notes: list[str] = field(default_factory=list)  # things to know about this run (server config, fallbacks)

    def row(self, mode: str) -> AuditRow:
        for r in self.rows:
            if r.mode == mode:
                return r
        raise KeyError(f"no {mode!r} row in this report (rows: {[r.mode for r in self.rows]})")

    def to_dict(self) -> dict:
        return asdict(self)

    def format_table(self) -> str:
        """The table and a one-line reading of it."""
        engine = (
            f"{self.engine_dtype} generate"
            if self.engine == "transformers"
            else f"vLLM server at {self.engine_url} ({self.engine_dtype})"
        )
        head = (
            f"Routing audit of {self.model}: engine {engine} vs trainer {self.trainer_dtype} "
            f"forward; {self.num_prompts} prompts, {self.num_completions} completions, {self.completion_tokens} "
            f"completion tokens, "
            f"{self.routed_pairs} routed (position, MoE layer) pairs"
        )
        columns = [
            "mode",
            "kl_k1",
            "kl_k3",
            "extreme_frac",
            "max|logratio|",
            "route_mismatch",
            "topk_agree",
            "natural_mismatch",
            "fallback",
        ]
        widths = [max(len(c), 10) for c in columns[1:]]
        header = [f"{columns[0]:<6}", *(f"{c:>{w}}" for c, w in zip(columns[1:], widths, strict=True))]
        lines = [head, "", "  ".join(header)]
        for r in self.rows:
            values = [
                r.kl_k1,
                r.kl_k3,
                r.extreme_frac,
                r.max_abs_log_ratio,
                r.route_mismatch_frac,
                r.topk_agreement,
                r.natural_mismatch_frac,
                r.fallback_frac,
            ]
            lines.append(
                "  ".join(
                    [
                        f"{r.mode:<6}",
                        *(
                            f"{'n/a':>{w}}" if v is None else f"{v:>{w}.4g}"
                            for v, w in zip(values, widths, strict=True)
                        ),
                    ]
                )
            )
        if not self.routes_available:
            lines.append(f"{'r3':<6}  unavailable: the engine returned no routes")
        lines += ["", self.verdict()]
        lines += [f"Note: {note}" for note in self.notes]
        return "\n".join(lines)

    def verdict(self) -> str:
        if not self.routes_available:
            none = self.row("none")
            return (
                f"The vLLM server at {self.engine_url} returned no routed experts, so the R3 row is unavailable "
                f"(only the log-prob mismatch without replay is measured: kl_k3 {none.kl_k3:.3g}, extreme tokens "
                f"{100 * none.extreme_frac:.2f}%). Start the server with routes and re-run:\n\n"
                f"    {self.server_command}\n\n"
                "vLLM captures routes only with prefix caching on and Model Runner V2 (both the default), for a "
                "Mixture-of-Experts model, without pipeline or context parallelism."
            )
        none, r3 = self.row("none"), self.row("r3")
        mismatch = none.route_mismatch_frac
        assert mismatch is not None  # measured whenever the engine returned routes
        if mismatch == 0.0:
            return (
                "The trainer routes every token like the engine here: routing replay changes nothing on these prompts "
                "(log-prob mismatch, if any, is numeric). Re-run with the real engine dtype and longer completions."
            )
        return (
            f"Without replay the trainer routes {100 * mismatch:.2f}% of (token, layer) pairs to other "
            f"experts than the engine; replaying the engine's routes (R3) changes kl_k3 from {none.kl_k3:.3g} to "
            f"{r3.kl_k3:.3g} ({_change(none.kl_k3, r3.kl_k3)}) and extreme tokens from "
            f"{100 * none.extreme_frac:.2f}% to {100 * r3.extreme_frac:.2f}%."
        )


def _change(before: float, after: float) -> str:
    """How ``after`` compares with ``before``, as a factor >= 1 and a direction: '3.2x lower', '1.17x higher'."""
    if after == before:
        return "unchanged"
    if after < before:
        return f"{before / after:.3g}x lower" if after > 0 else "down to 0"
    return f"{after / before:.3g}x higher" if before > 0 else "up from 0"


def load_model_and_tokenizer(model: str, dtype: torch.dtype, *, trust_remote_code: bool = False, revision=None):
    """``tiny:<model_type>`` (offline, :mod:`trl_moe_replay.testing`) or a Hub name / local path."""
    if model.startswith(TINY_PREFIX):
        from ..testing import tiny_moe_model, tiny_tokenizer

        return tiny_moe_model(model[len(TINY_PREFIX) :], dtype=dtype), tiny_tokenizer()
    model = check_model_path(model, revision)  # a mistyped path or unreachable Hub id: one line; `~` expanded
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code, revision=revision)
    with _unreadable_weights_refused(model):
        causal_lm = AutoModelForCausalLM.from_pretrained(
            model, dtype=dtype, trust_remote_code=trust_remote_code, revision=revision
        )
    return causal_lm.eval(), tokenizer


class ModelWeightsError(TrlMoeReplayError, ValueError):
    """A checkpoint's weight file cannot be read (truncated by an interrupted save or copy, or not a weight file)."""


@contextlib.contextmanager
def _unreadable_weights_refused(model: str):
    """Turn the readers' errors for a damaged weight file into one :class:`ModelWeightsError` line."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, pickle.UnpicklingError, EOFError) as exc:
        problem: Exception = exc
    except RuntimeError as exc:  # torch.load of a damaged .bin: its zip reader's error, the only RuntimeError kept
        if "PytorchStreamReader" not in str(exc):
            raise
        problem = exc
    else:
        return
    first_line = (str(problem).strip().splitlines() or [type(problem).__name__])[0]
    raise ModelWeightsError(
        f"the weights of {model} cannot be read ({type(problem).__name__}: {first_line}): the file is damaged, "
        "probably truncated by an interrupted save or copy; save or download the checkpoint again"
    ) from None


AUTO = "auto"  # --trainer_dtype's default: float32 where it fits, else bfloat16 (fitting_trainer_dtype)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
USABLE = 0.9  # of the device's memory: the rest for the forward's activations and the allocator


class AuditMemoryError(TrlMoeReplayError, ValueError):
    """A model whose weights do not fit the audit's device in any trainer dtype."""


def device_memory(device: torch.device) -> int:
    """Bytes of the device: a GPU's total memory, or this machine's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fitting_trainer_dtype(
    model: str, device: torch.device, engine_dtype: str, *, engine_copy: bool, memory: int | None = None
) -> tuple[str, str | None]:
    """The trainer dtype ``--trainer_dtype auto`` picks, and a note saying why: float32 (the trainer's own precision)
    where the weights fit :data:`USABLE` of the device's memory, beside the engine's copy when generate runs here
    (``engine_copy``; a copy in the same dtype is shared), else bfloat16; a model that fits in neither is refused in
    one line (:class:`AuditMemoryError`). The parameter count is the plan's (the model's ``config.json``, never a
    download); a model it cannot count gets float32, and the note says so."""
    from .plan import PlanError, model_numbers

    if model.startswith(TINY_PREFIX):
        return "float32", None  # the offline test models: a few MB
    try:
        params = model_numbers(model).params_total
    except PlanError as exc:
        return "float32", f"trainer dtype float32 (auto: the model's size is unknown here: {exc})"
    usable = USABLE * (device_memory(device) if memory is None else memory)

    def need(dtype: str) -> float:
        engine = params * DTYPE_BYTES[engine_dtype] if engine_copy and engine_dtype != dtype else 0
        return params * DTYPE_BYTES[dtype] + engine

    for dtype in ("float32", "bfloat16"):
        if need(dtype) <= usable:
            why = "fits" if dtype == "float32" else f"float32 needs {need('float32') / 1e9:.0f} GB"
            return dtype, (
                f"trainer dtype {dtype} (auto: {params / 1e9:.1f}B parameters; {why}, of {usable / 1e9:.0f}"
                f" GB usable on {device}; pass --trainer_dtype to choose)"
            )
    raise AuditMemoryError(
        f"{model}: {params / 1e9:.1f}B parameters need {need('bfloat16') / 1e9:.0f} GB in bfloat16"
        f"{' with the engine copy' if engine_copy and engine_dtype != 'bfloat16' else ''}, more than the "
        f"{usable / 1e9:.0f} GB usable on {device} ({USABLE:.0%} of its memory): audit on a device with more memory, "
        "or a smaller model of the same family"
    )


def resolve_device(device: str | None) -> torch.device:
    """The torch device the audit runs on: ``device`` (``cpu``, ``cuda``, ``cuda:N``, ...) if this machine has it,
    else ``cuda`` when available, else ``cpu``. A device that holds no data (``meta``), is not a torch device, or is
    not on this machine raises ``ValueError`` before anything is loaded."""
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(
            f"--device {device!r} is not a torch device: pass cpu, cuda or cuda:N (or leave it out: cuda if "
            "available, else cpu)"
        ) from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type == "meta":
        raise ValueError("--device meta holds shapes, not numbers, and the audit measures numbers: pass cpu or cuda")
    backend = getattr(torch, parsed.type, None)
    is_available = getattr(backend, "is_available", None)
    if backend is None or not callable(is_available) or not is_available():
        raise ValueError(
            f"--device {device}: this machine has no {parsed.type} device (torch {torch.__version__} finds none): "
            f"pass cpu{', or cuda' if torch.cuda.is_available() else ''}"
        )
    count = backend.device_count() if callable(getattr(backend, "device_count", None)) else None
    if parsed.index is not None and count is not None and parsed.index >= count:
        raise ValueError(
            f"--device {device}: this machine has {count} {parsed.type} device(s), numbered 0 to "
            f"{count - 1}: pass {parsed.type}:0 .. {parsed.type}:{count - 1}"
        )
    return parsed


def check_prompts(prompts: list) -> None:
    """Each prompt is text a tokenizer can encode (UTF-8), else ``ValueError`` naming the first that is not.

    A prompt from the command line with bytes that are not UTF-8 reaches Python as lone surrogates
    (``surrogateescape``); tokenizers then fail with a ``TypeError`` that does not say which prompt or why.
    """
    for i, prompt in enumerate(prompts, start=1):
        if not isinstance(prompt, str):
            raise ValueError(f"prompt {i} must be text, got {type(prompt).__name__} {prompt!r:.60}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(prompt[exc.start])
            what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
            raise ValueError(
                f"prompt {i} (--prompt) is not UTF-8 text: {what} at character {exc.start + 1}; pass prompts as "
                "UTF-8 (is the terminal's encoding, LANG / LC_ALL, UTF-8?)"
            ) from None


def default_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """Offline math prompts (the synthetic set's arithmetic and word problems, boxed-answer instruction)."""
    from ..extras.math.data import BOXED_INSTRUCTION, synthetic_math_dataset

    data = synthetic_math_dataset(num_prompts, seed=seed, difficulty=2, instruction=BOXED_INSTRUCTION)
    return list(data["prompt"])


def _encode_prompts(tokenizer, prompts: list[str], use_chat_template: bool) -> list[list[int]]:
    if use_chat_template:
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for p in prompts
        ]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def _padded(rows: list[list[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and their attention mask padded as TRL's trainer pads them (``trl.trainer.utils.pad``)."""
    tensors = [torch.tensor(r, dtype=torch.long) for r in rows]
    ids = pad(tensors, padding_value=pad_id, padding_side=side)
    mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side=side)
    return ids, mask


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.insert(0, tokenizer.eos_token_id)
    return ids


@dataclass
class EngineSamples:
    """What an engine sampled, one entry per completion (prompt-major, ``num_generations`` per prompt)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # up to and including the first EOS, as TRL keeps them
    sampling_logprobs: list[list[float]]  # of the sampled tokens, log_softmax(logits / T); NaN where none came
    routes: list  # per completion, vLLM's [p + c - 1, L, K] rows (array or tensor), or None: no routes
    notes: list[str] = field(default_factory=list)


@torch.no_grad()
def run_audit(
    model: str,
    prompts: list[str] | None = None,
    *,
    num_prompts: int = 8,
    num_generations: int = 2,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    engine_dtype: str = "bfloat16",
    trainer_dtype: str = "auto",
    use_chat_template: bool | None = None,
    extreme_threshold: float = 2.0,
    seed: int = 0,
    device: str | None = None,
    trust_remote_code: bool = False,
    vllm_server_url: str | None = None,
    vllm_timeout: float | None = 300.0,
) -> AuditReport:
    """Sample with the engine, score with the trainer with and without R3, and compare (see module docstring).

    With ``vllm_server_url`` the engine is that vLLM server (``engine_dtype`` is then the server's own); it must
    serve the same checkpoint as ``model``. No weights are sent to it. Talking to it (health check, model list,
    generation) must finish within ``vllm_timeout`` seconds (None or 0: wait as long as it takes), else
    ``TimeoutError``: a server that accepts connections but never answers would otherwise block forever.
    """
    for name in (engine_dtype, trainer_dtype):
        if name not in DTYPES and not (name is trainer_dtype and name == AUTO):
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    for name, value in (
        ("num_generations", num_generations),
        ("max_new_tokens", max_new_tokens),
        ("num_prompts", num_prompts),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} (--{name}) must be an int >= 1, got {value!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(
            f"temperature (--temperature) must be a finite number > 0 (1.0 samples the model as it is), "
            f"got {temperature!r}"
        )
    check_extreme_threshold(extreme_threshold, "extreme_threshold (--extreme_threshold)")
    if prompts is not None:
        check_prompts(prompts)
    if vllm_timeout is not None and (
        isinstance(vllm_timeout, bool)
        or not isinstance(vllm_timeout, (int, float))
        or not math.isfinite(vllm_timeout)
        or vllm_timeout < 0
    ):
        raise ValueError(
            f"vllm_timeout (--vllm_timeout) must be a number of seconds >= 0 (0: no limit), got {vllm_timeout!r}"
        )
    run_device = resolve_device(device)
    dtype_note: str | None = None
    if trainer_dtype == AUTO:
        trainer_dtype, dtype_note = fitting_trainer_dtype(
            model, run_device, engine_dtype, engine_copy=vllm_server_url is None
        )
    trainer_model, tokenizer = load_model_and_tokenizer(
        model, DTYPES[trainer_dtype], trust_remote_code=trust_remote_code
    )
    trainer_model.to(run_device).eval()
    if prompts is None:
        prompts = default_prompts(num_prompts, seed=seed)
    if not prompts:
        raise ValueError("the audit needs at least one prompt")
    if use_chat_template is None:
        use_chat_template = getattr(tokenizer, "chat_template", None) is not None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError(f"the tokenizer of {model} has neither a pad nor an eos token")
    encoded = _encode_prompts(tokenizer, prompts, use_chat_template)

    # ---- engine: sample, with routes and sampling log-probs
    server_cmd = None
    if vllm_server_url is not None:
        from ..rollouts.vllm_routes import server_command

        server_cmd = server_command(model)
        samples, engine_dtype = _within(
            vllm_timeout,
            lambda: _sample_with_vllm_server(
                vllm_server_url,
                model,
                encoded,
                num_generations=num_generations,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=seed,
            ),
            f"the vLLM server at {vllm_server_url} did not answer within {vllm_timeout:g} s (--vllm_timeout). Is it "
            f"still loading the model, stuck, or unreachable? Check `curl {vllm_server_url}/health`, or raise "
            "--vllm_timeout for long generations.",
        )
    else:
        samples = _sample_with_transformers(
            trainer_model,
            tokenizer,
            encoded,
            engine_dtype=engine_dtype,
            trainer_dtype=trainer_dtype,
            num_generations=num_generations,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            pad_id=pad_id,
            device=run_device,
        )
    _check_samples(samples, len(encoded) * num_generations)
    routes_available = any(rows is not None for rows in samples.routes)
    notes = list(samples.notes) + ([dtype_note] if dtype_note else [])
    missing = sum(rows is None for rows in samples.routes)
    if routes_available and missing:
        notes.append(
            f"{missing} of {len(samples.routes)} completions came without routes: their positions are "
            "routed by the trainer's own router under r3 (counted in fallback)"
        )

    # ---- trainer: TRL's batch layout, one forward per mode
    trainer_rr = RouterReplay(trainer_model)  # after the engine's: with equal dtypes it is the same model
    prompt_ids, prompt_mask = _padded(samples.prompt_ids, pad_id, "left")
    completion_ids, completion_mask = _padded(samples.completion_ids, pad_id, "right")
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    prompt_lengths = [len(r) for r in samples.prompt_ids]
    completion_lengths = [len(r) for r in samples.completion_ids]
    # the trainer's one entry point for engine routes: a malformed sample falls back (counted), none fitting stops
    intake = RouteIntake(
        None,
        source="the engine",
        required=routes_available,
        needed_by="audit",
        remedy="Does the engine serve the same checkpoint as --model?",
    )
    turns = [
        [EngineTurn(rows, p, c)] for rows, p, c in zip(samples.routes, prompt_lengths, completion_lengths, strict=True)
    ]
    try:
        checked_routes = intake.align(
            turns,
            trainer_rr.layout,
            prompt_lengths=prompt_lengths,
            completion_lengths=completion_lengths,
            prompt_width=prompt_ids.shape[1],
            completion_width=completion_ids.shape[1],
        )
    except RoutesUnavailableError as exc:  # a ValueError for the command line: one line, exit status 2
        raise RouteAlignmentError(
            f"the engine's routes do not fit {model} ({trainer_rr.num_layers} decoder layers, MoE layers "
            f"{list(trainer_rr.moe_layers)}, top-{trainer_rr.top_k}, {trainer_rr.num_experts} experts): {exc}"
        ) from None
    engine_routes = checked_routes.tensor()  # for the comparisons; the pass below replays the checked ones
    if intake.fallback_samples > missing:
        notes.append(
            f"{intake.fallback_samples - missing} of {len(samples.routes)} completions came with routes "
            "that do not fit their tokens: routed by the trainer's own router under r3 (counted in fallback)"
        )
    sampling = torch.full(completion_ids.shape, float("nan"))
    for i, row in enumerate(samples.sampling_logprobs):
        sampling[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    positions = routable_positions(attention_mask)

    rows = []
    # the modes the registry marks as audited (none, and those replaying the engine's routes), where routes arrived
    for mode in [m for m in ReplayMode if m.spec.audited and (routes_available or not m.replays)]:
        replayed = checked_routes if mode.replays else None
        trainer_logps, natural = _trainer_pass(
            trainer_model,
            trainer_rr,
            input_ids.to(run_device),
            attention_mask.to(run_device),
            completion_ids.shape[1],
            temperature,
            replayed,
        )
        # routes in force: the router's own (none), or the engine's wherever it gave one (r3)
        used = (
            natural
            if replayed is None
            else torch.where(has_route(engine_routes)[..., None], engine_routes.to(natural.dtype), natural)
        )
        row = _row(
            mode,
            sampling,
            trainer_logps,
            completion_mask,
            used,
            natural,
            engine_routes,
            positions,
            trainer_rr.moe_layers,
            extreme_threshold,
        )
        if not routes_available:  # nothing to compare routes with
            row.route_mismatch_frac = row.topk_agreement = row.natural_mismatch_frac = row.fallback_frac = None
        rows.append(row)
    trainer_rr.remove()
    routed = routing_agreement_sums(engine_routes, engine_routes, positions, trainer_rr.moe_layers)["pairs"]
    return AuditReport(
        model=model,
        engine_dtype=engine_dtype,
        trainer_dtype=trainer_dtype,
        num_prompts=len(prompts),
        num_completions=len(samples.completion_ids),
        completion_tokens=int(completion_mask.sum()),
        routed_pairs=int(routed),
        rows=rows,
        engine="transformers" if vllm_server_url is None else "vllm",
        engine_url=vllm_server_url,
        routes_available=routes_available,
        server_command=server_cmd,
        notes=notes,
    )


def _within(seconds: float | None, fn, timeout_message: str):
    """``fn()``, given at most ``seconds`` (None or 0: no limit); raises ``TimeoutError(timeout_message)`` after that.

    TRL's client sends its health check without a timeout and retries reads, so the limit is enforced from outside:
    ``fn`` runs in a daemon thread, left behind (blocked on its socket) if it never returns.
    """
    if not seconds:
        return fn()
    outcome = {}

    def run():
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="trl-moe-replay-audit-engine", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(timeout_message)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _check_samples(samples: EngineSamples, expected: int) -> None:
    """One prompt, completion, log-prob row and route entry per requested completion, log-probs per token."""
    counts = {
        name: len(getattr(samples, name)) for name in ("prompt_ids", "completion_ids", "sampling_logprobs", "routes")
    }
    if set(counts.values()) != {expected}:
        raise ValueError(f"the engine returned {counts} entries, expected {expected} of each (one per completion)")
    for i, (tokens, logps) in enumerate(zip(samples.completion_ids, samples.sampling_logprobs, strict=True)):
        if len(tokens) != len(logps):
            raise ValueError(f"completion {i}: {len(tokens)} tokens but {len(logps)} sampling log-probs")


def _sample_with_transformers(
    trainer_model,
    tokenizer,
    encoded,
    *,
    engine_dtype,
    trainer_dtype,
    num_generations,
    max_new_tokens,
    temperature,
    seed,
    pad_id,
    device,
) -> EngineSamples:
    """transformers ``generate`` in ``engine_dtype``, recorded like the trainer's own rollouts."""
    # A second copy in the engine's dtype (the engine holds its own weights, as vLLM does); same weights when equal.
    engine_model = (
        trainer_model if engine_dtype == trainer_dtype else copy.deepcopy(trainer_model).to(DTYPES[engine_dtype])
    )
    prompt_rows = [ids for ids in encoded for _ in range(num_generations)]
    engine_rr = RouterReplay(engine_model)
    eos_ids = _eos_ids(engine_model, tokenizer)
    prompt_ids, prompt_mask = _padded(prompt_rows, pad_id, "left")
    # Plain sampling at `temperature`, nothing from the checkpoint's generation_config (top_p, repetition penalty,
    # ...): the recorded log-probs are log_softmax(logits / temperature), as the trainer computes them.
    sampling = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos_ids,
    )
    torch.manual_seed(seed)
    recorder = TransformersRolloutRecorder(engine_rr, engine_model, temperature)
    try:
        with recorder:
            output = engine_model.generate(
                input_ids=prompt_ids.to(device),
                attention_mask=prompt_mask.to(device),
                generation_config=sampling,
            )
        generated = output[:, prompt_ids.shape[1] :].cpu()
        completion_rows = []
        for row in generated.tolist():  # up to and including the first EOS, as TRL keeps it
            end = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
            completion_rows.append(row[:end])
        recorder.finish_with(completion_rows, pad_token_id=pad_id)
        prompt_lengths = [len(r) for r in prompt_rows]
        completion_lengths = [len(r) for r in completion_rows]
        engine_rows = recorder.engine_rows(prompt_lengths, completion_lengths)
        sampling_rows = recorder.sampling_logprobs(completion_lengths)
    finally:
        engine_rr.remove()
    return EngineSamples(prompt_rows, completion_rows, sampling_rows, engine_rows)


def _sample_with_vllm_server(
    url, model, encoded, *, num_generations, max_new_tokens, temperature, seed
) -> tuple[EngineSamples, str]:
    """Sample through TRL's ``VLLMClient`` (keeping the routes); returns the samples and the server's dtype.

    Sampling is plain (no top-p/top-k/min-p/repetition penalty) at ``temperature``, token-id prompts, ``n`` per
    prompt, and ``logprobs=0`` as TRL's trainer requests them: the sampled token's log-prob comes first in each
    position's list. No communicator is opened (no weight sync).
    """
    from ..rollouts.route_stream import install_routes_hook
    from ..upstream import http_vllm_client

    client = http_vllm_client(url)
    routes_hook = install_routes_hook(client)
    notes = []
    try:
        server_config = client.get_server_info()
    except Exception as exc:  # /server_info needs VLLM_SERVER_DEV_MODE=1; the audit can do without it
        server_config = {}
        notes.append(f"could not read the server's configuration ({exc}); its logprobs mode is unchecked")
    model_config = server_config.get("model_config") or {}
    logprobs_mode = model_config.get("logprobs_mode")
    if logprobs_mode is not None and logprobs_mode != "processed_logprobs":
        notes.append(
            f"the server runs with --logprobs-mode {logprobs_mode}: its log-probs are not log_softmax(logits / T), "
            "so the kl and extreme columns are biased; `trl vllm-serve` sets processed_logprobs"
        )
    if client.model != model:
        notes.append(f"the server serves {client.model!r} and --model is {model!r}: they must be the same checkpoint")
    routes_hook.start()
    output = client.generate(
        encoded,
        n=num_generations,
        repetition_penalty=1.0,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=max_new_tokens,
        logprobs=0,
        generation_kwargs={"seed": seed},
    )
    payloads = routes_hook.take() or []
    completions = output["completion_ids"]
    if len(output["prompt_ids"]) != len(encoded) or len(completions) != len(encoded) * num_generations:
        raise ValueError(
            f"the vLLM server returned {len(output['prompt_ids'])} prompts and {len(completions)} completions for "
            f"{len(encoded)} prompts x {num_generations} generations"
        )
    for i, (sent, got) in enumerate(zip(encoded, output["prompt_ids"], strict=True)):
        if list(sent) != list(got):
            raise ValueError(f"prompt {i}: the vLLM server echoed other prompt token ids than were sent")
    prompt_rows = [list(ids) for ids in output["prompt_ids"] for _ in range(num_generations)]
    if output["logprobs"] is None:
        raise ValueError("the vLLM server returned no log-probs although logprobs=0 was requested")
    sampling_rows = [  # first entry of each position: the sampled token's (None where vLLM sent NaN)
        [math.nan if lp[0] is None else float(lp[0]) for lp in seq] for seq in output["logprobs"]
    ]
    routes: list = payloads  # decoded arrays, payloads that did not decode (the intake reports them), None
    if len(routes) != len(completions):
        raise ValueError(
            f"the vLLM server returned routed_experts for {len(routes)} of {len(completions)} completions"
        )
    dtype = str(model_config.get("dtype") or "unknown").removeprefix("torch.")
    return EngineSamples(prompt_rows, [list(c) for c in completions], sampling_rows, routes, notes), dtype


def _trainer_pass(model, rr, input_ids, attention_mask, completion_width, temperature, routes):
    """Completion-token log-probs ``[B, C]`` (float32, CPU) and the router's natural routes of this forward."""
    with contextlib.ExitStack() as stack:  # replay outside, record inside: as the trainer's old-logprob pass
        if routes is not None:
            stack.enter_context(rr.replay(routes))
        recording = stack.enter_context(rr.record())
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, -completion_width - 1 : -1].float() / temperature
    targets = input_ids[:, -completion_width:]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logps.cpu(), recording.routes.cpu()


def _row(
    mode, sampling, trainer_logps, completion_mask, used, natural, engine_routes, positions, moe_layers, threshold
) -> AuditRow:
    sums = logprob_mismatch_sums(sampling, trainer_logps, completion_mask, threshold)
    tokens = sums["tokens"].clamp(min=1.0)
    valid = completion_mask.bool() & ~torch.isnan(sampling)
    log_ratio = torch.where(valid, trainer_logps - sampling, 0.0)
    agreement = routing_agreement_sums(used, engine_routes, positions, moe_layers)
    natural_agreement = routing_agreement_sums(natural, engine_routes, positions, moe_layers)
    pairs = agreement["pairs"].clamp(min=1.0)
    return AuditRow(
        mode=mode,
        kl_k1=(sums["kl_k1"] / tokens).item(),
        kl_k3=(sums["kl_k3"] / tokens).item(),
        extreme_frac=(sums["extreme"] / tokens).item(),
        max_abs_log_ratio=log_ratio.abs().max().item() if valid.any() else 0.0,
        route_mismatch_frac=(agreement["mismatch_pairs"] / pairs).item(),
        topk_agreement=(agreement["overlap"] / pairs).item(),
        natural_mismatch_frac=(natural_agreement["mismatch_pairs"] / natural_agreement["pairs"].clamp(min=1.0)).item(),
        fallback_frac=(agreement["fallback_positions"] / agreement["positions"].clamp(min=1.0)).item(),
    )
