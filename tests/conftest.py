import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Waiting OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning threads steal the cores the
# working ones need (a tiny-MoE forward+backward measured 17 s spinning vs 0.2 s passive). Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Under pytest-xdist (make test: -n 2) each worker gets its share of the cores, in its own threads and in the processes
# its tests start (unless a test sets OMP_NUM_THREADS itself): two workers of two threads each would put four busy
# threads on a 2-core machine. Without xdist, as before: up to two threads, subprocesses left to their defaults.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
SHARE = max(1, (os.cpu_count() or 1) // WORKERS)
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(SHARE))

import torch  # noqa: E402
import transformers  # noqa: E402


transformers.logging.set_verbosity_error()
torch.set_num_threads(min(2, SHARE))


import pytest  # noqa: E402


# ----------------------------------------------------------------------------- no launch variables left behind
#: What a launcher sets. accelerate writes the first four into os.environ when it builds a CPU-distributed state,
#: past any monkeypatch; left there, every later subprocess of the worker sees a distributed launch and opens a
#: process group on MASTER_PORT, default 29500: the port of the serial tests' two-process launches running beside.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_launch_variables_left_behind():
    saved = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# ----------------------------------------------------------------------------- saved tiny checkpoints
# Two variants, read-only for every test: ``checkpoint``, the default tiny Qwen3-MoE of tiny_moe_model (2 layers,
# head_dim 16), for trainers and stand-in engines in this process; ``vllm_checkpoint``, the variant a real vLLM CPU
# engine runs (its attention needs head_dim >= 32; 3 layers), for the real-engine modules. (A module may still
# define its own ``checkpoint`` for something else, e.g. tests/checkpointing/test_checkpoint_files.py's trainer
# checkpoint folder.)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    """The default tiny Qwen3-MoE and tiny tokenizer, saved once per session."""
    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    path = tmp_path_factory.mktemp("ckpt")
    tiny_moe_model("qwen3_moe").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------- a real vLLM CPU server
# One pair for the real-engine modules. Session-scoped, used by tests/cross_cutting/test_vllm_engine.py, whose tests
# each put the checkpoint's weights back first (reload_weights), since the test before trained others into it.
# test_async_engine.py kills and restarts its server (the faults it tests) and test_expert_parallel.py's server test
# needs an engine that still serves the checkpoint's own weights: each overrides ``server`` with a module-scoped one.


@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory) -> str:
    """The tiny Qwen3-MoE (and tokenizer) the real-engine tests serve: tests/scripts/vllm_train.py's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from vllm_train import checkpoint as save_checkpoint

    return save_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("vllm_ckpt")))


@pytest.fixture(scope="session")
def server(vllm_checkpoint, tmp_path_factory):
    """A real vLLM CPU server on ``vllm_checkpoint`` (tests/vllm_server.py), shared by the session's tests: its URL,
    ``.pid``. Reload the checkpoint's weights (tests.vllm_server.reload_weights) before using it; never stop it."""
    from tests.vllm_server import vllm_server

    with vllm_server(vllm_checkpoint, tmp_path_factory.mktemp("vllm_server") / "server.log") as url:
        yield url


# ----------------------------------------------------------------------------- which slow tests CI runs
def misplaced_ci_marks(items) -> list[str]:
    """The tests marked `ci` that are not `slow`: `ci` picks the slow tests `make test` (CI) runs, so on a fast test
    (which CI runs anyway) it says something untrue."""
    return [item.nodeid for item in items if item.get_closest_marker("ci") and not item.get_closest_marker("slow")]


def pytest_collection_modifyitems(config, items):
    misplaced = misplaced_ci_marks(items)
    if misplaced:
        raise pytest.UsageError(f"marked `ci` but not `slow` (`ci` picks the slow tests CI runs): {misplaced}")
