"""The package's imports run one way: ground -> contract -> strategies -> readers -> loop.

DESIGN.md's layers, checked on the source: a module may import its own layer or a lower
one, never a higher one, and the import graph has no cycle. Imports inside functions count
too (a cycle hidden in a function body is still a cycle). One exception: the registry of
strategy cards (`cards`, layer 2) imports nothing of the package, so any layer may read it
(the ZeRO paper's volumes and the time model of layer 1 read the cards) without an import
running back up; a test checks that it imports nothing.
"""

import ast
import re
import sys
from pathlib import Path

import pytest

import shardlab

PACKAGE = Path(shardlab.__file__).parent

# A split module is a package: its name (its `__init__`, which re-exports the parts) and
# each part are listed, so that a new part must be given a layer too.
LAYERS = {
    1: {"launch", "launch.errors", "launch.devices", "launch.hygiene", "launch.launcher",
        "launch.starter", "launch.blame", "launch.carry", "launch.torchrun", "launch.quiet",
        "launch.recorders", "launch.in_forkserver", "rendezvous",
        "precision", "measure", "clock", "vocabulary", "arguments", "hardware", "network", "plans", "steptime", "stepparts", "rates", "scaling", "models", "wrap", "manifest", "faults",
        "memory", "memory.states", "memory.configs", "memory.activations", "memory.planner",
        "memory.allocator", "memory.dim0", "memory.accumulation",
        "comm", "comm.compat", "comm.records", "comm.ledger", "comm.ring", "comm.volumes",
        "comm.flight", "comm.full_tensor", "comm.hang_diagnosis", "comm.links", "comm.reduction_precision", "hangs",
        "clip", "optimizers", "buckets", "units", "trace",
        "muon", "muon.newton_schulz", "muon.split", "muon.places", "muon.designs",
        "muon.optimizer", "comm.whole_matrix", "memory.whole_matrix",
        "many_ranks.threads", "many_ranks.fake", "many_ranks.formulas", "disk_tier"},
    2: {"strategy", "cards", "step"},
    3: {"ddp", "tensor_parallel",
        "deepspeed_ref", "deepspeed_ref.setup", "deepspeed_ref.strategies",
        "deepspeed_ref.predict", "deepspeed_ref.estimate", "deepspeed_ref.beside",
        "zero", "zero.layout", "zero.flat", "zero.gather", "zero.optimizer",
        "zero.stage1", "zero.stage2", "zero.strategies", "zero.torch_ref", "zero.timeline",
        "sharded", "sharded.model", "sharded.unit", "zero3", "infinity",
        "fsdp", "fsdp.layout", "fsdp.api", "fsdp.strategies", "fsdp.probe", "hsdp",
        "many_ranks.meshes",
        "zeropp", "zeropp.quantize", "zeropp.collectives", "zeropp.strategy",
        "zeropp.probe"},
    4: {"viz", "report", "report_output", "gpu_record", "muon_costs", "infinity_costs",
        "diagrams", "diagrams.draw", "diagrams.ring", "diagrams.stages", "diagrams.layouts",
        "diagrams.step_memory", "diagrams.timelines",
        "checkpoint", "checkpoint.layout", "checkpoint.store", "checkpoint.export",
        "checkpoint.failures", "checkpoint.lock",
        "modelio", "modelio.hf_files", "modelio.meta", "modelio.export", "modelio.host_memory",
        "many_ranks.measured", "many_ranks.figure"},
    5: {"config", "loop_concerns", "train", "workers", "probes", "cli", "__main__", "hang_runs",
        "muon_runs", "many_ranks", "many_ranks.runs", "infinity_runs"},
}


def module_name(path: Path, root: Path) -> str:
    """A module's name inside the package: `comm` for comm.py or comm/__init__.py,
    `comm.ring` for comm/ring.py."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(root: Path) -> dict[str, Path]:
    """Every module of the package, in subpackages too, by name (the package's own
    `__init__` left out: it imports nothing)."""
    found = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    found.pop("", None)
    return found


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that `name` (at `path`) imports, by their names in `known`:
    `from shardlab.comm.ring import x` is `comm.ring`; `from shardlab.comm import ring`
    is `comm.ring` when ring is a module, else `comm`; relative imports are resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + (node.module.split(".") if node.module else []))
            elif node.module == "shardlab" or (node.module or "").startswith("shardlab."):
                target = node.module[len("shardlab."):] if node.module != "shardlab" else ""
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            found |= {a.name[len("shardlab."):] for a in node.names
                      if a.name.startswith("shardlab.")}
    unknown = found - known - {""}
    assert not unknown, f"{name} imports {sorted(unknown)}, which the package does not have"
    return found - {name, ""}


def graph() -> dict[str, set[str]]:
    modules = modules_of(PACKAGE)
    return {name: imports_of(path, name, set(modules)) for name, path in modules.items()}


# Modules that import nothing of the package: read from any layer.
IMPORT_NOTHING = {"cards"}


def layer_of(module: str) -> int:
    for layer, modules in LAYERS.items():
        if module in modules:
            return layer
    raise AssertionError(f"module {module!r} has no layer: add it to LAYERS (and DESIGN.md)")


def test_every_module_has_a_layer_and_imports_downward_only():
    for module, deps in graph().items():
        for dep in deps - IMPORT_NOTHING:
            assert layer_of(dep) <= layer_of(module), \
                f"{module} (layer {layer_of(module)}) imports {dep} (layer {layer_of(dep)})"


def test_the_modules_any_layer_may_read_import_nothing_of_the_package():
    g = graph()
    for module in IMPORT_NOTHING:
        assert g[module] == set(), f"{module} imports {sorted(g[module])}: any layer reads it"


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


def test_the_checker_sees_submodules(tmp_path, monkeypatch):
    """A subpackage's parts are modules of their own: a cycle between two parts of one
    package is reported, and each part is named by its dotted path."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("from shardlab.p.x import f\n")
    (tmp_path / "p" / "x.py").write_text("from shardlab.p.y import g\n")
    (tmp_path / "p" / "y.py").write_text("def g():\n    from shardlab.p import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert graph() == {"p": {"p.x"}, "p.x": {"p.y"}, "p.y": {"p.x"}}
    with pytest.raises(AssertionError, match=r"import cycle: p -> p\.x -> p\.y -> p\.x"):
        test_the_import_graph_has_no_cycle()


def readme_module_map(text: str) -> dict[str, int]:
    """The README's module map: each module its rows name (a row may name several,
    `train`, `cli`, `__main__`), with the layer of the section it sits in."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| **1. ground**"))
    layer, rows = 0, {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        first = line.split("|")[1].strip()
        if heading := re.match(r"\*\*(\d)\.", first):
            layer = int(heading.group(1))
            continue
        for name in re.findall(r"`([^`]+)`", first):
            assert name not in rows, f"the README's module map names {name} twice"
            rows[name] = layer
    return rows


def test_the_readme_module_map_lists_every_module_in_its_layer():
    """A reader finds every module in the README's map, under the layer it is checked in
    here: a module added without a row, or moved to another layer, fails."""
    rows = readme_module_map((PACKAGE.parents[1] / "README.md").read_text())
    layer_of = {name: layer for layer, names in LAYERS.items() for name in names}
    assert sorted(set(layer_of) - set(rows)) == [], "modules without a row in the README"
    assert sorted(set(rows) - set(layer_of)) == [], "rows of modules that do not exist"
    assert {n: (rows[n], layer_of[n]) for n in rows if rows[n] != layer_of[n]} == {}, \
        "rows under another layer than the module's (README layer, checked layer)"


def test_the_module_map_reader_reads_each_row_under_its_layer():
    """The reader the check above relies on: a row under the heading before it, and a row
    that names several modules gives each of them."""
    table = ("| module | what it holds |\n|---|---|\n| **1. ground**: x | |\n| `a` | a |\n"
             "| **2. contract**: y | |\n| `b`, `c` | b and c |\n")
    assert readme_module_map(table) == {"a": 1, "b": 2, "c": 2}
