"""The package's shape, checked: no duplicated code, streams that never name a backend, and
imports that point one way."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from attnres.ops import BACKENDS

PACKAGE = Path(__file__).resolve().parent.parent / "attnres"
# each imports only from those before it (train's compare drives analysis; hf's finetune uses train's step)
LAYERS = ["cache|files", "ops", "streams", "model", "analysis", "train", "hf", "cli|__main__|__init__"]


def modules(folder: str):
    return sorted((PACKAGE / folder).rglob("*.py"))


# astroid would otherwise follow the imports into these packages' sources while it builds each
# module's tree (minutes for transformers); the similarity check reads only this package's text
NOT_FOLLOWED = ("torch", "transformers", "huggingface_hub", "numpy", "triton", "safetensors", "lm_eval",
                "tokenizers", "tqdm")


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


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_one_way(path):
    """cache <- ops <- streams <- model <- analysis <- train <- hf <- cli: no module imports a layer
    above its own."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    own = layer_of(".".join(rel.parts))
    if own is None:
        return
    upward = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = list(rel.parts[:-1])[: len(rel.parts) - node.level]
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] if node.module else [f"{target}.{a.name}".strip(".") for a in node.names]
            for name in names:
                layer = layer_of(name)
                if layer is not None and layer > own:
                    upward.append((node.lineno, name))
    assert upward == [], f"{rel} imports upward: {upward}"
