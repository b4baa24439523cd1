"""The package's shape, checked: no duplicated code, streams that never name a backend, imports
that point one way from every module and in no circle, no function longer than ``MAX_FUNCTION_LINES`` and no module
longer than ``MAX_MODULE_LINES``, and a line for every module in docs/ARCHITECTURE.md's tree."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from attnres.ops import BACKENDS

PACKAGE = Path(__file__).resolve().parent.parent / "attnres"
# each imports only from those before it (experiments drive training, analysis, conversion and evaluation; hf's
# finetune uses train's step);
# names.py (the designs and presets the command line offers), eval_tasks.py (lm-eval's task names, read as
# text), signals.py (how work stops on SIGINT and SIGTERM, which files.py reads) and moe.py import nothing
# of the package;
# the model's config reads the streams' options and MoE's balance rules, and model builds on its config,
# its decoding (generation.py: the KV cache, sampling) and its MLPs
LAYERS = ["cache|files|names|eval_tasks|architectures|signals", "ops", "streams", "moe", "model_config|generation", "model", "analysis", "train",
          "hf|serving", "experiments", "commands", "cli|__main__|__init__"]
#: the longest a function or method of the package may be, decorators and docstring included
MAX_FUNCTION_LINES = 100
#: the longest a module of the package may be, in lines
MAX_MODULE_LINES = 500
ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"


def modules(folder: str):
    return sorted((PACKAGE / folder).rglob("*.py"))


# astroid would otherwise follow the imports into these packages' sources while it builds each
# module's tree (minutes for transformers); the similarity check reads only this package's text
NOT_FOLLOWED = ("torch", "transformers", "huggingface_hub", "numpy", "triton", "safetensors", "lm_eval",
                "tokenizers", "tqdm", "vllm", "openai")


def duplicate_code(*paths) -> subprocess.CompletedProcess:
    """pylint's duplicate-code check: 6 or more similar lines, imports and docstrings ignored."""
    hook = f"import astroid; astroid.MANAGER.module_denylist.update({NOT_FOLLOWED!r})"
    return subprocess.run(
        [sys.executable, "-m", "pylint", f"--init-hook={hook}", "--disable=all", "--enable=duplicate-code",
         "--min-similarity-lines=6", "--ignore-imports=y", "--ignore-docstrings=y", "--score=n", *map(str, paths)],
        capture_output=True, text=True, check=False,
    )


def test_no_duplicated_code(tmp_path):
    """pylint's duplicate-code check reports nothing in the package, and does report a copy."""
    pytest.importorskip("pylint")
    proc = duplicate_code(PACKAGE)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr
    copied = (PACKAGE / "ops" / "backends" / "naive.py").read_text()
    (tmp_path / "a.py").write_text(copied)
    (tmp_path / "b.py").write_text(copied)
    assert "duplicate-code" in duplicate_code(tmp_path / "a.py", tmp_path / "b.py").stdout


def string_constants(tree: ast.AST):
    """Every string literal of a module but its docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings]


@pytest.mark.parametrize("path", modules("streams"), ids=lambda p: p.name)
def test_streams_never_name_a_backend_and_import_ops_through_its_face(path):
    tree = ast.parse(path.read_text())
    named = [(n.lineno, n.value) for n in string_constants(tree) if n.value in BACKENDS]
    assert named == [], f"{path.name} names a backend: {named}"
    deep = [(n.lineno, n.module) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and n.level >= 2 and n.module and n.module.startswith("ops.")]
    assert deep == [], f"{path.name} imports ops modules other than attnres.ops: {deep}"


def layer_of(module: str) -> int | None:
    top = module.split(".")[0]
    return next((k for k, layer in enumerate(LAYERS) if top in layer.split("|")), None)


def imported_modules(rel: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of the package in a module at ``rel`` (its path inside
    the package, without suffix), relative or absolute, with the ``attnres.`` prefix dropped;
    ``from . import x`` counts as importing ``x``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = list(rel.parts[:-1])[: len(rel.parts) - node.level]
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] if node.module else [f"{target}.{a.name}".strip(".") for a in node.names]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "attnres":
            target = node.module.removeprefix("attnres").strip(".")
            names = [target] if target else [a.name for a in node.names]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.removeprefix("attnres.")) for a in node.names
                      if a.name.startswith("attnres.")]
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_one_way(path):
    """cache <- ops <- streams <- moe <- model <- analysis <- train <- hf, serving <- cli: every module has
    its layer, and none imports a layer above its own, relatively or absolutely."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    own = layer_of(".".join(rel.parts))
    assert own is not None, f"{rel} belongs to no layer of LAYERS: add it there"
    upward = [(line, name) for line, name in imported_modules(rel, ast.parse(path.read_text()))
              if (layer_of(name) or 0) > own]
    assert upward == [], f"{rel} imports upward: {upward}"


def test_the_import_check_sees_every_form(tmp_path):
    """A relative, an absolute and a plain ``import attnres.x`` of a higher layer are each found."""
    tree = ast.parse("from ..model import Transformer\nfrom attnres.train import trainer\nimport attnres.hf.convert\n"
                     "from attnres import cli\n")
    names = [name for _, name in imported_modules(Path("streams/base"), tree)]
    assert names == ["model", "train", "hf.convert", "cli"]
    assert all(layer_of(name) > layer_of("streams") for name in names)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``a.b`` for ``a/b.py``, ``a`` for
    ``a/__init__.py``), every form counted: at the top, inside a function, under TYPE_CHECKING."""
    files = {".".join(path.relative_to(package).with_suffix("").parts).removesuffix(".__init__"): path
             for path in package.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        rel = path.relative_to(package).with_suffix("")
        targets = set()
        for _, name in imported_modules(rel, ast.parse(path.read_text())):
            parts = name.split(".")
            # the longest prefix that is a module: ``train.data.Corpus`` is ``train.data``
            target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in files), None)
            if target is not None and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports (its modules in order, the first again at the end), or None. A package's
    ``__init__`` importing its own modules, and they its names, is the one circle allowed: Python
    runs the ``__init__`` first."""
    def inside(a: str, b: str) -> bool:
        return b.startswith(a + ".") or a.startswith(b + ".")

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if inside(node, target):
                continue
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_through_a_circle():
    """No circle of imports among the package's modules, lazy ones included: each dependency
    points one way inside a layer too."""
    assert import_circle(import_graph(PACKAGE)) is None


def test_the_circle_check_finds_a_lazy_circle(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import y\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import z\n")
    (tmp_path / "d.py").write_text("from .a import x\n")
    assert import_circle(import_graph(tmp_path)) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import os\n")
    assert import_circle(import_graph(tmp_path)) is None


def long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int, int]]:
    """``(name, first line, length)`` of every function longer than ``limit`` lines."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            if length > limit:
                found.append((node.name, first, length))
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_is_longer_than_the_limit(path):
    """Every function and method of the package fits in ``MAX_FUNCTION_LINES`` lines."""
    long = long_functions(ast.parse(path.read_text()), MAX_FUNCTION_LINES)
    assert long == [], f"{path.relative_to(PACKAGE)}: (name, line, length) over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_length_check_counts_a_long_function():
    body = "\n".join(f"    x{k} = {k}" for k in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f"@staticmethod\ndef f():\n{body}\n\ndef g():\n    return 1\n")
    assert long_functions(tree, MAX_FUNCTION_LINES) == [("f", 1, MAX_FUNCTION_LINES + 2)]


def lines_over(path: Path, limit: int) -> int | None:
    """The number of lines of the module at ``path`` when it holds more than ``limit``, else None."""
    lines = len(path.read_text().splitlines())
    return lines if lines > limit else None


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_longer_than_the_limit(path):
    """Every module of the package fits in ``MAX_MODULE_LINES`` lines: a longer one holds more than
    one job, and one of them goes into a module of its own."""
    lines = lines_over(path, MAX_MODULE_LINES)
    assert lines is None, f"{path.relative_to(PACKAGE)} has {lines} lines, over {MAX_MODULE_LINES}"


def test_the_length_check_counts_a_long_module(tmp_path):
    at_the_limit, over = tmp_path / "at_the_limit.py", tmp_path / "over.py"
    at_the_limit.write_text("x = 1\n" * MAX_MODULE_LINES)
    over.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert lines_over(at_the_limit, MAX_MODULE_LINES) is None
    assert lines_over(over, MAX_MODULE_LINES) == MAX_MODULE_LINES + 1


def tree_modules(text: str) -> list[str]:
    """The modules (paths inside the package) that the module tree of an ARCHITECTURE.md ``text``
    names: in the code block that opens with ``attnres/``, each line indented two spaces per level
    whose first word is a module (``x.py``) or a folder (``x/``); the deeper lines continue an
    entry's description."""
    block = text.split("```\nattnres/\n", 1)[1].split("```", 1)[0]
    folders, named = [], []
    for line in block.splitlines():
        indent, words = len(line) - len(line.lstrip(" ")), line.split()
        level = indent // 2
        if not words or indent % 2 or not 1 <= level <= len(folders) + 1 or not words[0].endswith((".py", "/")):
            continue
        del folders[level - 1:]
        if words[0].endswith("/"):
            folders.append(words[0].rstrip("/"))
        else:
            named.append("/".join([*folders, words[0]]))
    return named


def tree_problems(package: Path, text: str) -> tuple[list[str], list[str]]:
    """The modules of ``package`` that the tree in ``text`` gives no line, and those it names that
    ``package`` lacks."""
    modules, named = {str(p.relative_to(package)) for p in package.rglob("*.py")}, set(tree_modules(text))
    return sorted(modules - named), sorted(named - modules)


def test_the_architecture_tree_names_every_module():
    """docs/ARCHITECTURE.md's module tree has a line for every module of the package, and none for
    a module that is not there: a new, moved or renamed module brings its line."""
    missing, absent = tree_problems(PACKAGE, ARCHITECTURE.read_text())
    assert missing == [] and absent == [], (f"docs/ARCHITECTURE.md's tree has no line for {missing}, "
                                            f"and names modules the package lacks: {absent}")


def test_the_tree_check_finds_a_module_without_its_line(tmp_path):
    text = ("# Architecture\n\n```\nattnres/\n  a.py          one\n                b.py in a description, not a line\n"
            "  sub/          a folder\n    c.py        two\n  d.py          three\n```\n\n```\nnot.py\n```\n")
    assert tree_modules(text) == ["a.py", "sub/c.py", "d.py"]
    (tmp_path / "sub").mkdir()
    for name in ("a.py", "b.py", "sub/c.py", "sub/new.py"):
        (tmp_path / name).write_text("")
    assert tree_problems(tmp_path, text) == (["b.py", "sub/new.py"], ["d.py"])


#: the two implementations of what training needs of a model (``train.run_model.RunModel``): the
#: only modules where a run's kind of model may decide anything
MODEL_IMPLEMENTATIONS = ("train/run_model.py", "train/saved_model.py")
#: the most functions elsewhere that may test which kind of model a run trains
MAX_MODEL_KIND_TESTS = 5


def model_kind_tests(package: Path) -> list[tuple[str, str]]:
    """``(module, function)`` for each function outside ``MODEL_IMPLEMENTATIONS`` that compares a
    config's ``init_from`` or ``model`` with None (``cfg.model is None``, ``base.init_from is not
    None``): a place that asks which kind of model a run trains, attnres's own or a folder's."""
    found = set()
    for path in sorted(package.rglob("*.py")):
        module = str(path.relative_to(package))
        if module in MODEL_IMPLEMENTATIONS:
            continue
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                    sides = [node.left, *node.comparators]
                    if any(isinstance(s, ast.Attribute) and s.attr in ("init_from", "model")
                           and isinstance(s.value, ast.Name) for s in sides):
                        found.add((module, function.name))
    return sorted(found)


def test_few_places_ask_which_kind_of_model_a_run_trains():
    """Outside the two model implementations, at most ``MAX_MODEL_KIND_TESTS`` functions test a
    config's ``init_from`` or ``model``: the command that makes the run's model, the checks of a
    run's settings, and the two readers of a finished run (generate's and export's)."""
    places = model_kind_tests(PACKAGE)
    assert len(places) <= MAX_MODEL_KIND_TESTS, f"{len(places)} places ask which kind of model a run has: {places}"


def test_the_kind_check_finds_a_test_of_init_from(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "a.py").write_text("def f(cfg):\n    if cfg.init_from is not None:\n        return 1\n"
                                   "def g(cfg):\n    return cfg.model is None or cfg.model.dim\n"
                                   "def h(self):\n    return self.layer.model is None\n")
    (tmp_path / "train" / "run_model.py").write_text("def check(cfg):\n    return cfg.init_from is None\n")
    assert model_kind_tests(tmp_path) == [("a.py", "f"), ("a.py", "g")]
