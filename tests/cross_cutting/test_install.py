"""tools/cpu_install.py (`make setup`): a pip plan that brings CUDA packages is refused in one line, before pip
installs anything; torch comes from PyTorch's CPU index when pip's own sources would give the CUDA build."""

from pathlib import Path

import pytest

from tests.helpers import load_script


cpu_install = load_script(Path(__file__).resolve().parents[2] / "tools" / "cpu_install.py", "cpu_install")


def item(name, version, requires=()):  # one entry of `pip install --report`'s "install" list
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


CPU_PLAN = [item("torch", "2.13.0+cpu", ["filelock", "sympy>=1.13.3"]), item("sympy", "1.14.0")]
CUDA_PLAN = [
    item("torch", "2.14.0", ["nvidia-cublas-cu12==12.8.4.1; platform_system == 'Linux'"]),
    item("nvidia-cublas-cu12", "12.8.4.1"),
    item("triton", "3.5.0"),
]


def test_cuda_packages_in_a_plan():
    assert cpu_install.cuda_packages(CPU_PLAN) == []
    assert cpu_install.cuda_packages(CUDA_PLAN) == ["torch==2.14.0", "nvidia-cublas-cu12==12.8.4.1"]
    assert cpu_install.cuda_packages([item("torch", "2.13.0+cu128")]) == ["torch==2.13.0+cu128"]


def test_an_install_that_would_bring_cuda_is_refused_before_pip_runs(monkeypatch, capsys):
    installed = []
    monkeypatch.setattr(cpu_install, "pip_install", lambda *args: installed.append(args))
    monkeypatch.setattr(cpu_install, "plan", lambda *args: CUDA_PLAN)
    with pytest.raises(SystemExit) as refused:
        cpu_install.install_refusing_cuda("-e", ".[test]")
    message = str(refused.value.code)
    assert capsys.readouterr().out == "installing -e .[test] and its dependencies (first run only)...\n"
    assert "\n" not in message and message.startswith("refused: `pip install -e .[test]` would bring CUDA packages")
    assert "nvidia-cublas-cu12==12.8.4.1" in message and cpu_install.CPU_INDEX in message and installed == []
    monkeypatch.setattr(cpu_install, "plan", lambda *args: CPU_PLAN)
    cpu_install.install_refusing_cuda("-e", ".[test]")
    assert installed == [("-e", ".[test]")]


def test_torch_comes_from_the_cpu_index_when_pips_sources_give_the_cuda_build(monkeypatch, capsys):
    installed = []
    monkeypatch.setattr(cpu_install, "pip_install", lambda *args: installed.append(args))
    monkeypatch.setattr(cpu_install, "plan", lambda *args: CUDA_PLAN)
    cpu_install.install_torch("2.13.0")
    assert installed == [("torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu")]
    # pip runs quietly: one progress line first
    assert capsys.readouterr().out.startswith("installing torch 2.13.0, the CPU build (first run only)...\n")
    monkeypatch.setattr(cpu_install, "plan", lambda *args: CPU_PLAN)  # a local CPU wheel: pip's own sources
    cpu_install.install_torch("2.13.0")
    assert installed[-1] == ("torch==2.13.0",)


def test_the_package_builds_without_setuptools_warnings(monkeypatch):
    """What pip's build step reads (pyproject.toml, through setuptools) warns about nothing a user could act on: the
    license is an SPDX string (a TOML table printed a deprecation notice at every build, 4 per `make demo`)."""
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribution = apply_configuration(Distribution(), root / "pyproject.toml")
    ours = [str(w.message).splitlines()[0] for w in caught if "project" in str(w.message)]
    assert ours == [] and distribution.metadata.license_expression == "Apache-2.0"
