"""No class of the package overrides a private method of a class from another module (issue 14: composition over
subclass hooks). Static: the package's sources are parsed, not imported, so the check needs no array framework."""

from __future__ import annotations

import ast
from pathlib import Path

import omnitide_mlx

PACKAGE = Path(omnitide_mlx.__file__).parent

# (subclass, method): a class split by role into mixins of one object, each module one part of it
ALLOWED = {
    ("omnitide_mlx.engine.StreamingSession", "_forward"),  # called by its retention and reply parts (streaming/)
    ("omnitide_mlx.engine.StreamingSession", "_captured_hidden"),  # called by its reply part (streaming/reply.py)
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _classes() -> dict[str, dict]:
    """Every class of the package by qualified name: its module, resolved bases, private methods it defines and
    private attributes it reads on ``self`` / ``cls``."""
    classes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imports = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                source = node.module or ""
                if node.level:
                    source = f"{base}.{source}" if source else base
                for alias in node.names:
                    imports[alias.asname or alias.name] = f"{source}.{alias.name}"
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = []
            for b in node.bases:
                if isinstance(b, ast.Name):
                    bases.append(imports.get(b.id, f"{module}.{b.id}"))
            defined = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
            used = {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)
                    and isinstance(a.value, ast.Name) and a.value.id in ("self", "cls")}
            classes[f"{module}.{node.name}"] = dict(module=module, bases=bases,
                                                     defined={n for n in defined if _private(n)},
                                                     used={n for n in used if _private(n)})
    return classes


def _ancestors(name: str, classes: dict[str, dict]) -> list[str]:
    out, todo = [], list(classes[name]["bases"])
    while todo:
        b = todo.pop()
        if b in classes and b not in out:
            out.append(b)
            todo.extend(classes[b]["bases"])
    return out


def test_no_private_method_overridden_across_modules():
    classes = _classes()
    assert "omnitide_mlx.cache.OmniCache" in classes and "omnitide_mlx.core.paged_cache.PagedKVCache" in classes
    found = []
    for name, c in classes.items():
        for base in _ancestors(name, classes):
            b = classes[base]
            if b["module"] == c["module"]:
                continue
            for method in sorted(c["defined"] & (b["defined"] | b["used"])):
                if (name, method) not in ALLOWED:
                    found.append(f"{name}.{method} (a hook of {base})")
    assert not found, "private methods overridden across modules: " + "; ".join(found)


def test_the_check_sees_a_hook():
    """The check finds the pattern it forbids: a subclass's private method that a base in another module calls."""
    classes = _classes()
    session = classes["omnitide_mlx.engine.StreamingSession"]
    retention = classes["omnitide_mlx.streaming.retention.Retention"]
    assert "omnitide_mlx.streaming.retention.Retention" in _ancestors("omnitide_mlx.engine.StreamingSession", classes)
    assert "_forward" in session["defined"] & retention["used"]
