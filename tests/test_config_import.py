"""A config file loads without jax (`jaxsora.models` imports nothing heavy; the configs read
`jaxsora.models.text_defaults`), and the trainer checks the config, its flags, paths and table files before it
imports jax, so that such a mistake is answered at once (so do the sampler, `ckpt` and `convert` with a wrong path)
— and the Flax settings that moved out of the package root (`jaxsora.models._flax`) still reach every model
module."""
import ast
import subprocess
import sys

import pytest

from tests.conftest import REPO

HEAVY = ("jax", "flax", "optax", "orbax", "torch")


def _fresh(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def test_configs_load_without_jax():
    loaded = _fresh(
        "import importlib, sys\n"
        "for name in ('configs.demo', 'configs.stage1', 'configs.lambda.stage3', 'configs.lora_example'):\n"
        "    importlib.import_module(name).get_config()\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))\n")
    assert loaded == ""


@pytest.mark.parametrize("args, said", [
    (["--config.optim.lrr=1"], "optim.lrr"),  # a misspelt key (the config's own parser)
    (["--config.train.keep_ckpts=-1"], "train.keep_ckpts"),  # a value out of range (check_ranges)
    (["--start-from-scratch"], "--load"),  # flags that contradict each other (check_run_flags)
    (["--profile", "abc"], "--profile expects START:STOP"),
    (["--config.wandb.enabled=True", "--config.wandb.mode=bogus"], "wandb.mode"),
    (["--load", "{tmp}/nowhere"], "--load: no such file or folder"),
    (["--data-path", "{tmp}/none.csv"], "table not found"),  # the table, after the flags' pyproject.toml
    (["--data-path", "{tmp}/empty.csv"], "has no rows"),
    (["--data-path", "{tmp}/nocols.csv"], "lacks column"),
])
def test_mistakes_are_answered_before_jax_is_imported(args, said, tmp_path):
    """The trainer's command line with a mistake in the config, the flags, a path or the table's files: the
    one-line error, exit code 2, and none of jax, flax, optax, orbax imported (what made each such answer take
    seconds)."""
    (tmp_path / "empty.csv").write_text("path,text,num_frames,height,width\n")
    (tmp_path / "nocols.csv").write_text("path,caption\nx.mp4,hi\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxsora.train", "--config", "configs/demo.py",
                        "--data-path", "pyproject.toml", *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    lines = r.stderr.splitlines()
    errors = [ln for ln in lines if not ln.startswith("import time:")]
    imported = {ln.split("|")[-1].strip() for ln in lines if ln.startswith("import time:")}
    assert r.returncode == 2 and len(errors) == 1 and said in errors[0], r.stderr[-3000:]
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_a_table_is_read_once_per_process(tmp_path, monkeypatch):
    """check_table remembers a table whose files are unchanged (the command line checks it before jax, the run
    again): a second call reads nothing, and a changed file is read again."""
    from jaxsora.data import tables

    table = tmp_path / "t.csv"
    table.write_text("path,text,num_frames,height,width\na.mp4,x,8,32,32\n")
    assert tables.check_table(str(table)) == 1
    reads = []
    monkeypatch.setattr(tables, "_check_table_files", lambda t, files: reads.append(files) or 7)
    assert tables.check_table(str(table)) == 1 and reads == []
    table.write_text("path,text,num_frames,height,width\na.mp4,x,8,32,32\nb.mp4,y,8,32,32\n")
    assert tables.check_table(str(table)) == 7 and reads == [[str(table)]]


def test_every_model_module_that_imports_flax_applies_the_settings():
    """Read from the source: a module of jaxsora/models that imports flax imports `_flax` too (the setting has
    to be in place before the first variable is created, whichever model module is imported first)."""
    missing = []
    for path in sorted((REPO / "jaxsora" / "models").glob("*.py")):
        if path.name == "_flax.py":
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        if any(n == "flax" or n.startswith("flax.") for n in names) and "jaxsora.models._flax" not in names:
            missing.append(path.name)
    assert not missing, missing
    # and in a fresh interpreter the setting is in place once a model module is imported
    assert _fresh("import jaxsora.models.t5, flax; print(flax.config.flax_always_shard_variable)") == "False"


@pytest.mark.parametrize("args, said", [
    (["jaxsora.sample", "{tmp}/nowhere", "--prompt", "x"], "checkpoint folder not found"),
    (["jaxsora.ckpt", "list", "{tmp}/nowhere"], "checkpoint folder not found"),
    (["jaxsora.ckpt", "verify", "{tmp}/nowhere"], "checkpoint folder not found"),
    (["jaxsora.convert", "to-torch", "{tmp}/nowhere", "{tmp}/out.safetensors"], "checkpoint folder not found"),
    (["jaxsora.convert", "from-torch", "{tmp}/none.pth", "{tmp}/ck"], "weights file not found"),
    (["jaxsora.convert", "from-torch", "{tmp}/w.pth", "{tmp}/ck", "--model", "XL/2"], "unknown model preset 'XL/2'"),
    (["jaxsora.convert", "from-torch", "{tmp}/w.pth", "{tmp}/ck", "--model", "demo", "--set", "hidden_size=100"],
     "head_dim must be even"),  # a value the model cannot take: one line too, not a traceback
])
def test_the_other_commands_answer_a_wrong_path_before_jax(args, said, tmp_path):
    """The sampler, `ckpt` and `convert` with a checkpoint or weights path that is not there (or `convert` with a
    model preset or field value that cannot be): one line, exit code 2, none of jax/flax/optax/orbax/torch
    imported (their packages load names on first use: `lazy_names`; the presets are plain Python)."""
    (tmp_path / "w.pth").write_bytes(b"")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", *args], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    lines = r.stderr.splitlines()
    errors = [ln for ln in lines if not ln.startswith("import time:")]
    imported = {ln.split("|")[-1].strip() for ln in lines if ln.startswith("import time:")}
    assert r.returncode == 2 and len(errors) == 1 and said in errors[0], r.stderr[-3000:]
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize("package", ["jaxsora.checkpoint", "jaxsora.convert", "jaxsora.infer"])
def test_every_lazy_name_resolves(package):
    """A lazily loaded package's table names each name's real module: every name of its `__all__` is there."""
    import importlib

    mod = importlib.import_module(package)
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing and set(mod.__all__) <= set(dir(mod)), missing
