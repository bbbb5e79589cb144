import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Waiting OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning threads steal the cores the
# working ones need (a tiny-MoE forward+backward measured 17 s spinning vs 0.2 s passive). Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
