"""The house's layering, read from the source: every import statement (a function's lazy ones too) of the project's
packages. The runtime (harness.engine) imports nothing from the experiments above it, the rooms below harness import
nothing of it, and no module imports itself through others."""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("zoo", "cache", "attention", "ssm", "kernels", "harness")
RUNTIME = "harness.engine"


def module_names(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is named by its __init__)."""
    names = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The project modules one import statement names: `from package import submodule` names the submodule,
    `from module import thing` the module; a name outside the project names nothing."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:  # relative: up from this module's package
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = []
    for target in targets:
        while target and target not in modules:  # `import a.b.thing` of a name inside module a.b
            target = target.rpartition(".")[0]
        if target and target != name:
            found.append(target)
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    modules = module_names(root, packages)
    return {name: {target for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Import | ast.ImportFrom)
                   for target in imported(name, path, node, modules)}
            for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
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
                        found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT, PACKAGES)


def test_no_module_imports_in_a_circle(graph):
    assert circles(graph) == []


def room(module: str) -> str:
    return RUNTIME if module == RUNTIME or module.startswith(RUNTIME + ".") else module.split(".")[0]


# Which rooms each room may import (docs/architecture.md's table); ssm shares three of attention's layer helpers.
ALLOWED = {
    "kernels": set(),
    "cache": {"kernels"},
    "attention": {"cache", "kernels"},
    "ssm": {"cache", "kernels", "attention.heads", "attention.rope", "attention.norm"},
    "zoo": {"attention", "ssm", "cache", "kernels"},
    RUNTIME: {"zoo", "cache", "kernels"},
    "harness": {RUNTIME, "zoo", "cache", "attention", "ssm", "kernels"},
}


def test_every_import_points_down_the_rooms(graph):
    wrong = sorted((name, target) for name, targets in graph.items() for target in targets
                   if room(target) != room(name)
                   and room(target) not in ALLOWED[room(name)] and target not in ALLOWED[room(name)])
    assert wrong == []


def test_the_runtime_reaches_the_model_only_through_zoo_and_the_cache_contract(graph):
    runtime = {name: targets for name, targets in graph.items() if room(name) == RUNTIME}
    assert len(runtime) >= 14  # the engine, its scheduler, block manager, model runner, sampling, speculation...
    reached = {room(t) for targets in runtime.values() for t in targets}
    assert "cache" in reached and not reached & {"attention", "ssm", "harness"}


def test_experiments_reach_the_runtime_only_through_it(graph):
    """The server, compare and the CLI sit above the runtime: each imports it (the graph is read, not assumed)."""
    for user in ("harness.serve.loop", "harness.compare", "harness.serve_bench"):
        assert any(t.startswith(RUNTIME) for t in graph[user]), user


def write_package(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_walk_finds_a_lazy_circle_and_a_relative_one(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "from .a import f\n",
        "pkg/a.py": "def f():\n    from pkg import b  # lazy\n    return b\n",
        "pkg/b.py": "import os\nfrom pkg.a import f\n",
        "pkg/c.py": "from . import d\n",
        "pkg/d.py": "from .c import thing\n",
        "pkg/e.py": "import pkg.a\nimport numpy\n",
    })
    found = import_graph(tmp_path, ("pkg",))
    assert found["pkg.e"] == {"pkg.a"} and found["pkg"] == {"pkg.a"}
    assert sorted(circles(found)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_the_walk_sees_every_module_python_imports(graph):
    """The graph's modules are those Python loads: a name missed here would hide its imports from the checks."""
    import harness.cli  # noqa: F401  (the CLI pulls in every experiment)
    loaded = {name for name, module in list(sys.modules.items()) if name.split(".")[0] in PACKAGES
              and Path(getattr(module, "__file__", None) or "/").resolve().is_relative_to(ROOT / name.split(".")[0])}
    assert len(loaded) > 50
    assert loaded <= set(graph), sorted(loaded - set(graph))
