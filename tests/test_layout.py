"""The package layout stays what docs/architecture.md describes: small modules, a small top level, no import
cycles, and kernels as leaves."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "apcscore"
MAX_LINES = 350
TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "config.py", "errors.py"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported(node: ast.Import | ast.ImportFrom, module: str) -> set[str]:
    """The apcscore modules an import statement of `module` loads (a package for `from pkg import name` unless
    name is a submodule of it)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name.split(".")[0] == "apcscore"}
    base = node.module or ""
    if node.level:  # relative import
        package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
        package = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
        base = f"{package}.{base}" if base else package
    if base.split(".")[0] != "apcscore":
        return set()
    out = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.add(sub if sub in MODULES else base)
    return out


def imports(module: str, *, module_level_only: bool) -> set[str]:
    """apcscore modules `module` imports: at module level outside `if TYPE_CHECKING:` blocks, or anywhere."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(imported(node, module))
            elif isinstance(node, ast.If):
                if not is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                visit(node.body)

    if module_level_only:
        visit(tree.body)
    else:
        found = {m for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for m in imported(node, module)}
    found.discard(module)
    return found


def test_no_module_is_longer_than_350_lines() -> None:
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}; split them"


def test_top_level_holds_only_the_package_face_cli_config_and_errors() -> None:
    files = {p.name for p in PACKAGE.glob("*.py")}
    assert files == TOP_LEVEL, f"unexpected top-level modules: {sorted(files - TOP_LEVEL)}"
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == {"attention", "compare", "engine", "io", "jobs", "kernels", "lmeval", "models", "scale"}


def test_the_module_level_import_graph_has_no_cycle() -> None:
    graph = {m: {i for i in imports(m, module_level_only=True) if i in MODULES} for m in MODULES}
    assert graph["apcscore.engine.engine"], "the import parser found nothing: it is broken"
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_kernels_import_nothing_from_apcscore_but_kernels() -> None:
    kernels = [m for m in MODULES if m == "apcscore.kernels" or m.startswith("apcscore.kernels.")]
    assert len(kernels) > 3
    outside = {m: sorted(i for i in imports(m, module_level_only=False)
                         if i != "apcscore.kernels" and not i.startswith("apcscore.kernels."))
               for m in kernels}
    outside = {m: found for m, found in outside.items() if found}
    assert not outside, f"kernels must be leaves, but: {outside}"


def test_only_the_lmeval_package_imports_lm_eval() -> None:
    """lm-eval is an optional extra: no module outside apcscore.lmeval imports it, and nothing at module level
    imports apcscore.lmeval (cli.py's eval command imports it when it runs)."""
    offenders = []
    for name, path in MODULES.items():
        if name.startswith("apcscore.lmeval"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            if any(n.split(".")[0] == "lm_eval" for n in names):
                offenders.append(name)
        if any(m.startswith("apcscore.lmeval") for m in imports(name, module_level_only=True)):
            offenders.append(name)
    assert not offenders, f"modules that import lm_eval or apcscore.lmeval at load: {sorted(set(offenders))}"


def test_ray_is_imported_only_when_a_run_asks_for_it() -> None:
    """Ray is an optional extra: only apcscore.scale.ray_run imports it, inside a function (for --ray)."""
    offenders = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = set(tree.body)
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "ray" for n in names) and (name != "apcscore.scale.ray_run" or node in top):
                offenders.append(name)
    assert not offenders, f"modules that import ray where they should not: {sorted(set(offenders))}"
