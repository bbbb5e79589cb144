"""`make setup`'s installs into a CPU environment: PyTorch's CPU build, and nothing that brings CUDA.

    python tools/cpu_install.py torch 2.13.0        # torch's CPU build
    python tools/cpu_install.py -e ".[test]"        # any other pip install: refused if it would bring CUDA

On Linux, PyPI's torch wheel is the CUDA build and pulls ~15 `nvidia-*` packages (gigabytes); the CPU build comes
from PyTorch's own index (:data:`CPU_INDEX`). Each install is first resolved with ``pip install --dry-run --report``:
torch comes from pip's configured sources when they offer a CPU build (a local wheel, as on the machines this project
was built on), else from :data:`CPU_INDEX`; any other install that would bring a CUDA package (an ``nvidia-*``
distribution, a ``+cuXXX`` torch, a torch that requires ``nvidia-*``) is refused with one line before pip installs
anything. Exit status 1 on a refusal. pip runs with ``--quiet``; one line before each step says what is being
installed, since together they take about two minutes on a first run (nothing on later ones).
"""

from __future__ import annotations

import json
import subprocess
import sys


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def plan(*pip_args: str) -> list[dict]:
    """What ``pip install PIP_ARGS`` would install (pip's installation report), installing nothing."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", *pip_args],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        sys.exit(result.stderr.strip() or f"pip could not resolve: {' '.join(pip_args)}")
    return json.loads(result.stdout)["install"]


def cuda_packages(items: list[dict]) -> list[str]:
    """The ``name==version`` of every planned distribution that is CUDA: nvidia-*, a +cu torch, a torch that
    requires nvidia-* packages."""
    found = []
    for item in items:
        metadata = item["metadata"]
        name, version = metadata["name"], metadata["version"]
        requires = metadata.get("requires_dist") or []
        if (
            name.lower().startswith("nvidia-")
            or "+cu" in version
            or (name.lower() == "torch" and any(r.lower().startswith("nvidia-") for r in requires))
        ):
            found.append(f"{name}=={version}")
    return found


def announce(what: str) -> None:
    """One progress line before a step: pip's own output is quiet."""
    print(f"installing {what} (first run only)...", flush=True)


def pip_install(*pip_args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *pip_args], check=True)


def install_torch(version: str) -> None:
    announce(f"torch {version}, the CPU build")
    if not cuda_packages(plan(f"torch=={version}")):
        pip_install(f"torch=={version}")  # a CPU build from pip's own sources (or torch is already in place)
        return
    print(f"torch {version}: pip's sources offer the CUDA build here; installing the CPU build from {CPU_INDEX}")
    pip_install(f"torch=={version}", "--index-url", CPU_INDEX)


def install_refusing_cuda(*pip_args: str) -> None:
    announce(f"{' '.join(pip_args)} and its dependencies")
    cuda = cuda_packages(plan(*pip_args))
    if cuda:
        sys.exit(
            f"refused: `pip install {' '.join(pip_args)}` would bring CUDA packages into this CPU environment "
            f"({', '.join(cuda[:4])}{', ...' if len(cuda) > 4 else ''}); install the CPU build of torch first "
            f"(python tools/cpu_install.py torch VERSION, i.e. pip install torch --index-url {CPU_INDEX})"
        )
    pip_install(*pip_args)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "torch":
        install_torch(sys.argv[2])
    elif len(sys.argv) > 1:
        install_refusing_cuda(*sys.argv[1:])
    else:
        sys.exit(__doc__)
