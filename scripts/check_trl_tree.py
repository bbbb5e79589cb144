"""Early warning for a TRL release or development branch: run the seam check and the golden tests against it.

    python scripts/check_trl_tree.py PATH [--pytest-args ...]

PATH is a TRL source tree (a directory holding the ``trl`` package: a git checkout or an unpacked wheel) or a bare
git repository (its HEAD is exported first). The installed TRL is left alone: the tree is put first on PYTHONPATH
for two child processes, one running ``trl_moe_replay.upstream.check_upstream()`` (every entry, with the versions it
was verified on) and one running the golden drop-in tests (tests/cross_cutting/test_golden_trl.py) and tests/upstream/test_entries.py.
Exit status 0 only if both pass. A TRL whose dependencies moved beyond this environment's can fail at import: that
is reported as it comes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
CHECK = (
    "import trl; from trl_moe_replay import upstream\n"
    "print(f'TRL from {trl.__file__} (its __version__ says {trl.__version__}; a source tree may report the installed one)')\n"
    "findings = upstream.check_upstream()\n"
    "print('\\n'.join(map(str, findings)) or 'check_upstream: no findings')\n"
    "raise SystemExit(1 if findings else 0)\n"
)


def trl_tree(path: Path, workdir: Path) -> Path:
    if (path / "trl" / "__init__.py").exists():
        return path
    if (path / "HEAD").exists() and (path / "objects").is_dir():  # a bare git repository: export its HEAD
        archive = subprocess.run(
            ["git", "--git-dir", str(path), "archive", "HEAD", "trl"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive, check=True)
        commit = subprocess.run(
            ["git", "--git-dir", str(path), "rev-parse", "HEAD"], check=True, text=True, capture_output=True
        ).stdout.strip()
        version = subprocess.run(
            ["git", "--git-dir", str(path), "show", "HEAD:VERSION"], text=True, capture_output=True
        ).stdout.strip()
        print(f"exported {path} at {commit} (VERSION {version or 'not recorded'})")
        return workdir
    raise SystemExit(f"{path} holds neither a trl/ package nor a bare git repository")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        tree = trl_tree(args.path.resolve(), Path(workdir))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO), os.environ.get("PYTHONPATH", "")])}
        seam = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=REPO).returncode
        tests = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "tests/cross_cutting/test_golden_trl.py",
                "tests/upstream/test_entries.py",
                *args.pytest_args,
            ],
            env=env,
            cwd=REPO,
        ).returncode
    print(f"seam check: {'ok' if seam == 0 else 'FAILED'}; golden + seam tests: {'ok' if tests == 0 else 'FAILED'}")
    return 0 if seam == 0 and tests == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
