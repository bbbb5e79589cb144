"""Small helpers shared by the tests."""

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from trl_moe_replay.testing import TINY_VOCAB_SIZE


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(6, TINY_VOCAB_SIZE, (batch, seq), generator=generator)


def shifted(routes: torch.Tensor, num_experts: int, by: int = 1) -> torch.Tensor:
    """Every route moved to other experts (keeps "no route" rows and keeps each row a set of distinct ids)."""
    from trl_moe_replay.routing import has_route

    return torch.where(has_route(routes)[..., None], ((routes.long() + by) % num_experts).to(routes.dtype), routes)


def experts_module(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    """The routed-experts module (3-D expert parameters) of a decoder layer."""
    for name, module in model.named_modules():
        if f"layers.{layer}." in name + "." and name.endswith(".experts") and ".shared" not in name:
            return module
    raise LookupError(f"no experts module in layer {layer}")


# The multi-process tests are CPU tests (gloo, two ranks on one machine): on a machine with a GPU both ranks would
# otherwise take cuda:0 (NCCL refuses two ranks on one device) and DeepSpeed would pick its CUDA accelerator.
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}


def run_two_ranks(script, *args: str, cwd=None) -> subprocess.CompletedProcess:
    """Run ``script`` as two CPU data-parallel processes (gloo) and return the finished process; fails the test on a
    non-zero exit. torchrun, not `accelerate launch --cpu --num_processes 2`: without MPI that starts one process."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **CPU_ONLY_ENV,
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        *map(str, args),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@contextlib.contextmanager
def silent_server(lifetime_s: float = 60.0):
    """A TCP server on 127.0.0.1 that accepts connections and never answers; yields its ``http://`` URL.

    Bounded: it closes each connection ``lifetime_s`` after accepting it (and all of them when the context exits), so
    a client still waiting on it gets an error instead of hanging. Counted per connection, so a slow test (a loaded
    machine) still finds the server listening and silent.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    stop = threading.Event()
    held = []  # (connection, when to close it)

    def accept_and_hold():
        while not stop.is_set():
            now = time.monotonic()
            for connection, close_at in [entry for entry in held if entry[1] <= now]:
                connection.close()
                held.remove((connection, close_at))
            try:
                held.append((listener.accept()[0], time.monotonic() + lifetime_s))
            except OSError:  # accept timed out: look at the stop flag and the lifetimes again
                continue
        for connection, _ in held:
            connection.close()
        listener.close()

    thread = threading.Thread(target=accept_and_hold, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)


def no_route(routes: torch.Tensor) -> torch.Tensor:
    """Per entry: whether the row holds "no route" (-1 in signed routes, a row of 255s in one-byte routes)."""
    from trl_moe_replay.routing import has_route

    return (~has_route(routes))[..., None].expand_as(routes)


def as_signed(routes: torch.Tensor) -> torch.Tensor:
    """Routes of any compact dtype as int64 with -1 for "no route" (to compare them with hand-built ones)."""
    from trl_moe_replay.routing import has_route

    return torch.where(has_route(routes)[..., None], routes.long(), -1)


def load_script(path, name: str):
    """Import a script that is not in a package (a recipe or an example) as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_routes(trainer, batch: dict) -> dict:
    """``batch`` plus ``replay_routes``: a copy of the routes its forwards replay, taken now (the trainer holds a
    generation batch's routes while it is the current one; the batch dict itself carries only their ``route_rows``),
    and the per-sample inputs held with them (RSPO's ``old_router_ids``/``old_router_probs``)."""
    routes = trainer.replayed_routes(batch)
    extra = {} if routes is None else {"replay_routes": routes}
    if batch.get("route_rows") is not None and trainer._routes is not None:
        extra.update(trainer._routes.buffer.gather_held(batch["route_rows"]).per_sample)
    return dict(batch, **extra) if extra else batch


def module_hooks(model: torch.nn.Module) -> dict[tuple[str, str, str], int]:
    """Every forward hook and pre-hook on ``model``'s modules, counted by (module name, kind, the module that defined
    the hook: ``trl_moe_replay.routing.replay``, ``transformers.modeling_utils``, ...)."""
    counts: dict[tuple[str, str, str], int] = {}
    for name, module in model.named_modules():
        for kind, hooks in (("forward", module._forward_hooks), ("pre", module._forward_pre_hooks)):
            for hook in hooks.values():
                owner = getattr(hook, "__module__", None) or type(hook).__module__
                key = (name, kind, owner)
                counts[key] = counts.get(key, 0) + 1
    return counts


def hooks_of_ours(model: torch.nn.Module) -> int:
    """How many forward hooks and pre-hooks on ``model`` this package defined."""
    return sum(count for (_, _, owner), count in module_hooks(model).items() if owner.startswith("trl_moe_replay"))


def ci_params(values, in_ci) -> list:
    """``values`` as pytest parameters, those in ``in_ci`` marked ``ci`` (the slow tests `make test` runs)."""
    return [pytest.param(value, marks=pytest.mark.ci) if value in in_ci else value for value in values]
