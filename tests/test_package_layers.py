"""The package's import structure (issue #15): no import cycle between jaxsora's modules, function-
level imports included, and no import from a lower layer (data, diffusion, parallel, models, io)
up to a higher one (train, sample, serve, infer, config, tools) — read from the source's syntax
tree, so a lazy `import` inside a function counts as much as one at the top."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent
LOWER = ("jaxsora.data", "jaxsora.diffusion", "jaxsora.parallel", "jaxsora.models", "jaxsora.io")
HIGHER = ("jaxsora.train", "jaxsora.sample", "jaxsora.serve", "jaxsora.infer", "jaxsora.config", "jaxsora.tools")


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module → the jaxsora modules it imports (a `from pkg import name` of a submodule counts as it)."""
    files = {_module(p): p for p in (ROOT / "jaxsora").rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.startswith("jaxsora")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxsora"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.add(sub if sub in files else node.module)
        graph[mod] = {m for m in out if m in files and m != mod}
    return graph


def _is(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_no_import_cycle():
    graph = _imports()
    # A package's __init__ re-exporting its own submodules (train.checkpoint) is its face, not a
    # dependency of concerns: leave those edges out.
    for m, deps in graph.items():
        graph[m] = {n for n in deps if not n.startswith(m + ".")}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, cycles


def test_lower_layers_do_not_import_higher_ones():
    upward = [(m, n) for m, deps in _imports().items() if _is(m, LOWER) for n in deps if _is(n, HIGHER)]
    assert not upward, upward
