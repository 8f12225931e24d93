"""The docs stay true: every page (README.md, BUILD.md, CHANGELOG.md, docs/) links only to what exists, names
only paths of this repository that exist, and writes only command lines that the command's own parser takes;
the README stays a short guide that lists every docs page; docs/configs.md is what docs/gen_configs.py writes;
no page or docstring cites what the repository does not hold (an outside spec's sections, issue numbers).
What the commands do when run is tests/test_readme_walk.py's."""
from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess

import pytest

from tests.zygote import PYTHON

REPO = pathlib.Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
OTHER_PAGES = (REPO / "BUILD.md", REPO / "CHANGELOG.md")
# Top-level entries of this repository: a backticked path that starts with one must exist.
OURS = ("jaxsora/", "configs/", "data_tools/", "bench/", "tests/", "launch/", "docs/")
OUR_FILES = ("Makefile", "pyproject.toml", "LICENSE", "CHANGELOG.md", "BUILD.md", "README.md")
# Paths of Open-Sora's repository that the pages name as theirs (under a folder name we also have).
UPSTREAM = ("configs/opensora-v1-2/",)
# Their config files that the pages' commands take, as checked in under tests/fixtures (their commits are there).
FIXTURE_CONFIGS = {
    "configs/opensora-v1-2/lambda/": "tests/fixtures/opensora_configs/lambdalabs/configs/opensora-v1-2/lambda/",
    "configs/opensora-v1-2/": "tests/fixtures/opensora_configs/hpcaitech/configs/opensora-v1-2/",
}
# Programs that are not ours: their command lines are written as their own docs give them.
EXTERNAL = {"pip", "hf", "rsync", "kill", "torchrun", "colossalai", "python3.12", ".", "gcloud"}


def doc_pages() -> list[pathlib.Path]:
    """README.md, then the docs pages in the order of the README's contents list."""
    linked = []
    for target in re.findall(r"\]\((docs/[^)#\s]+\.md)", README.read_text()):
        if (REPO / target) not in linked:
            linked.append(REPO / target)
    return [README, *linked]


def all_pages() -> list[pathlib.Path]:
    return [*doc_pages(), *OTHER_PAGES]


def _strip_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def bash_commands(page: pathlib.Path) -> list[str]:
    """The commands of a page's bash blocks: continuation lines joined, comments and blank lines dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            line = line.split("  #")[0].rstrip()
            if line and not line.lstrip().startswith("#"):
                out += [part.strip() for part in line.split(" && ")]  # `a && b`: two commands
    return out


def inline_commands(page: pathlib.Path) -> list[str]:
    """Our commands written in prose or tables (`python -m jaxsora...`): flags checked loosely."""
    spans = re.findall(r"`([^`\n]+)`", _strip_code(page.read_text()))
    return [s for s in spans if re.match(r"(\.venv/bin/)?python (-m (jaxsora|data_tools)\.|bench/)", s)]


def python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


# ------------------------------------------------------------------------------------------------ the README
def test_the_readme_is_a_short_guide_listing_every_docs_page():
    lines = README.read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: keep it under 250, move the rest to docs/"
    listed = set(doc_pages()[1:])
    pages = {p for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), f"docs pages the README's contents do not list: {sorted(pages - listed)}"
    order = [h for h in re.findall(r"^## (.+)$", README.read_text(), re.M)]
    assert order[:3] == ["Quick start", "Documentation", "Benchmarks"], order


# ------------------------------------------------------------------------------------------- links and paths
def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", _strip_code(page.read_text()), re.M)}


def link_problems(page: pathlib.Path) -> list[str]:
    problems = []
    for text, target in re.findall(r"\[([^\]]*)\]\(([^)\s]+)\)", _strip_code(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto: — not checked here (no network)
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.relative_to(REPO)}: link [{text}]({target}): no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{page.relative_to(REPO)}: link [{text}]({target}): no heading #{anchor} there")
    return problems


def path_problems(page: pathlib.Path) -> list[str]:
    """Backticked paths of this repository that do not exist (a glob must match something)."""
    problems = []
    text = page.read_text()
    spans = re.findall(r"`([^`\n]+)`", _strip_code(text)) + [w for b in re.findall(r"```\w*\n(.*?)```", text, re.S)
                                                             for w in b.split()]
    for span in spans:
        for token in span.split():
            token = token.strip("()[],;:'\"").split("#")[0]
            if not (token.startswith(OURS) or token in OUR_FILES) or token.startswith(UPSTREAM):
                continue
            if "<" in token or "{" in token or "$" in token:
                token = re.split(r"[<{$]", token)[0].rsplit("/", 1)[0]  # the folder before the placeholder
            hits = list(REPO.glob(token)) if any(c in token for c in "*?[") else [REPO / token]
            if not any(h.exists() for h in hits):
                problems.append(f"{page.relative_to(REPO)}: `{token}` does not exist")
    return problems


def test_every_link_and_path_exists():
    problems = [p for page in all_pages() for p in link_problems(page) + path_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_link_and_path_checks_find_what_is_broken(tmp_path):
    """The checks themselves: a dead link, a missing heading and a missing path are each found."""
    page = DOCS / "_probe_test_docs.md"
    page.write_text("# A\n\n[ok](install.md#cpu) [dead](nowhere.md) [anchor](install.md#no-such-heading)\n"
                    "`jaxsora/cli.py` `jaxsora/no_such_module.py` `configs/opensora-v1-2/train/stage1.py`\n")
    try:
        problems = link_problems(page) + path_problems(page)
    finally:
        page.unlink()
    assert len(problems) == 3, problems
    assert "nowhere.md" in problems[0] and "no-such-heading" in problems[1] and "no_such_module" in problems[2]


# ------------------------------------------------------------------------------------------------- commands
def _fixture_config(word: str) -> str:
    """An Open-Sora config file named by its path in Open-Sora's checkout → our copy of it."""
    for theirs, ours in FIXTURE_CONFIGS.items():
        if word.startswith(theirs):
            return str(REPO / ours) + "/" + word[len(theirs):]
    return word


def _job(command: str, loose: bool) -> list[dict] | str:
    """The parser checks of one command line ([] when none applies), or a problem."""
    words = [w.strip("[]") for w in shlex.split(command)]
    words = [w for w in words if w and w != "..."]
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # environment assignments
        words = words[1:]
    if not words:
        return []
    prog = words[0]
    if prog == "make":
        targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
        return [] if words[1] in targets else f"make: no target {words[1]!r} in the Makefile"
    if prog == "bash":
        return [] if (REPO / words[1]).exists() else f"bash: no such script {words[1]}"
    if prog == "srun":
        return _job(shlex.join(words[1:]), loose)
    if prog == "sbatch":  # its --wrap command is ours to check, or its script must exist
        if "--wrap" in words:
            return _job(words[words.index("--wrap") + 1], loose)
        script = next((w for w in words[1:] if not w.startswith("-")), None)
        return [] if script and (REPO / script).exists() else f"sbatch: no such script {script}"
    if prog in ("python", ".venv/bin/python"):
        if words[1] == "-m" and words[2].split(".")[0] in ("jaxsora", "data_tools"):
            target, argv, kind = words[2], words[3:], "module"
        elif words[1].startswith("bench/"):
            target, argv, kind = words[1], words[2:], "script"
        elif words[1] in ("-c", "scripts/inference.py") or words[1] == "-m" and words[2] in ("venv", "pytest"):
            return []  # a one-liner, Open-Sora's own script (docs/weights.md), a venv, pytest
        else:
            return f"a python command the check does not know: {command}"
        if target == "jaxsora.cluster" and "--" in argv:  # cluster parses what is before `--`; the rest is a command
            cut = argv.index("--")
            inner = _job(shlex.join(argv[cut + 1:]), loose)
            if isinstance(inner, str):
                return inner
            return [dict(kind=kind, target=target, argv=argv[:cut], loose=loose), *inner]
        argv = [_fixture_config(w) for w in argv]
        return [dict(kind=kind, target=target, argv=argv, loose=loose)]
    if prog in EXTERNAL:
        return []
    return f"a program the check does not know: {command}"


def check_commands(commands: list[tuple[str, str, bool]]) -> list[str]:
    """(where, command, loose) → problems: each command parsed by its command's own parser."""
    jobs, owners, problems = [], [], []
    for where, command, loose in commands:
        got = _job(command, loose)
        if isinstance(got, str):
            problems.append(f"{where}: {got}")
            continue
        jobs += got
        owners += [(where, command)] * len(got)
    r = subprocess.run([PYTHON, str(REPO / "tests" / "docs_argv.py")], input=json.dumps(jobs), capture_output=True,
                       text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for (where, command), result in zip(owners, json.loads(r.stdout), strict=True):
        if not result["ok"]:
            problems.append(f"{where}: {command}\n    → {result['message']}")
    return problems


@pytest.fixture(scope="module")
def documented() -> list[tuple[str, str, bool]]:
    out = []
    for page in all_pages():
        name = str(page.relative_to(REPO))
        out += [(name, c, False) for c in bash_commands(page)]
        out += [(name, c, True) for c in inline_commands(page)]
    return out


def test_every_documented_command_takes_its_flags(documented):
    problems = check_commands(documented)
    assert not problems, "\n".join(problems)


def test_the_command_check_finds_a_flag_a_command_does_not_take():
    """A wrong flag of each kind of parser is found, a hidden alias is accepted, a prose command's placeholder
    is not taken for a mistake."""
    cases = [
        ("train - a flag it lacks", "python -m jaxsora.train --config configs/demo.py --data-pth x.csv", False),
        ("train - a config key it lacks", "python -m jaxsora.train --config configs/demo.py --config.optim.lr=1 "
                                         "--config.optim.lrr=1", False),
        ("argparse - a flag it lacks", "python -m data_tools.filter --input a.csv --output b.csv --aes-min 5 "
                                      "--aes-minimum 5", False),
        ("subcommand - a flag it lacks", "python -m jaxsora.convert to-torch a b --emma", False),
        ("parse_known_args - an override key", "python -m data_tools.precompute --latents --config configs/demo.py "
                                             "--input m.csv --output f --config.data.nope=1", False),
        ("bench script", "python bench/step.py --shapez tiny", False),
        ("launched command", "python -m jaxsora.cluster --hostfile h launch --run r -- .venv/bin/python -m "
                             "jaxsora.train --config configs/demo.py --run-dirr r", False),
        ("make target", "make dem0", False),
        ("fine - a hidden alias", "python -m jaxsora.tools.average a --out b", False),
        ("fine - prose with a placeholder", "python -m jaxsora.sample CKPT --vae ... --num-frames 4s", True),
    ]
    problems = check_commands([(where, c, loose) for where, c, loose in cases])
    found = {p.split(":")[0] for p in problems}
    assert found == {w for w, _, _ in cases if not w.startswith("fine")}, "\n".join(problems)


# ---------------------------------------------------------------------------------------------- other checks
def test_python_blocks_compile_and_bucket_examples_are_valid():
    from jaxsora.data.buckets import validate_bucket_config

    blocks = [(page, b) for page in all_pages() for b in python_blocks(page)]
    assert blocks
    for page, block in blocks:
        compile(block, str(page), "exec")
        if "bucket_config = " in block and "import" not in block:
            scope = {}
            exec(block, scope)
            validate_bucket_config(scope["bucket_config"])


def test_the_config_reference_is_generated():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_configs", DOCS / "gen_configs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "configs.md").read_text() == gen.render(), "docs/configs.md is stale: python docs/gen_configs.py"
    from jaxsora.train.plan.ranges import RANGES

    text = (DOCS / "configs.md").read_text()
    assert all(f"`{key}`" in text for key in RANGES), "every ranged knob is on the page"


def test_nothing_cites_what_the_repository_does_not_hold():
    """No 'spec §N' (a spec outside the repository) and no issue number ('issue #22', '(#24)')."""
    pattern = re.compile(r"spec §|issues? #\d|\(#\d+|#\d+'s note|[ (]#\d\d\b")
    files = [*all_pages(), *[p for d in ("jaxsora", "configs", "data_tools", "bench", "tests", "docs")
                             for p in (REPO / d).rglob("*.py")], REPO / "Makefile"]
    hits = []
    for path in files:
        rel = str(path.relative_to(REPO))
        if rel == "tests/test_docs.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{rel}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
