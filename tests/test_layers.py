"""The package's imports run one way: ground -> contract -> strategies -> readers -> loop.

DESIGN.md's layers, checked on the source: a module may import its own layer or a lower
one, never a higher one, and the import graph has no cycle. Imports inside functions count
too (a cycle hidden in a function body is still a cycle).
"""

import ast
import sys
from pathlib import Path

import shardlab

PACKAGE = Path(shardlab.__file__).parent

LAYERS = {
    1: {"launch", "precision", "comm", "memory", "measure", "models", "wrap", "manifest", "debugging",
        "hardware", "network"},
    2: {"strategy"},
    3: {"ddp", "zero", "sharded", "fsdp", "deepspeed_ref", "tensor_parallel"},
    4: {"checkpoint", "viz", "report"},
    5: {"train", "demo", "cli", "__main__"},
}


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "shardlab":
                found |= {a.name for a in node.names}
            elif node.module.startswith("shardlab."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names
                      if a.name.startswith("shardlab.")}
    return found - {path.stem}


def graph() -> dict[str, set[str]]:
    return {p.stem: imports_of(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def layer_of(module: str) -> int:
    for layer, modules in LAYERS.items():
        if module in modules:
            return layer
    raise AssertionError(f"module {module!r} has no layer: add it to LAYERS (and DESIGN.md)")


def test_every_module_has_a_layer_and_imports_downward_only():
    for module, deps in graph().items():
        for dep in deps:
            assert layer_of(dep) <= layer_of(module), \
                f"{module} (layer {layer_of(module)}) imports {dep} (layer {layer_of(dep)})"


def test_the_import_graph_has_no_cycle():
    g = graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(g.get(module, ())):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join(path + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in sorted(g):
        if module not in state:
            visit(module, [module])


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    """The cycle check can fail: two modules importing each other are reported."""
    (tmp_path / "a.py").write_text("from shardlab.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from shardlab import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    try:
        test_the_import_graph_has_no_cycle()
    except AssertionError as exc:
        assert "import cycle" in str(exc)
    else:
        raise AssertionError("a cycle a -> b -> a was not reported")
