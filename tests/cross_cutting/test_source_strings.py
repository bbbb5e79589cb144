"""Source hygiene: no string literal names a variable in braces without being formatted (a dropped ``f`` prefix
printed ``{CAPTURE_CONDITIONS}`` literally in the colocate first-batch refusal)."""

import ast
import io
import re
import tokenize
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["trl_moe_replay", "trl_moe_replay_vllm_plugin", "recipes", "bench", "tools"]
#: ``{name}``, ``{name.attr}``, ``{name!r}``, ``{name:>8}``: a replacement field, not ``{{...}}`` or ``{a: b}`` prose
FIELD = re.compile(r"(?<!\{)\{([A-Za-z_]\w*)(?:\.[A-Za-z_]\w*)*(?:![rsa])?(?::[^{}\s]*)?\}(?!\})")
#: module constants that are templates, formatted where they are used (checked below to be ``.format``ted)
TEMPLATES = {"trl_moe_replay/extras/math/data.py": {"_WORD_TEMPLATES"}}


def bound_names(tree: ast.AST) -> set[str]:
    """Every name the module binds anywhere (assignments, parameters, definitions, imports)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def exempt_lines(tree: ast.AST, templates: set[str]) -> set[int]:
    """Lines of docstrings (prose about ``{key: value}`` shapes) and of the named template constants."""
    lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                lines.update(range(first.lineno, first.end_lineno + 1))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in templates for t in node.targets):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def unformatted_fields(source: str, templates: set[str] = frozenset()) -> list[tuple[int, str]]:
    """``(line, name)`` of each replacement field in a plain (non-f) string token that names a variable the module
    binds, outside docstrings and templates, and not followed by ``.format``. Tokens, not the AST: Python joins
    ``"{X}" f"..."`` into one f-string node, where the plain piece's braces can no longer be told apart."""
    tree = ast.parse(source)
    names, exempt = bound_names(tree), exempt_lines(tree, templates)
    tokens = [
        t
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)
    ]
    found = []
    for i, token in enumerate(tokens):
        if token.type != tokenize.STRING or token.start[0] in exempt:
            continue
        prefix = re.match(r"[A-Za-z]*", token.string).group(0).lower()
        if "f" in prefix:
            continue
        following = [t.string for t in tokens[i + 1 : i + 3]]
        if following == [".", "format"] or following == [".", "format_map"]:
            continue
        found += [(token.start[0], m.group(1)) for m in FIELD.finditer(token.string) if m.group(1) in names]
    return found


def test_the_check_finds_a_dropped_f_prefix():
    bad = 'NAME = 1\nmessage = (\n    "the value: "\n    "{NAME} is shown literally" f" and {NAME} is not"\n)\n'
    assert unformatted_fields(bad) == [(4, "NAME")]
    good = 'NAME = 1\nmessage = f"{NAME}" + "{{NAME}}" + "{NAME}".format(NAME=2) + "{unbound}"\n'
    assert unformatted_fields(good) == []


def test_no_string_names_a_variable_without_being_formatted():
    offenders = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            source = path.read_text()
            offenders += [
                f"{relative}:{line} {{{name}}}"
                for line, name in unformatted_fields(source, TEMPLATES.get(relative, set()))
            ]
    assert not offenders, f"string literals with a replacement field but no f prefix or .format: {offenders}"


def test_the_named_templates_are_formatted_where_used():
    for relative, names in TEMPLATES.items():
        source = (ROOT / relative).read_text()
        for name in names:
            assert re.search(rf"{name}\[[^\]]*\]\.format\(|{name}\.format\(", source), (relative, name)
