"""The package's imports run one way, from the command line down to the
leaves (ARCHITECTURE.md's layers), with no cycle, and no module reaches into
another's underscore names. Read from the source with `ast`, so a function-level
import counts as much as a top-level one; `if TYPE_CHECKING:` blocks do not
(they never run)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "batchgen"

# Lower ranks sit lower. A module may import its own rank or below; inside a
# rank the graph must still be acyclic. The longest matching prefix decides.
RANKS = {
    "batchgen.config": 0,  # contracts: no MLX
    "batchgen.jobs": 0,
    "batchgen.job_fields": 0,
    "batchgen.logprob_entries": 0,
    "batchgen.output": 0,
    "batchgen.stats": 0,
    "batchgen.turboquant": 9,  # leaves: TurboQuant's maths (codec, reference), kernels, then caches and
    "batchgen.kernels": 10,  # model transforms, then decoders
    "batchgen.cache": 11,
    "batchgen.transforms": 11,
    "batchgen.decode": 12,
    "batchgen.step": 20,  # engine: the batch step, the scheduler and entering rows, the engine
    "batchgen.engine": 21,
    "batchgen.engine.core": 22,
    "batchgen.runner": 30,  # run
    "batchgen.bench": 30,
    "batchgen.bench_features": 30,
    "batchgen.report": 30,
    "batchgen.plots": 30,
    "batchgen.progress": 30,
    "batchgen.shares": 30,
    "batchgen.ranks": 30,
    "batchgen.rank_parts": 30,
    "batchgen.cli": 40,  # face
    "batchgen.launch": 40,
    "batchgen.__main__": 40,
    "batchgen": 40,
}
NO_MLX_ALL = ("batchgen.config", "batchgen.jobs", "batchgen.job_fields", "batchgen.logprob_entries", "batchgen.output", "batchgen.stats",
          "batchgen.cli", "batchgen.progress", "batchgen.shares", "batchgen.ranks", "batchgen.rank_parts")  # fmt: skip
NO_MLX = [m for m in NO_MLX_ALL if (PACKAGE.parent / (m.replace(".", "/") + ".py")).exists()]


def rank(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in RANKS:
            return RANKS[prefix]
    raise AssertionError(f"{module} has no layer in RANKS: add it")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree) -> set:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    return skip


def imports_of(path: Path, package: Path = PACKAGE):
    """(imported module, [(name, as-name)], line) for each import of batchgen or MLX in `path`."""
    me = module_name(path, package)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, [(a.name, a.asname or a.name) for a in node.names], node.lineno


def graph(package: Path = PACKAGE):
    """{module: [(imported module, line)]} over the package's own modules."""
    files = sorted(package.rglob("*.py"))
    modules = {module_name(p, package) for p in files}
    edges = {}
    for p in files:
        me = module_name(p, package)
        edges[me] = []
        for target, names, line in imports_of(p, package):
            for t in [target] + [f"{target}.{n}" for n, _ in names]:
                if t in modules and t != me and not me.startswith(t + "."):
                    edges[me].append((t, line))
    return edges


def upward_imports(edges) -> list[str]:
    return [f"{me}:{line} imports {t} (layer {rank(t)} over {rank(me)})"
            for me, targets in edges.items() for t, line in targets if rank(t) > rank(me)]  # fmt: skip


def cycles(edges) -> list[str]:
    succ = {m: sorted({t for t, _ in targets}) for m, targets in edges.items()}
    state, stack, found = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in succ[m]:
            if state.get(n) == "open":
                found.append(" -> ".join(stack[stack.index(n) :] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(succ):
        if m not in state:
            visit(m)
    return found


def private_uses(package: Path = PACKAGE) -> list[str]:
    """`from x import _name` and `x._name` where x is another of the package's modules."""
    files = sorted(package.rglob("*.py"))
    modules = {module_name(p, package) for p in files}
    root = package.name
    found = []
    for p in files:
        me = module_name(p, package)
        aliases = {}
        for target, names, line in imports_of(p, package):
            if target.split(".")[0] != root:
                continue
            if not names:
                continue
            for name, local in names:
                if f"{target}.{name}" in modules:
                    aliases[local] = f"{target}.{name}"
                elif name.startswith("_") and not name.startswith("__") and target != me:
                    found.append(f"{me}:{line} imports {target}.{name}")
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):  # fmt: skip
                found.append(f"{me}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_imports_run_down_the_layers():
    found = upward_imports(graph())
    assert not found, "\n".join(found)


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "\n".join(found)


def test_no_module_uses_another_modules_private_names():
    found = private_uses()
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module", NO_MLX)
def test_contracts_and_command_line_do_not_import_mlx(module):
    """Validating a file, --help and the contracts need no MLX: importing them
    in a fresh interpreter leaves mlx out of sys.modules."""
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.strip()  # fmt: skip
    assert out == "[]", f"importing {module} imports {out}"


def test_the_layer_rules_can_fail(tmp_path):
    """The checks see what they look for, in a literal package: an upward
    import, a cycle, a private name."""
    pkg = tmp_path / "batchgen"
    (pkg / "decode").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "decode" / "__init__.py").write_text("")
    (pkg / "decode" / "pld.py").write_text("from ..runner import go\nfrom . import text\n")
    (pkg / "decode" / "text.py").write_text("from .pld import _helper\nfrom . import pld\nx = pld._inner\n")
    (pkg / "runner.py").write_text("from .decode import pld\n")
    edges = graph(pkg)
    assert upward_imports(edges) == ["batchgen.decode.pld:1 imports batchgen.runner (layer 30 over 12)"]
    assert cycles(edges) == ["batchgen.decode.pld -> batchgen.decode.text -> batchgen.decode.pld",
                             "batchgen.decode.pld -> batchgen.runner -> batchgen.decode.pld"] or len(cycles(edges)) == 2
    assert private_uses(pkg) == ["batchgen.decode.text:1 imports batchgen.decode.pld._helper",
                                 "batchgen.decode.text:3 uses batchgen.decode.pld._inner"]  # fmt: skip
