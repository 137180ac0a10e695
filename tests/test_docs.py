"""The docs site builds with ``mkdocs build --strict``, so a broken link fails CI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import colobus as cb

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mkdocs", reason="mkdocs is in the [test] extra")


def _build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        # No --quiet: it hides warnings from the counter that makes --strict fail.
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "-f", str(project / "mkdocs.yml"), "-d", str(site)],
        cwd=project, capture_output=True, text=True, timeout=120)


def _nav_pages() -> list[str]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return [next(iter(entry.values())) for entry in config["nav"]]


def test_docs_build_strict(tmp_path: Path) -> None:
    proc = _build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    for page in _nav_pages():
        built = tmp_path / "site" / (page[:-3] + "/index.html" if page != "index.md"
                                      else "index.html")
        assert built.is_file(), page


def test_every_doc_page_is_in_the_nav() -> None:
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == set(_nav_pages())


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The check above can fail: strict mode turns a link to a missing page into an error."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / "index.md", "a") as f:
        f.write("\nSee [the missing page](no_such_page.md).\n")
    proc = _build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0
    assert "no_such_page.md" in proc.stdout + proc.stderr


def test_api_page_lists_every_public_name() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    listed = set(re.findall(r"^\| `([A-Za-z_]+)` \|", text, re.M))
    assert listed == set(cb.__all__), (
        f"missing from docs/api.md: {sorted(set(cb.__all__) - listed)}; "
        f"not public: {sorted(listed - set(cb.__all__))}")


def _commands(parser: Any, words: tuple[str, ...] = ("colobus",)
              ) -> Iterator[tuple[tuple[str, ...], set[str]]]:
    """Every command of the ``colobus`` command line, as the words that name it, and the
    options it takes (its own; ``-h``/``--help`` aside), read off the parser itself."""
    import argparse

    options: set[str] = set()
    subs: list[Any] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subs.append(action)
        elif isinstance(action, argparse._HelpAction):
            continue
        else:
            options.update(o for o in action.option_strings if o.startswith("--"))
    yield words, options
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, (*words, name))


def test_the_api_pages_command_table_is_the_command_lines() -> None:
    """Each command the parser has is a row of docs/api.md's table (or its first words
    head one), and that command's rows name every option it takes: the table is the
    command line, read off ``colobus._tools.cli.build_parser``."""
    from colobus._tools.cli import build_parser

    text = (ROOT / "docs" / "api.md").read_text()
    table = text.split("## The command line", 1)[1].split("\n## ", 1)[0]
    rows = [row.split(" | ", 1) for row in re.findall(r"^\| (`colobus[^\n]*)", table, re.M)]
    missing: list[str] = []
    for words, options in _commands(build_parser()):
        named = " ".join(words)
        mine = [cell for head, cell in rows
                if re.match(rf"`{re.escape(named)}( |`)", head)]
        if not mine and len(words) > 1 and words[1] not in ("launch", "manifest"):
            missing.append(f"{named}: no row")
            continue
        if len(words) == 2 and words[1] in ("launch", "manifest"):
            continue  # (its kinds have the rows)
        heads = " ".join(head for head, _ in rows
                         if re.match(rf"`{re.escape(named)}( |`)", head))
        cells = heads + " ".join(mine)
        missing += [f"{named} {o}" for o in sorted(options)
                    if not re.search(rf"{re.escape(o)}\b", cells)]
    assert not missing, f"docs/api.md's command table lacks: {missing}"


# -- the Python snippets of the docs ------------------------------------------------------
#
# Every fenced ```python block of docs/*.md compiles (top-level ``await`` allowed) and runs.
# The line before a block's fence says how (for writers of docs):
#
# - nothing: a whole program; it runs as a script of its own;
# - ``<!-- fragment -->``: a part of a program. A page's fragments run in sequence, in one
#   process, as a user pastes them one after the other into the program the page describes
#   (the page's setup below stands for that program: a 2-host x 4-device cluster and the
#   names the page's text gives its fragments); top-level ``await`` runs as in
#   ``python -m asyncio``;
# - ``<!-- not run: WHY -->``: cannot run here (it needs remote machines, a batch system,
#   or JAX's own colocated runtime). NOT_RUN lists them all, to keep the list small.

FRAGMENT = "<!-- fragment -->"
_NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")
_FENCE = re.compile(r"^( *)```python\s*$")

# (page, the block's first line of code that is not an import or a comment) of every
# block that does not run, and why.
NOT_RUN = {
    ("deployment.md", 'async with cb.ssh_cluster(["node1", "node2"], devices_per_host=4) '
                      "as ctl:"): "ssh_cluster needs ssh hosts",
    ("deployment.md", "async with cb.slurm_cluster(nodes=4, devices_per_host=8,"):
        "slurm_cluster needs a Slurm cluster",
    ("deployment.md", "with cb.Controller() as ctl:     # binds $COLOBUS_ADDRESS, waits for "
                      "$COLOBUS_HOSTS"): "runs under colobus launch",
    ("index.md", 'async with cb.Controller("tcp://0.0.0.0:5555", hosts=4, '
                 'key=cb.load_key("colobus.key")):'): "waits for 4 remote workers",
    ("jax_comparison.md", "cpu_devices = cp.colocated_cpu_devices(jax.devices())"):
        "JAX's colocated_python needs its own (IFRT proxy) runtime",
    ("observability.md", 'cb.Controller(..., metrics="0.0.0.0:9464", metrics_public=True)'):
        "a sketch of the arguments",
    ("reliability.md", "async with cb.Controller(bind, hosts=4, key=key,"):
        "waits for 4 remote workers",
    ("security.md", "ctl = cb.Controller("): "waits for 4 remote workers with CurveZMQ keys",
    ("accelerators.md", 'hosts = ["tpu-vm-0", "tpu-vm-1", "tpu-vm-2", "tpu-vm-3"]   # a slice\'s '
                        "hosts, by ssh name"): "ssh_cluster needs ssh hosts",
}


def _first_line(code: str) -> str:
    """A block's first line of code that is not an import or a comment (its name in
    NOT_RUN)."""
    for line in code.strip().split("\n"):
        if line.strip() and not re.match(r"(import|from|#)\b|#", line.strip()):
            return line.strip()
    return code.strip().split("\n")[0]


_IMPORTS = """
import asyncio
import os

import jax
import jax.numpy as jnp
import numpy as np

import colobus as cb
"""

_BASE_SETUP = """
_cluster = cb.local_cluster(hosts=2, devices_per_host=4)
ctl = _cluster.__enter__()
mesh = cb.Mesh(np.array(cb.devices()).reshape(2, 4), ("hosts", "devices"))
x = cb.device_put(np.arange(16.0, dtype=np.float32).reshape(2, 8),
                  cb.NamedSharding(mesh, cb.PartitionSpec("hosts", "devices")))


@cb.colocated_python
def add_one(x):
    return x + 1
"""

# What each page's text gives its fragments, beyond the base (above); the pages of
# OWN_CLUSTER start the cluster they describe instead of the base's.
OWN_CLUSTER = {"index.md", "observability.md", "reliability.md"}
# The pages whose fragments are code beside a `with` cluster (its blocking
# helpers): they run on a loop of their own, as in a notebook. Every other page's
# fragments are async code under `async with`: they run on the base cluster's own loop,
# where `cb.device_get` and `cb.block_until_ready` are futures to await.
BESIDE_THE_CLUSTER = OWN_CLUSTER | {"async_and_sync.md"}
PAGE_SETUP: dict[str, str] = {
    "observability.md": """
_cluster = cb.local_cluster(hosts=2, devices_per_host=4, trace=True)   # with trace= on
ctl = _cluster.__enter__()
params = batch = cb.device_put(np.ones(8, np.float32), cb.devices()[0])
step = cb.colocated_python(lambda params, batch: params + batch)
""",
    "reliability.md": """
step = cb.colocated_python(lambda batch: batch + 1)
""",
    "async_and_sync.md": """
params = x
batch = cb.device_put(np.ones((2, 8), np.float32), x.sharding)
shards = [x, batch]
fn = print


@cb.colocated_python
def step(params, batch):
    return params + batch


load = f = cb.colocated_python(lambda x: x)
pair = cb.colocated_python(lambda x: (x, x * 2))
preprocess = cb.colocated_python(lambda x: x * 2)
normalize = cb.colocated_python(lambda x: (x - x.mean()) / (x.std() + 1e-6))
compute = cb.colocated_python(lambda params, batch: params * batch)


@cb.colocated_python_class
class Loader:
    def next_batch(self, params):
        return params * 0 + 1


@cb.colocated_python_class
class Writer:
    async def save(self, params, n):
        return params


loader, writer = Loader(), Writer()
""",
    "index.md": """
@cb.colocated_python
def normalize(x):
    return (x - x.mean()) / (x.std() + 1e-6)
""",
    "objects.md": """
@cb.colocated_python_class
class Loader:
    def __init__(self, path):
        self.path, self.step = path, 0

    def next_batch(self, like):
        self.step += 1
        return jax.device_put(np.full(like.shape, self.step, like.dtype), like.sharding)
""",
    "accelerators.md": """
batch = x


@cb.colocated_python_class
class Model:
    def step(self, batch):
        return batch * 2


model = Model()
""",
    "functions.md": 'open("mymodule.py", "w").write("cache = None\\n")  # a module of yours',
    "arrays.md": "arr = x   # a cb.Array (moving_arrays.md's first fragment makes one)",
}


def _python_blocks() -> list[tuple[str, int, str, str]]:
    """(page, line of the fence, code, kind) for every python block; kind is ``program``,
    ``fragment`` or ``not run``."""
    import textwrap

    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        lines = path.read_text().split("\n")
        i = 0
        while i < len(lines):
            if not _FENCE.match(lines[i]):
                i += 1
                continue
            end = i + 1
            while not re.match(r"^ *```\s*$", lines[end]):
                end += 1
            code = textwrap.dedent("\n".join(lines[i + 1:end]))
            before = [ln.strip() for ln in lines[:i] if ln.strip()]
            marker = before[-1] if before else ""
            kind = ("fragment" if marker == FRAGMENT else
                    "not run" if _NOT_RUN.match(marker) else "program")
            assert marker != "<!-- not run -->", (
                f"docs/{path.name}:{i + 1}: say why it cannot run (<!-- not run: WHY -->), "
                "or mark it <!-- fragment -->")
            found.append((path.name, i + 1, code, kind))
            i = end + 1
    return found


def test_every_python_snippet_compiles() -> None:
    import ast

    blocks = _python_blocks()
    assert len(blocks) > 20
    for page, line, code, _ in blocks:
        try:
            compile(code, f"docs/{page}:{line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError as exc:
            raise AssertionError(f"docs/{page}:{line} does not compile: {exc}") from exc


def test_the_blocks_that_do_not_run_are_few_and_listed() -> None:
    not_run = {(page, _first_line(code)) for page, _, code, kind in _python_blocks()
               if kind == "not run"}
    for path in (ROOT / "docs").glob("*.md"):  # each says why, as NOT_RUN does
        for why in re.findall(r"<!-- not run: (.+) -->", path.read_text()):
            assert why in NOT_RUN.values(), (path.name, why)
    assert not_run == set(NOT_RUN), (
        f"not listed in NOT_RUN: {sorted(not_run - set(NOT_RUN))}; "
        f"listed but run or gone: {sorted(set(NOT_RUN) - not_run)}")
    assert len(NOT_RUN) <= 9


def _run(script: str, tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    import os

    path = tmp_path / name
    path.write_text(script)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("page", "line", "code"),
                         [pytest.param(p, n, c, id=f"{p}:{n}")
                          for p, n, c, kind in _python_blocks() if kind == "program"])
def test_python_program_runs(page: str, line: int, code: str, tmp_path: Path) -> None:
    """The blocks without a marker are whole programs that run as shown."""
    proc = _run(code, tmp_path, "snippet.py")
    assert proc.returncode == 0, (
        f"docs/{page}:{line} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def fragments_script(page: str) -> str:
    """One program: the page's setup, then each of its fragments in order (a traceback
    names a fragment as ``docs/PAGE:LINE``)."""
    fragments = [(f"docs/{p}:{n}", code) for p, n, code, kind in _python_blocks()
                 if p == page and kind == "fragment"]
    return "\n".join([
        _IMPORTS, "" if page in OWN_CLUSTER else _BASE_SETUP, PAGE_SETUP.get(page, ""),
        "import ast as _ast, inspect as _inspect",
        f"_FRAGMENTS = {fragments!r}",
        "",
        "async def _paste_all():",
        "    for _where, _code in _FRAGMENTS:",
        "        _done = eval(compile(_code, _where, 'exec',",
        "                             flags=_ast.PyCF_ALLOW_TOP_LEVEL_AWAIT), globals())",
        "        if _inspect.isawaitable(_done):",
        "            await _done",
        "        print('pasted', _where, flush=True)",
        "",
        "try:",
        "    asyncio.run(_paste_all())" if page in BESIDE_THE_CLUSTER else
        "    ctl.run_sync(_paste_all(), timeout=None)",
        "finally:",
        "    if '_cluster' in globals():",
        "        _cluster.__exit__(None, None, None)",
        "print('all fragments ran', flush=True)",
    ])


@pytest.mark.parametrize("page", sorted({p for p, _, _, kind in _python_blocks()
                                         if kind == "fragment"}))
def test_a_pages_fragments_run_in_sequence(page: str, tmp_path: Path) -> None:
    """A page's fragments, pasted one after the other into the program the page describes."""
    proc = _run(fragments_script(page), tmp_path, "fragments.py")
    assert proc.returncode == 0 and "all fragments ran" in proc.stdout, (
        f"docs/{page}'s fragments failed (exit {proc.returncode}):\n{proc.stdout}\n"
        f"{proc.stderr[-5000:]}")


def test_the_snippet_markers_are_seen() -> None:
    """A guard on the guard: each kind of block is found."""
    kinds = [kind for _, _, _, kind in _python_blocks()]
    assert kinds.count("program") >= 4 and kinds.count("fragment") >= 20, kinds
    assert _NOT_RUN.match("<!-- not run: needs ssh hosts -->")
    assert not _NOT_RUN.match("<!-- not run -->")


def test_the_compose_file_on_the_containers_page_is_the_repositorys() -> None:
    text = (ROOT / "docs" / "containers.md").read_text()
    (block,) = re.findall(r"```yaml\n(services:.*?)```", text, re.DOTALL)
    assert yaml.safe_load(block) == yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_both_kubernetes_recipes_name_the_secret_alike() -> None:
    """The hand-written recipe and `colobus manifest kubernetes`: one Secret, one key name,
    one mount path, so a Secret made for either serves both."""
    from colobus._launch import kubernetes as k8s

    text = (ROOT / "docs" / "containers.md").read_text()
    made = re.findall(r"kubectl create secret generic (\S+)\s+--from-file=(\w+)=", text)
    assert made and set(made) == {(k8s.SECRET_NAME, "key")}, made
    recipe = text[text.index("\n## Kubernetes\n"):]
    assert f"{k8s.KEY_DIR}/key" in recipe and "/run/secrets/colobus" not in recipe
