"""The layout of ``omnitide_mlx.bench``: no import cycle among its modules (imports inside functions included: a
lazy import that closes a cycle is still one), each ``bench/stream/`` module under ~500 lines, and both stream
variants providing every member of the ``Variant`` protocol."""

import ast
import pathlib

import omnitide_mlx.bench

BENCH = pathlib.Path(omnitide_mlx.bench.__file__).parent


def _module_name(path: pathlib.Path, root: pathlib.Path, prefix: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts])


def import_graph(root: pathlib.Path, prefix: str) -> dict[str, set[str]]:
    """Module -> the modules under ``prefix`` it imports anywhere in its source (a package's implicit import of
    its parent is not an edge; ``from pkg import sub`` is an edge to the submodule ``sub``)."""
    modules = {_module_name(p, root, prefix): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_the_scan_finds_a_lazy_cycle(tmp_path):
    """The scan sees the shape the stream benchmark had: a module-level import one way, a lazy one back."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (tmp_path / "b.py").write_text("from .a import f\n\ndef g():\n    return f\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_no_import_cycle_among_bench_modules():
    graph = import_graph(BENCH, "omnitide_mlx.bench")
    assert "omnitide_mlx.bench.stream.plots" in graph
    assert graph["omnitide_mlx.bench.stream.plots"] == {"omnitide_mlx.bench.stream.names"}
    assert find_cycle(graph) is None, find_cycle(graph)


def test_stream_modules_stay_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (BENCH / "stream").glob("*.py")}
    assert {"variants.py", "checkpoints.py", "sessions.py", "cli.py"} <= set(sizes)
    assert max(sizes.values()) <= 500, sizes


def test_both_variants_provide_the_protocol():
    from omnitide_mlx.bench import stream as bs
    from omnitide_mlx.bench.shape_models import ShapeTrueModel

    members = {n for c in bs.Variant.__mro__ if c.__name__ == "Variant" for n in vars(c) if not n.startswith("_")}
    members |= set(bs.Variant.__annotations__)
    assert {"media", "ask", "probe_attention", "kv_bytes", "kind", "retention"} <= members
    model = ShapeTrueModel("tiny", layers=1)
    for var in (bs.make_variant("omnitide", model), bs.make_variant("mlx_kvcache", model)):
        missing = [n for n in members if not hasattr(var, n)]
        assert not missing, (var.name, missing)
        assert var.kind in ("engine", "mlx_lm") and isinstance(var.kv_bytes, int)
        var.media(0.0)
        assert var.layout()["retained_cells"] > 0 and var.step_log()
