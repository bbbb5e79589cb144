"""The cached cold-start SFT: it teaches the boxed format, label noise lowers accuracy, the cache is reused only where
the result would be the same (settings, thread count, CPU, versions)."""

import json
from pathlib import Path

import pytest

from trl_moe_replay.extras.math.cold_start import ColdStartConfig, cached_cold_start, cold_start_sft, settings_key
from trl_moe_replay.extras.math.data import synthetic_math_dataset
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer


@pytest.fixture(scope="module")
def data():
    return synthetic_math_dataset(400, seed=0, kinds=("arithmetic",))


def trained(data, **settings):
    model, tokenizer = tiny_moe_model("qwen3_moe", seed=0), tiny_tokenizer()
    report = cold_start_sft(model, tokenizer, data, ColdStartConfig(eval_samples=64, **settings), log=lambda _: None)
    return model, tokenizer, report


@pytest.mark.slow  # trains for hundreds of steps
def test_cold_start_teaches_the_task_and_noise_caps_accuracy(data):
    _, _, untrained = trained(data, steps=0)
    _, _, clean = trained(data, steps=250)
    _, _, noisy = trained(data, steps=250, label_noise=0.9)
    assert untrained["sampled_accuracy"] < 0.05
    assert clean["sampled_accuracy"] > 0.5  # single-digit addition: learned in a few hundred tiny steps
    assert noisy["sampled_accuracy"] < clean["sampled_accuracy"] - 0.2  # 90% near misses in the demonstrations


def test_cache_builds_once_per_settings(tmp_path, data):
    calls = []

    def build():
        calls.append(1)
        return trained(data, steps=5)

    settings = {"a": 1, "data": settings_key({"prompt": data["prompt"]})}
    folder, record = cached_cold_start(tmp_path, settings, build, log=lambda _: None)
    again, record_again = cached_cold_start(tmp_path, settings, build, log=lambda _: None)
    other, _ = cached_cold_start(tmp_path, {**settings, "a": 2}, build, log=lambda _: None)
    assert len(calls) == 2 and folder == again and other != folder
    assert record == record_again == json.loads((folder / "cold_start.json").read_text())
    assert (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
    assert not list(tmp_path.glob("*.partial-*"))  # written under a temporary name, then renamed


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="label_noise"):
        ColdStartConfig(label_noise=1.5)
    with pytest.raises(ValueError, match="answer_template"):
        ColdStartConfig(answer_template="no slot")


def test_the_cache_key_covers_what_changes_the_result(tmp_path, monkeypatch):
    """Another thread count, CPU, torch, transformers, math-verify or cold-start code trains its own entry: float sums
    in another order change an early sample and every weight after it (1 and 2 threads: accuracy 0.29 and 0.30)."""
    import importlib.metadata

    import torch
    import transformers

    from trl_moe_replay.extras.math import cold_start

    settings = {"a": 1}

    def folder():
        return cold_start.cache_folder(tmp_path, settings, cold_start.cold_start_environment())

    base = folder()
    assert base == folder() and base.parent == tmp_path
    threads, real_version = torch.get_num_threads(), importlib.metadata.version
    other_source = tmp_path / "cold_start.py"
    other_source.write_text(Path(cold_start.__file__).read_text() + "\n# edited\n")
    changes = {
        "torch_threads": lambda: monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1),
        "cpu": lambda: monkeypatch.setattr(cold_start, "cpu_model", lambda: "Another CPU (x86_64)"),
        "cpu_capability": lambda: monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "OTHER"),
        "torch": lambda: monkeypatch.setattr(torch, "__version__", "0.0.1"),
        "transformers": lambda: monkeypatch.setattr(transformers, "__version__", "0.0.1"),
        "math_verify": lambda: monkeypatch.setattr(
            importlib.metadata, "version", lambda name: "0.0.1" if name == "math-verify" else real_version(name)
        ),
        "code": lambda: monkeypatch.setattr(cold_start, "__file__", str(other_source)),
    }
    assert set(changes) == set(cold_start.cold_start_environment())
    for name, change in changes.items():
        change()
        assert folder() != base, f"changing {name} keeps the cache key"
        monkeypatch.undo()
        assert folder() == base
    assert cold_start.cpu_model().endswith(")") and "unknown" not in cold_start.cpu_model()
