"""The package layout (docs/architecture.md): imports point one way, and the entry points name modules that exist."""

import ast
import functools
import importlib
import inspect
import textwrap
import tomllib
from pathlib import Path

import trl_moe_replay


ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trl_moe_replay"

# What each part of the package may import from the others (docs/architecture.md, "Dependency direction").
MAY_IMPORT = {
    "routing": {"upstream", "errors"},  # only its TRL-free parts (TRL_FREE_SEAM)
    "upstream": {"errors"},
    "errors": set(),
    "bounded_json": {"errors"},
    "extras": {"upstream", "errors"},  # TRL's tool-response parser, through the seam
    "rollouts": {"routing", "upstream", "errors"},
    "weight_sync": {"upstream", "errors"},
    "parallel": {"upstream", "errors"},
    "checkpointing": {"parallel", "upstream", "bounded_json", "errors"},
    # what both trainers share; it imports neither trainer
    "core": {"checkpointing", "rollouts", "weight_sync", "routing", "upstream", "bounded_json", "errors"},
    # PR2 beside the sync trainer (its config fields, predictor, state, trainer mixin); only trainer and cli import it
    "pr2": {"core", "parallel", "routing", "upstream", "errors"},
    "trainer": {
        "pr2",
        "core",
        "checkpointing",
        "rollouts",
        "weight_sync",
        "parallel",
        "routing",
        "upstream",
        "bounded_json",
        "errors",
    },
    "async_grpo": {"core", "checkpointing", "rollouts", "weight_sync", "parallel", "routing", "upstream", "errors"},
    "testing": {"rollouts", "routing", "upstream", "errors"},
    "cli": {
        "async_grpo",
        "checkpointing",
        "core",
        "rollouts",
        "extras",
        "parallel",
        "pr2",
        "routing",
        "testing",
        "trainer",
        "upstream",
        "bounded_json",
        "errors",
    },
    "__init__": {"async_grpo", "checkpointing", "core", "rollouts", "errors", "routing", "trainer"},
}


def part_of(module: str) -> str:
    """``trl_moe_replay.pr2.state`` -> ``pr2``; the package itself -> ``__init__``."""
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
        source = (
            "__init__"
            if path == PACKAGE / "__init__.py"
            else part_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        )
        assert source in MAY_IMPORT, f"{path}: a new part of the package; add it to MAY_IMPORT and the docs"
        for target in imported_modules(path):
            if part_of(target) not in MAY_IMPORT[source] | {source}:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "\n".join(wrong)


# The parts of the seam the routing package may use: they (and the seam's index) import no TRL.
TRL_FREE_SEAM = {"__init__", "entries", "torch_seam", "transformers_seam"}


def test_routing_does_not_import_trl():
    seam = [PACKAGE / "upstream" / f"{name}.py" for name in TRL_FREE_SEAM]
    for path in [*(PACKAGE / "routing").rglob("*.py"), *seam]:
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
        assert not [n for n in names if n == "trl" or n.startswith("trl.")], path
        if path.parent.name == "routing":
            used = {
                target.removeprefix("trl_moe_replay.upstream").lstrip(".") or "__init__"
                for target in imported_modules(path)
                if part_of(target) == "upstream"
            }
            assert used <= TRL_FREE_SEAM, f"{path} imports the seam's TRL parts {used - TRL_FREE_SEAM}"
        elif path.name == "__init__.py":  # the index names the TRL parts for type checkers only, and loads them lazily
            type_checking = {
                id(node)
                for branch in tree.body
                if isinstance(branch, ast.If) and ast.unparse(branch.test) == "TYPE_CHECKING"
                for node in ast.walk(branch)
            }
            eager = [
                n.module
                for n in tree.body
                if isinstance(n, ast.ImportFrom)
                and n.level
                and id(n) not in type_checking
                and n.module not in TRL_FREE_SEAM
            ]
            assert not eager, f"upstream/__init__.py imports the TRL parts {eager} eagerly"


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


# ---------------------------------------------------------------------------------------------------------------
# No private upstream name outside the seam (trl_moe_replay/upstream/).
# ---------------------------------------------------------------------------------------------------------------
UPSTREAM_LIBRARIES = ("torch", "trl", "transformers", "accelerate", "vllm", "peft")
SEAM = PACKAGE / "upstream"
# Allowances for a private name on its way out (the test fails once an allowance here is no longer used). Empty: the
# routes' "checked" registry on torch's version counter is gone (routes as data, core/route_flow.py).
PENDING_REMOVAL: set[tuple[str, str]] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@functools.cache
def _package_trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _our_private_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Private names the package defines: functions, classes, module and local names, and ``self._x`` / ``cls._x``
    attributes it assigns (an assignment to another object's attribute defines nothing)."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return {name for name in names if _private(name)}


@functools.cache
def _upstream_private_names(cls: type) -> frozenset[str]:
    """Private names of the upstream classes in ``cls``'s MRO: class attributes and ``self._x`` their code uses."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] not in UPSTREAM_LIBRARIES:
            continue
        names |= {name for name in vars(base) if _private(name)}
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            continue
        names |= {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and _private(node.attr)
        }
    return frozenset(names)


def _module_namespace(path: Path) -> dict:
    return vars(importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts)))


def private_upstream_uses(extra: tuple[str, str] | None = None) -> list[tuple[str, str, int]]:
    """``(file, name, line)`` of every private upstream name the package (and ``extra``, a ``(label, source)`` the
    test adds) uses outside the seam without a seam entry declaring it: an underscore import from an upstream library;
    ``obj._name`` (or ``getattr(obj, "_name")``) where the package defines no ``_name``; and, in a subclass of an
    upstream class, ``self._name``, ``super()._name`` or an override ``def _name`` of a private name of the upstream
    class that no seam entry declares (``Entry.inherited``)."""
    from trl_moe_replay.upstream import all_entries

    declared = {name for entry in all_entries().values() for name in entry.inherited}
    trees = _package_trees()
    ours = _our_private_names(trees)
    sources = [
        (str(path.relative_to(PACKAGE)), tree, lambda path=path: _module_namespace(path))
        for path, tree in trees.items()
        if SEAM not in path.parents
    ]
    if extra is not None:
        namespace: dict = {}
        exec(compile(extra[1], extra[0], "exec"), namespace)
        sources.append((extra[0], ast.parse(extra[1]), lambda: namespace))
    found = []
    for where, tree, namespace_of in sources:
        classes = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                cls = namespace_of().get(node.name)  # None for a class defined inside a function
                upstream = _upstream_private_names(cls) if isinstance(cls, type) else set()
                for inner in ast.walk(node):
                    classes[id(inner)] = upstream
                found += [
                    (where, method.name, method.lineno)
                    for method in node.body
                    if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef)
                    and method.name in upstream - declared
                ]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                parts = node.module.split(".")
                if parts[0] in UPSTREAM_LIBRARIES:
                    found += [
                        (where, name, node.lineno)
                        for name in [*parts, *(a.name for a in node.names)]
                        if _private(name)
                    ]
            elif isinstance(node, ast.Import):
                found += [
                    (where, alias.name, node.lineno)
                    for alias in node.names
                    if alias.name.split(".")[0] in UPSTREAM_LIBRARIES and any(map(_private, alias.name.split(".")))
                ]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = ast.unparse(node.value)
                if owner in ("self", "cls", "super()"):
                    if node.attr in classes.get(id(node), set()) - declared:
                        found.append((where, node.attr, node.lineno))
                elif node.attr not in ours:
                    found.append((where, node.attr, node.lineno))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
                and node.args[1].value not in ours
            ):
                found.append((where, node.args[1].value, node.lineno))
    return found


def test_no_private_upstream_name_is_used_outside_the_seam():
    found = private_upstream_uses()
    leaks = sorted({f"{where}:{line}: {name}" for where, name, line in found if (where, name) not in PENDING_REMOVAL})
    assert not leaks, (
        "private upstream names used outside trl_moe_replay/upstream/ (add a seam entry and a function "
        "there, or declare an inherited name in its entry):\n" + "\n".join(leaks)
    )
    unused = PENDING_REMOVAL - {(where, name) for where, name, _ in found}
    assert not unused, f"delete these allowances from PENDING_REMOVAL, their use is gone: {sorted(unused)}"


# The fake vLLM server of trl_moe_replay.testing patches TRL's client and generation modules themselves (a test
# harness, not the trainer's path): the one place outside the seam that imports a TRL module other than ``trl``.
TRL_MODULE_IMPORTS_ALLOWED = {("testing/fake_vllm.py", "trl.generation")}


def trl_imports_outside_the_seam(trees: dict[Path, ast.Module]) -> set[tuple[str, str]]:
    """``(file, module)`` of every import of TRL from a module other than ``trl`` itself (``from trl.x import y``,
    ``import trl.x``), lazy ones included, outside the seam."""
    found = set()
    for path, tree in trees.items():
        if SEAM in path.parents:
            continue
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            found |= {(where, module) for module in modules if module.startswith("trl.")}
    return found


def test_trl_is_imported_from_its_top_level_or_through_the_seam():
    found = trl_imports_outside_the_seam(_package_trees())
    leaks = sorted(found - TRL_MODULE_IMPORTS_ALLOWED)
    assert not leaks, (
        "TRL imported from modules `trl` does not export, outside trl_moe_replay/upstream/ (add the "
        f"name to a seam entry and import it from there): {leaks}"
    )
    assert TRL_MODULE_IMPORTS_ALLOWED <= found, f"allowances no longer used: {TRL_MODULE_IMPORTS_ALLOWED - found}"
    leaky = ast.parse(
        "import trl.foo\nfrom trl import GRPOTrainer\n\n\ndef f():\n    from trl.trainer.utils import pad\n"
    )
    assert trl_imports_outside_the_seam({PACKAGE / "leaky.py": leaky}) == {
        ("leaky.py", "trl.foo"),
        ("leaky.py", "trl.trainer.utils"),
    }


def test_the_scan_sees_each_kind_of_leak():
    """The scan above catches each way of reaching a private upstream name outside the seam."""
    leaky = (
        "import torch\n"
        "from torch._C import _get_tracing_state\n"
        "from trl import GRPOTrainer\n\n\n"
        "def f(model, trainer):\n"
        "    getattr(model, '_hf_hook', None)\n"
        "    return torch._C._current_graph_task_id(), model._parameters\n\n\n"
        "class Leaky(GRPOTrainer):\n"
        "    def _calculate_rewards(self, *args):\n"
        "        return self._get_output_dir(None), super()._calculate_rewards(*args), self._metrics\n"
    )
    found = {(name, line) for where, name, line in private_upstream_uses(("leaky.py", leaky)) if where == "leaky.py"}
    assert found == {
        ("_C", 2),
        ("_get_tracing_state", 2),
        ("_hf_hook", 7),
        ("_C", 8),
        ("_current_graph_task_id", 8),
        ("_parameters", 8),
        ("_calculate_rewards", 12),
        ("_get_output_dir", 13),
        ("_calculate_rewards", 13),
    }, found  # _metrics: declared by an entry
