"""The layers import one way: kernels, bandits <- proposers <- core <- sim / integration <- commands
(sim on the core and the proposers only).

Every import counts, at module level or inside a function, and so does ``importlib.import_module`` with a
literal name. vLLM may be imported only by the integration layer (``adaptive_spec/vllm/``). A failure names
the file, the line and the import that runs the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Source folder of each layer, and the layers it may import (besides itself).
LAYERS: dict[str, tuple[Path, frozenset[str]]] = {
    "kernels": (ROOT / "kernels", frozenset()),
    "bandits": (ROOT / "bandits", frozenset()),
    "proposers": (ROOT / "adaptive_spec" / "proposers", frozenset({"kernels"})),
    "core": (ROOT / "adaptive_spec" / "core", frozenset({"proposers", "kernels", "bandits"})),
    "sim": (ROOT / "sim", frozenset({"core", "proposers"})),
    "vllm": (
        ROOT / "adaptive_spec" / "vllm",
        frozenset({"core", "proposers", "kernels", "bandits"}),
    ),
    "commands": (
        ROOT / "adaptive_spec" / "commands",
        frozenset({"vllm", "sim", "core", "proposers", "kernels", "bandits"}),
    ),
}
# The package's own __init__ is a facade: it re-exports AdaptiveSpec lazily from the integration layer.
FACADE = ROOT / "adaptive_spec" / "__init__.py"
FACADE_MAY_IMPORT = frozenset({"vllm"})


def layer_of_module(name: str) -> str | None:
    """The layer that owns a dotted module name of this project, or None for anything else."""
    parts = name.split(".")
    if parts[0] != "adaptive_spec":
        return None
    if len(parts) == 1:
        return "facade"
    if parts[1] in LAYERS:
        return parts[1]
    return "facade"  # adaptive_spec.<something not in a layer folder>: a stray module


def layer_of_file(path: Path) -> str:
    for layer, (folder, _) in LAYERS.items():
        if folder in path.parents:
            return layer
    raise AssertionError(f"{path.relative_to(ROOT)} lies in no layer folder: move it into one")


def dotted_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("kernels", "bandits", "sim"):
        parts = ["adaptive_spec", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = dotted_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            if target == "adaptive_spec":  # from adaptive_spec import <submodule>
                found.extend((node.lineno, f"adaptive_spec.{a.name}") for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def all_sources() -> list[Path]:
    files = [FACADE]
    for folder, _ in LAYERS.values():
        files.extend(sorted(folder.rglob("*.py")))
    return files


def test_every_module_lies_in_a_layer() -> None:
    stray = [
        p.relative_to(ROOT).as_posix() for p in (ROOT / "adaptive_spec").glob("*.py") if p != FACADE
    ]
    assert not stray, f"modules outside the layer folders of adaptive_spec/: {stray}"


@pytest.mark.parametrize("path", all_sources(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_imports_run_one_way(path: Path) -> None:
    if path == FACADE:
        own, allowed = "facade", FACADE_MAY_IMPORT
    else:
        own = layer_of_file(path)
        allowed = LAYERS[own][1]
    wrong = []
    for line, name in imports_of(path):
        top = name.split(".")[0]
        if top == "vllm" and own != "vllm":
            wrong.append(f"line {line}: imports vLLM ({name}); only adaptive_spec/vllm/ may")
        target = layer_of_module(name)
        if target is None or target == own:
            continue
        if target not in allowed:
            wrong.append(
                f"line {line}: {own} imports {name} ({target}); {own} may import {sorted(allowed)}"
            )
    assert not wrong, f"{path.relative_to(ROOT)}:\n" + "\n".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    """The checker itself: a function-level import of the integration layer from the core is found."""
    bad = ROOT / "adaptive_spec" / "core" / "_layer_probe.py"
    bad.write_text("def f():\n    from adaptive_spec.vllm import attach\n    import vllm\n")
    try:
        names = [n for _, n in imports_of(bad)]
        assert names == ["adaptive_spec.vllm", "vllm"]
        with pytest.raises(AssertionError, match="imports vLLM"):
            test_imports_run_one_way(bad)
    finally:
        bad.unlink()


def test_every_package_is_installed() -> None:
    """pyproject lists its packages by name: a new folder that is missing there would be left out of a
    built wheel (an editable install finds it anyway, so only this test notices)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for folder in ("adaptive_spec", "kernels", "bandits", "sim"):
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(dotted_name(init))
    assert found - listed == set(), (
        f"add these packages to pyproject.toml: {sorted(found - listed)}"
    )
    assert listed - found == set(), (
        f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"
    )


def module_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (each import resolved to the longest module name it
    starts with; the package facade left out)."""
    modules = {dotted_name(p): p for p in all_sources()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for _, target in imports_of(path):
            parts = target.split(".")
            for i in range(len(parts), 1, -1):
                candidate = ".".join(parts[:i])
                if candidate in modules:
                    if candidate != name:
                        graph[name].add(candidate)
                    break
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles() -> None:
    """Inside a layer too, modules import one way: no two modules reach each other."""
    cycles = import_cycles(module_graph())
    assert not cycles, "import cycles (each line: modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_check_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
