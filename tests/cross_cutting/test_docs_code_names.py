"""docs/architecture.md and docs/maintaining.md against the code: every code name they mention in backticks exists, and
architecture.md names every module of the package (a renamed method or a new module fails here, not in a reader)."""

import importlib
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "architecture.md", ROOT / "docs" / "maintaining.md"]
SPAN = re.compile(r"`([^`\n]+)`")
FENCED = re.compile(r"^```.*?^```", re.M | re.S)
CLASS_MEMBER = re.compile(r"\b([A-Z]\w*\.[a-z_]\w*)\(")  # `RouteBuffer.gather(` in a fenced block
# names the pages mention that are not ours on purpose: upstream's, or named as removed
NOT_OURS = {
    "testing_vllm": "architecture.md lists it among the old top-level modules that are gone",
    "_verify_aux_output_compatibility": "vLLM's (config/vllm.py), read in its wheel at a bump",
    "Optional": "typing's",
}
# a code name: `RouteBuffer.gather`, `check_upstream()`, `TRL_RANGE`, `torch.distributed.checkpoint`
IDENTIFIER = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?$")
# a path of the repository or, relative to it, of the package: `routing/replay.py`, `upstream/`, `tests/helpers.py`
PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*(?:/|\.py|\.txt|\.toml|\.yaml|\.md)$")
# what the names are looked up in: the code and configuration of the repository, the docs excepted
CODE_FILES = [
    path
    for pattern in ("*.py", "Makefile", "*.toml", "*.yaml", "*.txt", "*.cfg")
    for path in ROOT.rglob(pattern)
    if not {".git", ".venv", "docs", "site", "node_modules"} & set(path.relative_to(ROOT).parts)
    and not path.relative_to(ROOT).parts[0].startswith(".venv")
    and path != Path(__file__).resolve()
]


def code_words() -> set[str]:
    words: set[str] = set()
    for path in CODE_FILES:
        words.update(re.findall(r"\w+", path.read_text(errors="replace")))
    return words


def package_classes() -> dict[str, str]:
    """Class name -> the module of the package that defines it (a name defined twice: the first module found)."""
    classes: dict[str, str] = {}
    for path in sorted((ROOT / "trl_moe_replay").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for name in re.findall(r"^class (\w+)", path.read_text(), re.M):
            classes.setdefault(name, module)
    return classes


def mentioned(page: Path) -> tuple[list[str], list[str]]:
    """The backticked identifiers and paths of ``page`` (paths under a folder of ours: not upstream's
    ``integrations/hub_kernels.py``), and the ``Class.member(`` calls of its fenced blocks."""
    text = page.read_text()
    spans = SPAN.findall(FENCED.sub("", text))
    names = [
        span
        for span in spans
        if IDENTIFIER.match(span)
        and span not in NOT_OURS
        and ("_" in span or "." in span or "(" in span or any(c.isupper() for c in span))
    ]
    names += [call for block in FENCED.findall(text) for call in CLASS_MEMBER.findall(block)]
    paths = [
        span
        for span in spans
        if "/" in span
        and PATH.match(span)
        and any((base / span.split("/")[0]).exists() for base in (ROOT, ROOT / "trl_moe_replay"))
    ]
    return names, paths


def missing_names(names: list[str], words: set[str], classes: dict[str, str]) -> list[str]:
    missing = []
    for name in names:
        parts = name.removesuffix("()").split(".")
        if not all(part in words for part in parts):
            missing.append(name)  # a word no code of the repository has
        elif parts[0] in classes and len(parts) > 1:  # a member of one of our classes: the class must have it
            target = getattr(importlib.import_module(classes[parts[0]]), parts[0], None)
            for part in parts[1:]:
                target = getattr(target, part, None)
            if target is None:
                missing.append(name)
    return missing


def missing_paths(paths: list[str]) -> list[str]:
    return [
        path
        for path in paths
        if not any((base / path.rstrip("/")).exists() for base in (ROOT, ROOT / "trl_moe_replay"))
    ]


def test_every_code_name_the_architecture_and_maintaining_pages_mention_exists():
    words, classes = code_words(), package_classes()
    assert {"RouterReplay", "MoEReplayTrainerMixin"} <= set(classes) and "check_upstream" in words  # the scan sees
    for page in PAGES:
        names, paths = mentioned(page)
        assert len(names) > 40 and len(paths) > 20, page.name
        assert missing_names(names, words, classes) == [], f"{page.name} names code that does not exist"
        assert missing_paths(paths) == [], f"{page.name} names files that do not exist"


def test_the_scan_catches_a_stale_name_and_path():
    words, classes = code_words(), package_classes()
    assert missing_names(
        ["RouteBuffer.gather_per_sample", "RouteBuffer.gather", "RouterReplay.replay()"], words, classes
    ) == ["RouteBuffer.gather_per_sample"]
    assert missing_names(["no_such_function_anywhere()"], words, classes) == ["no_such_function_anywhere()"]
    assert missing_paths(["routing/replay.py", "routing/gone.py", "upstream/"]) == ["routing/gone.py"]


def test_the_architecture_page_names_every_module():
    """Each module by its path under the package (``core/launch.py``), or by its file name in the row of its folder
    (``cli/``'s row lists ``commands.py``, ...); ``__init__.py`` and ``__main__.py`` are their folder's."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("|")]
    unnamed = []
    for path in sorted((ROOT / "trl_moe_replay").rglob("*.py")):
        relative = path.relative_to(ROOT / "trl_moe_replay").as_posix()
        folder = relative.rsplit("/", 1)[0] + "/" if "/" in relative else ""
        if path.name in ("__init__.py", "__main__.py") and folder:
            named = f"`{folder}" in text or f"{folder}`" in text
        else:
            named = (
                f"`{relative}`" in text
                or f"`trl_moe_replay/{relative}`" in text
                or any(f"`{folder}`" in row and f"`{path.name}`" in row for row in rows)
            )
        if not named:
            unnamed.append(relative)
    assert len(list((ROOT / "trl_moe_replay").rglob("*.py"))) > 50  # the scan sees the package
    assert unnamed == [], f"modules docs/architecture.md does not name in its Layout: {unnamed}"
