"""The package layout: lower layers never import higher ones (spec ← cache ← … ← cli)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtrace

PKG = Path(kvtrace.__file__).parent
# the flow, lowest first; kvtrace/__init__ and kvtrace/_errors sit below everything
LAYERS = ("spec", "cache", "models", "sources", "capture", "backends", "runtime", "artifact", "tools", "serve", "cli")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every kvtrace import in ``path``, function-level imports included."""
    out = []
    pkg = ".".join(("kvtrace", *path.relative_to(PKG).parent.parts))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*pkg.split(".")[: len(pkg.split(".")) - node.level + 1], *filter(None, [base])])
            out += [(node.lineno, f"{base}.{a.name}" if base == "kvtrace" else base) for a in node.names]
    return [(line, m) for line, m in out if m == "kvtrace" or m.startswith("kvtrace.")]


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1


def test_every_module_is_in_a_layer():
    stray = [p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "_errors.py")]
    assert stray == [], f"top-level modules outside the layers {LAYERS}: {stray}"
    assert sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").exists()) == sorted(LAYERS)


def test_lower_layers_never_import_higher_ones():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path == PKG / "__init__.py":
            continue  # the public facade: lazy re-exports from every layer
        here = _layer(".".join(("kvtrace", *path.relative_to(PKG).with_suffix("").parts)))
        for line, module in _imports(path):
            if _layer(module) > here:
                bad.append(f"{path.relative_to(PKG)}:{line} imports {module}")
    assert bad == [], "layer order " + " ← ".join(LAYERS) + " broken:\n" + "\n".join(bad)


def test_every_subpackage_says_what_lives_there_and_what_it_may_import():
    for name in LAYERS:
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text())) or ""
        assert len(doc) > 40 and ("May import" in doc or "imports nothing" in doc), name


def test_the_layout_check_sees_a_violation(tmp_path):
    # the checker itself: an upward import is found
    src = PKG / "spec" / "cache.py"
    assert _layer("kvtrace.cli.main") > _layer("kvtrace.spec.cache")
    assert ("kvtrace.spec.cache" in {m for _, m in _imports(PKG / "models" / "llama.py")})
    assert all(_layer(m) <= _layer("kvtrace.spec") for _, m in _imports(src))
