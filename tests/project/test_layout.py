"""The package layout stays what docs/architecture.md describes: small modules, a small top level, no import
cycle (function-level imports counted), packages importing only the layers below them (the table "Layers" of
docs/architecture.md), no private name imported across packages, and kernels as leaves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "apcscore"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
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
    assert packages == {"attention", "compare", "engine", "io", "jobs", "kernels", "lmeval", "models", "options",
                        "run", "scale", "show"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycle_counting_function_level_imports() -> None:
    graph = {m: {i for i in imports(m, module_level_only=False) if i in MODULES} for m in MODULES}
    assert graph["apcscore.engine.engine"], "the import parser found nothing: it is broken"
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def layer_rules() -> dict[str, set[str]]:
    """docs/architecture.md's table "Layers": package -> the packages it may import (errors, config and the
    package face are everyone's)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rules = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`") and cells[0].endswith("/`"):
            rules[cells[0].strip("`/")] = set(re.findall(r"`(\w+)/`", cells[1]))
    return rules


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


def test_packages_import_only_the_layers_the_architecture_allows() -> None:
    rules = layer_rules()
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert set(rules) == packages, f"docs/architecture.md's Layers table lists {sorted(rules)}, not {sorted(packages)}"
    broken = []
    for m in MODULES:
        own = package_of(m)
        if not own:
            continue
        for i in imports(m, module_level_only=False):
            other = package_of(i)
            if other and other != own and other not in rules[own]:
                broken.append(f"{m} imports {i}")
    assert not broken, "imports the Layers table of docs/architecture.md does not allow:\n" + "\n".join(broken)


def test_the_architecture_page_is_the_design_in_at_most_400_lines() -> None:
    """docs/architecture.md describes the design as it is (issue 54, item 7); the long forms and the decision log
    live in docs/decisions.md, which it points to."""
    lines = ARCHITECTURE.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"docs/architecture.md has {len(lines)} lines: move history to docs/decisions.md"
    assert "docs/decisions.md" in "\n".join(lines)
    assert "## Decisions where the issues were silent" in (ARCHITECTURE.parent / "decisions.md").read_text("utf-8")


def test_no_private_name_is_imported_across_packages() -> None:
    offenders = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("apcscore") and not node.level:
                if package_of(node.module) != package_of(m) or not package_of(m):
                    offenders += [f"{m}: {node.module}.{a.name}" for a in node.names
                                  if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, f"private names imported from another package: {offenders}"


def test_kernels_import_nothing_from_apcscore_but_kernels() -> None:
    kernels = [m for m in MODULES if m == "apcscore.kernels" or m.startswith("apcscore.kernels.")]
    assert len(kernels) > 3
    outside = {m: sorted(i for i in imports(m, module_level_only=False)
                         if i != "apcscore.kernels" and not i.startswith("apcscore.kernels."))
               for m in kernels}
    outside = {m: found for m, found in outside.items() if found}
    assert not outside, f"kernels must be leaves, but: {outside}"


# the eval side of the run layer: the only modules outside apcscore.lmeval that import it at module level, and
# imported at module level only by each other (cli.py's eval and merge commands, run/merge.py, import them when
# they run)
EVAL_SIDE = {"apcscore.run.eval", "apcscore.run.eval_folder", "apcscore.run.eval_shards", "apcscore.run.ray_engine"}


def test_only_the_lmeval_package_imports_lm_eval() -> None:
    """lm-eval is an optional extra: no module outside apcscore.lmeval imports it, and nothing at module level
    imports apcscore.lmeval but the eval side of the run layer, which only the eval side imports at load."""
    offenders = []
    for name, path in MODULES.items():
        if name.startswith("apcscore.lmeval"):
            continue
        if name not in EVAL_SIDE and imports(name, module_level_only=True) & EVAL_SIDE:
            offenders.append(name)
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
        if name not in EVAL_SIDE and any(m.startswith("apcscore.lmeval")
                                         for m in imports(name, module_level_only=True)):
            offenders.append(name)
    assert not offenders, f"modules that import lm_eval or apcscore.lmeval at load: {sorted(set(offenders))}"


def test_ray_is_imported_only_when_a_run_asks_for_it() -> None:
    """Ray is an optional extra: only apcscore.run.ray_replicas imports it, inside a function (for --ray)."""
    offenders = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = set(tree.body)
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "ray" for n in names) and (name != "apcscore.run.ray_replicas" or node in top):
                offenders.append(name)
    assert not offenders, f"modules that import ray where they should not: {sorted(set(offenders))}"
