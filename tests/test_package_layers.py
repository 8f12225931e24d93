"""The package's import structure: no import cycle between jaxsora's modules, function-
level imports included; no import from a lower layer (checkpoint, data, diffusion, parallel, models, io)
up to a higher one (train, sample, serve, infer, config, tools); the checkpoint package stands on the
floor (errors, io, parallel, lazy_imports); and nothing that samples, converts or manages checkpoints
reaches into train/, not even through another module — read from the source's syntax tree, so a lazy
`import` inside a function counts as much as one at the top."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent
LOWER = ("jaxsora.checkpoint", "jaxsora.data", "jaxsora.diffusion", "jaxsora.parallel", "jaxsora.models", "jaxsora.io")
# What a checkpoint may stand on: every command reads checkpoints, so they import nothing of a command.
CHECKPOINT_FLOOR = ("jaxsora", "jaxsora.checkpoint", "jaxsora.errors", "jaxsora.io", "jaxsora.parallel",
                    "jaxsora.lazy_imports")
# Sampling, conversion and the checkpoint tools: an inference machine runs them without the trainer.
# (tools.search_bs compiles the train step: it is the trainer's.)
NOT_TRAIN = ("jaxsora.convert", "jaxsora.infer", "jaxsora.serve", "jaxsora.sample", "jaxsora.ckpt", "jaxsora.runs",
             "jaxsora.tools", "jaxsora.app")
HIGHER = ("jaxsora.train", "jaxsora.sample", "jaxsora.serve", "jaxsora.infer", "jaxsora.config", "jaxsora.tools",
          "jaxsora.app")


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
    # A package's __init__ re-exporting its own submodules (jaxsora.checkpoint) is its face, not a
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


def _reach(graph: dict, start: str) -> dict[str, str]:
    """Every module `start` imports, directly or not: {module: the module that imports it}."""
    seen, todo = {}, [start]
    while todo:
        m = todo.pop()
        for n in graph.get(m, ()):
            if n not in seen and n != start:
                seen[n] = m
                todo.append(n)
    return seen


def test_checkpoint_stands_on_the_floor():
    graph = _imports()
    bad = [(m, n) for m, deps in graph.items() if _is(m, ("jaxsora.checkpoint",))
           for n in deps if not (n == "jaxsora" or _is(n, CHECKPOINT_FLOOR[1:]))]
    assert not bad, bad


def test_sampling_and_checkpoint_tools_import_nothing_of_train():
    graph = _imports()
    bad = []
    for m in sorted(graph):
        if not _is(m, NOT_TRAIN) or _is(m, ("jaxsora.tools.search_bs",)):
            continue
        for n, via in _reach(graph, m).items():
            if _is(n, ("jaxsora.train",)):
                bad.append(f"{m} → … {via} → {n}")
                break
    assert not bad, bad


# train/ by concern: the run and its supervision, the step and its state, the eval, the plan.
TRAIN_ROOMS = ("run", "step", "eval", "plan")
TRAIN_TOP = ("__init__", "__main__", "build", "contracts")
MAX_LINES = 400


def test_train_is_grouped_by_concern():
    train = ROOT / "jaxsora" / "train"
    loose = [p.name for p in train.glob("*.py") if p.stem not in TRAIN_TOP]
    assert not loose, f"modules of train/ outside its concern folders {TRAIN_ROOMS}: {loose}"
    folders = sorted(p.name for p in train.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(TRAIN_ROOMS), folders
    for room in TRAIN_ROOMS:
        assert (train / room / "__init__.py").read_text().strip(), f"train/{room}/__init__.py says what it holds"
    long = {str(p.relative_to(ROOT)): n for p in train.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files of train/ over {MAX_LINES} lines: {long}"
