"""House rules of the source tree: no import circles between modules, nor between packages, no
module writing another object's private attribute, no file over 400 lines, no function over 60
lines."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"
PACKAGE = SRC / "expresslane"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `path` imports, at any depth (imports inside functions count; names
    imported for type annotations only, under `if TYPE_CHECKING:`, do not)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for n in ast.walk(block)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            # `from package import module` depends on the module; a name defined in the
            # package's __init__ depends on the package
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_circles():
    mods = sources()
    known = set(mods)
    graph = {name: imports(path, name, known) for name, path in mods.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def package_of(module: str) -> str:
    """The top-level package a module belongs to (`expresslane.engine` for every module
    under engine/, its subpackages included), or a top-level module itself."""
    return ".".join(module.split(".")[:2])


def package_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        here = package_of(name)
        deps = {package_of(m) for m in imports(path, name, known)} - {here}
        graph.setdefault(here, set()).update(deps)
    return graph


def test_no_package_circles():
    """Packages depend one way: engine/ never on server/, nor a subsystem on what uses it."""
    graph = package_graph(sources())
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# All the server may import of the engine: the `ServingEngine` protocol and what crosses it.
ENGINE_SEAM = {
    "expresslane.engine.protocol",
    "expresslane.engine.submission",
    "expresslane.engine.output",
    "expresslane.engine.snapshot",
}


def test_server_sees_the_engine_only_through_its_protocol():
    mods = sources()
    known = set(mods)
    crossing = {
        f"{name} -> {dep}"
        for name, path in mods.items()
        if name.startswith("expresslane.server.")
        for dep in imports(path, name, known)
        if package_of(dep) == "expresslane.engine" and dep not in ENGINE_SEAM
    }
    assert crossing == set()


def test_no_writes_to_private_attributes_of_others():
    """`x._name = ...` only for `self` or `cls`: an object's private state is its own."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript):
                    t = t.value
                if not isinstance(t, ast.Attribute) or not t.attr.startswith("_"):
                    continue
                owner = t.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(t)}")
    assert found == []


def test_files_and_functions_stay_short():
    long_files, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(str(path.relative_to(SRC)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(SRC)}:{node.name} ({lines})")
    assert long_files == [] and long_functions == []
