"""The package layout (docs/architecture.md): imports point one way, and the entry points name modules that exist."""

import ast
import importlib
import tomllib
from pathlib import Path

import trl_moe_replay

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_moe_replay"

# What each part of the package may import from the others (docs/architecture.md, "Dependency direction").
MAY_IMPORT = {
    "routing": set(),
    "upstream": set(),
    "extras": set(),
    "engines": {"routing", "upstream"},
    "trainer": {"engines", "routing", "upstream"},
    "async_grpo": {"engines", "routing", "trainer", "upstream"},
    "testing": {"engines", "routing"},
    "cli": {"async_grpo", "engines", "extras", "routing", "testing", "trainer", "upstream"},
    "__init__": {"async_grpo", "engines", "routing", "trainer"},
}


def part_of(module: str) -> str:
    """``trl_moe_replay.trainer.pr2`` -> ``trainer``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path: Path) -> list[str]:
    """Absolute names of the ``trl_moe_replay`` modules that ``path`` imports (anywhere in it, lazy imports too)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            found.append(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.ImportFrom):
            found.append(node.module or "")
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return [name for name in found if name == "trl_moe_replay" or name.startswith("trl_moe_replay.")]


def test_imports_inside_the_package_point_one_way():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30
    wrong = []
    for path in files:
        source = "__init__" if path == PACKAGE / "__init__.py" else part_of(
            ".".join(path.relative_to(ROOT).with_suffix("").parts))
        assert source in MAY_IMPORT, f"{path}: a new part of the package; add it to MAY_IMPORT and the docs"
        for target in imported_modules(path):
            if part_of(target) not in MAY_IMPORT[source] | {source}:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_routing_does_not_import_trl():
    for path in (PACKAGE / "routing").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
        assert not [n for n in names if n == "trl" or n.startswith("trl.")], path


def test_entry_points_and_public_names_resolve():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = list(project["scripts"].values())
    targets += [t for group in project["entry-points"].values() for t in group.values()]
    assert "trl_moe_replay.cli:main" in targets
    for target in targets:
        module, attribute = target.split(":")
        assert callable(getattr(importlib.import_module(module), attribute)), target
    public = set(trl_moe_replay.__all__)
    assert {"MoEReplayGRPOConfig", "MoEReplayGRPOTrainer", "RouterReplay", "__version__"} <= public
    for name in trl_moe_replay.__all__:
        assert getattr(trl_moe_replay, name) is not None
    testing = importlib.import_module("trl_moe_replay.testing")
    for name in testing.__all__:
        assert getattr(testing, name) is not None, name


def test_no_two_modules_import_each_other():
    """No import circle between two modules (lazy imports inside functions count too): one module of the pair
    should hold what both need (``routing/repeated_ids.py`` for ``routes.py`` and ``engine.py``)."""
    imports = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":  # a package's __init__ re-exports its modules
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        package = module.rsplit(".", 1)[0]
        found = set(imported_modules(path))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level and not node.module:  # from . import name
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                found.update(f"{base}.{alias.name}" for alias in node.names)
        imports[module] = found
    circles = sorted(f"{a} <-> {b}" for a in imports for b in imports[a] if a < b and a in imports.get(b, ()))
    assert not circles, circles
