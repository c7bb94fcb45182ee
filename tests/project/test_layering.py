"""The packages' import rules hold: every package's __init__ docstring says on a line
`May import: ...` which of the project's packages its modules may import, and every import
in the tree (module level or inside a function) is checked against the nearest such rule.
The wire contract imports nothing but the standard library; the training modules import one
another without a circle."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Top-level packages of the project and where they live.
PACKAGES = {
    "specdec": ROOT / "specdec",
    "specdec_wire": ROOT / "client" / "specdec_wire",
    "specdec_client": ROOT / "client" / "specdec_client",
    "specdec_openai": ROOT / "specdec_openai",
    "trtllm_repository": ROOT / "trtllm_repository",
    "loadtest": ROOT / "loadtest",
}
RULE_PREFIX = "May import:"


def module_name(path: Path, top: str) -> str:
    rel = path.relative_to(PACKAGES[top]).with_suffix("")
    parts = [top, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p, top): p for top, root in PACKAGES.items() for p in sorted(root.rglob("*.py"))}


def rule_of(path: Path) -> tuple[str, ...] | None:
    """The `May import:` line of a module's docstring, as module-name prefixes."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    for line in doc.splitlines():
        if line.startswith(RULE_PREFIX):
            names = line[len(RULE_PREFIX):].strip().rstrip(".")
            if names.startswith("nothing"):
                return ()
            return tuple(n.strip() for n in names.split(","))
    return None


def governing_rule(name: str, mods: dict[str, Path]) -> tuple[str, tuple[str, ...]]:
    """(who states it, allowed prefixes): the module's own rule, else its nearest package's."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in mods:
            rule = rule_of(mods[candidate])
            if rule is not None:
                return candidate, rule
    raise AssertionError(f"{name}: no `{RULE_PREFIX}` line in its docstring or any package __init__ above it")


def imports_of(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, relative ones resolved."""
    return imports_in(path.read_text(), name, is_package=path.name == "__init__.py")


def imports_in(source: str, name: str, is_package: bool = False) -> list[tuple[int, str]]:
    """imports_of for the source of module `name`."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]  # `from pkg import module`
    return out


def is_within(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def nearest_module(target: str, mods: dict[str, Path]) -> str:
    """The module an import lands in (`from pkg.mod import name` names pkg.mod.name)."""
    parts = target.split(".")
    return next(".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in mods)


def violations() -> list[str]:
    mods = modules()
    found = []
    for name, path in mods.items():
        owner, allowed = governing_rule(name, mods)
        for line, target in imports_of(path, name):
            top = target.split(".")[0]
            if top not in PACKAGES:
                continue
            if not (target in mods or any(is_within(m, target) for m in mods)):
                continue  # `from pkg import name`: the name is not a module
            if any(is_within(target, prefix) for prefix in allowed):
                continue
            # Within its own package a module imports freely, but not into a subpackage that
            # states a rule of its own (config.py, owned by `specdec`, importing specdec.engine
            # is an arrow between layers, not a sibling import).
            if is_within(target, owner) and governing_rule(nearest_module(target, mods), mods)[0] == owner:
                continue
            found.append(f"{path.relative_to(ROOT)}:{line} imports {target} (rule of {owner}: {', '.join(allowed) or 'nothing'})")
    return found


def test_every_package_states_its_rule_in_two_lines():
    for name, path in modules().items():
        if path.name == "__init__.py" and name.count(".") <= 1:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            lines = doc.splitlines()
            assert len(lines) >= 2 and lines[1].startswith(RULE_PREFIX) and (len(lines) == 2 or not lines[2]), f"{path.relative_to(ROOT)}: what lives here, then {RULE_PREFIX}"


def test_no_package_imports_one_it_may_not():
    assert violations() == []


def test_the_wire_contract_is_standard_library_only():
    path = PACKAGES["specdec_wire"] / "__init__.py"
    outside = [t for _, t in imports_of(path, "specdec_wire") if t.split(".")[0] not in sys.stdlib_module_names | {"__future__"}
               and t.split(".")[0] != "dataclasses"]
    assert outside == [], f"specdec_wire imports {outside}"


@pytest.mark.parametrize("package, forbidden, inside_a_function", [
    ("specdec.engine", "specdec.serving", False),
    ("specdec_client", "specdec", False),
    ("specdec.engine", "specdec.serving.stats", True),
    ("specdec", "specdec.engine.grammar", True),  # a top-level module (as config.py) reaching into a layer
    ("specdec.tools", "specdec.bench.engine_runs", False),  # the tools (demo, tables) never need a benchmark
    ("specdec.tools", "specdec.training.train_eagle3", True),  # nor training (the CLI dispatches to it, not the tools)
    ("specdec.training", "specdec.bench.engine_runs", False),  # training measures its heads itself (held-out acceptance)
    ("specdec.training", "specdec.tools.demo", True),  # of the tools, training reads only the ShareGPT selection
    ("specdec.training", "specdec.launcher", False),  # and never starts a server
    ("specdec.bench", "trtllm_repository", True),
])
def test_a_forbidden_import_is_caught(tmp_path, monkeypatch, package, forbidden, inside_a_function):
    """Negative control: an arrow that runs back up is reported, also from inside a function."""
    parts = package.split(".")
    root = PACKAGES[parts[0]].joinpath(*parts[1:])
    probe = root / "_layering_probe.py"
    source = f"import {forbidden}\n"
    probe.write_text(f"def later():\n    {source}" if inside_a_function else source)
    try:
        assert any("_layering_probe.py" in v and forbidden in v for v in violations())
    finally:
        probe.unlink()


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules among `sources` (name -> source) that it imports, at module level
    or inside a function (`from pkg.mod import name` lands in pkg.mod)."""
    graph = {}
    for name, source in sources.items():
        edges = set()
        for _, target in imports_in(source, name, is_package=name.rpartition(".")[2] == "__init__"):
            parts = target.split(".")
            hit = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in sources), None)
            if hit is not None and hit != name:
                edges.add(hit)
        graph[name] = edges
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of the graph as [a, b, ..., a] (a depth-first walk), [] when there is none."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def training_sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in modules().items() if is_within(name, "specdec.training")}


def test_the_training_modules_import_one_another_without_a_circle():
    """Data, capture, the loop and held-out acceptance below the trainers; no trainer or
    command imports another (train_eagle3 and distill_answers once imported each other)."""
    sources = training_sources()
    assert {"specdec.training.data", "specdec.training.train_eagle3", "specdec.training.distill_answers"} <= set(sources)
    graph = import_graph(sources)
    assert import_cycle(graph) == []
    commands = {f"specdec.training.{m}" for m in ("train_eagle3", "train_medusa", "train_draft", "distill_answers")}
    assert {name: graph[name] & commands for name in sources if graph[name] & commands} == {}


@pytest.mark.parametrize("sources", [
    {"pkg.a": "from pkg.b import load_shard\n", "pkg.b": "def main():\n    from pkg.a import distill_prompts\n"},  # one arm in a function
    {"pkg.a": "from . import b\n", "pkg.b": "from .a import x\n"},  # relative
    {"pkg.a": "import pkg.b\n", "pkg.b": "import pkg.c\n", "pkg.c": "def f():\n    import pkg.a.x\n"},  # three long
])
def test_an_import_circle_is_caught(sources):
    """Negative control: a synthetic circle is reported, and so is one added to the real
    training modules; the fix (the shared piece in a third module both import) is not."""
    circle = import_cycle(import_graph(sources))
    assert circle and circle[0] == circle[-1] and set(circle) == set(sources)
    fixed = {"pkg.a": "from pkg.shared import load_shard\n", "pkg.b": "from pkg.shared import distill_prompts, load_shard\n", "pkg.shared": ""}
    assert import_cycle(import_graph(fixed)) == []
    real = training_sources()
    real["specdec.training.data"] += "\n\ndef later():\n    from specdec.training.distill_answers import greedy_answers\n"
    assert {"specdec.training.data", "specdec.training.distill_answers"} <= set(import_cycle(import_graph(real)))


def test_module_names_are_not_repeated_across_packages_for_different_things():
    """protocol, metrics, cli, GenerateRequest: one of each."""
    leaves: dict[str, list[str]] = {}
    for name in modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("__init__", "__main__") and "." in name:
            leaves.setdefault(leaf, []).append(name)
    # errors: each installable part's own exception types (the client is installed alone).
    # bench: the server side's benchmarks package (specdec.bench, issue 61) and the client's
    # benchmark runner (specdec_client.bench), the one its served drivers call.
    known = {"bench": ["specdec.bench", "specdec_client.bench"]}
    repeated = {leaf: names for leaf, names in leaves.items() if len(names) > 1 and leaf != "errors" and sorted(names) != known.get(leaf)}
    assert repeated == {}
    defined = [name for name, path in modules().items() if "class GenerateRequest" in path.read_text()]
    assert defined == ["specdec_client.client"]


def test_results_hold_data_only():
    """Drivers live in specdec/bench (experiments/ for one-off runs); results/ is their data."""
    code = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("*") if p.suffix in (".py", ".sh"))
    assert code == []
