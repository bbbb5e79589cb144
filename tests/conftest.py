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


# ----------------------------------------------------------------------------- a real vLLM CPU server
# One pair for the real-engine modules (tests/cross_cutting/test_vllm_engine.py, tests/cross_cutting/test_async_engine.py). Module-scoped: each
# module starts its own server, as before (the async faults kill and restart theirs); a module with its own
# ``checkpoint`` fixture (tests/async_grpo/test_async_grpo_trainer.py) overrides these.
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Qwen3-MoE (and tokenizer) the real-engine tests serve: tests/scripts/vllm_train.py's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from vllm_train import checkpoint as save_checkpoint

    return save_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("vllm_ckpt")))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """A real vLLM CPU server on ``checkpoint`` (tests/vllm_server.py); its URL, ``.pid``, ``.server.restart()``."""
    from tests.vllm_server import vllm_server

    with vllm_server(checkpoint, tmp_path_factory.mktemp("vllm_server") / "server.log") as url:
        yield url
