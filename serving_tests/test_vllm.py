"""vLLM serves attnres's models (``attnres.serving``): its greedy tokens equal our
``transformers`` models' for native designs and converted Llama, Qwen3, Mixtral and Qwen3-MoE
folders, a batch of
prompts of mixed lengths equals each prompt decoded alone, and ``attnres serve`` answers an
OpenAI completion request with the same tokens.

The folders and their reference tokens are built here, in the main environment; vLLM runs in
the serving environment (``make serve-setup``: ``.venv-serve``, whose ``transformers`` is older
than ``attnres.hf`` needs), and its tokens come back through files."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .folders import CONVERTED, NATIVE, converted_folder, native_folder, source_folder

REPO = Path(__file__).resolve().parents[1]
SERVE_ENV = REPO / ".venv-serve" / "bin"
#: the folders: attnres's own designs, converted sources, and a plain Llama (a PreNorm run's
#: ``--format llama`` export, served by vLLM's own model)
FOLDERS = [*NATIVE, *CONVERTED, "llama-source"]


def serve_python() -> str:
    python = SERVE_ENV / "python"
    if not python.exists():
        raise RuntimeError(f"{python} does not exist: `make serve-setup` builds the serving environment")
    return str(python)


@pytest.fixture(scope="session")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served")
    built = {name: native_folder(name, root / name) for name in NATIVE}
    built.update({source: converted_folder(source, root / source) for source in CONVERTED})
    built["llama-source"] = source_folder(root / "llama-source")
    return built


@pytest.fixture(scope="session")
def served(folders, tmp_path_factory) -> dict[str, dict]:
    """vLLM's tokens for every folder, from one run of ``vllm_worker.py`` in the serving env."""
    out = tmp_path_factory.mktemp("vllm") / "tokens.json"
    proc = subprocess.run([serve_python(), str(REPO / "serving_tests" / "vllm_worker.py"), str(out),
                           *map(str, folders.values())], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tokens = json.loads(out.read_text())
    return {name: tokens[str(folder)] for name, folder in folders.items()}


def reference(folder: Path) -> dict:
    spec = json.loads((folder / "reference.json").read_text())
    assert spec["min_margin"] > 1e-3, spec["min_margin"]  # greedy decoding far from ties
    return spec


@pytest.mark.parametrize("name", FOLDERS)
def test_vllm_decodes_as_the_transformers_model(folders, served, name):
    """Each prompt, decoded alone by vLLM: the ``transformers`` model's greedy tokens."""
    assert served[name]["alone"] == reference(folders[name])["tokens"]


@pytest.mark.parametrize("name", FOLDERS)
def test_a_batch_of_mixed_lengths_equals_each_prompt_alone(folders, served, name):
    """The prompts (1 to 70 tokens) in one batch, flat in vLLM's passes: each prompt's tokens as
    when it is decoded alone."""
    assert served[name]["batch"] == served[name]["alone"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", ["block", "llama-source"])
def test_attnres_serve_answers_an_openai_completion(folders, tmp_path, name):
    """``attnres serve`` on the loopback address: a completion through the ``openai`` client
    gives the reference tokens, for attnres's own model and for a plain Llama folder (heads of
    64 dimensions); the test stops the server."""
    folder, port = folders[name], free_port()
    server = subprocess.Popen([str(SERVE_ENV / "attnres"), "serve", str(folder), "--port", str(port),
                               "--kv-cache-gib", "0.25"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stderr.read()[-4000:]
            assert time.monotonic() < deadline, "the server did not answer /health in 300 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        out = tmp_path / "tokens.json"
        proc = subprocess.run([serve_python(), str(REPO / "serving_tests" / "openai_client.py"), str(port),
                               str(folder), str(out)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert json.loads(out.read_text()) == reference(folder)["tokens"][0]
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


def test_a_folder_the_plugin_does_not_serve_is_refused_naming_it(tmp_path):
    """A folder declaring another architecture: ``attnres serve`` exits 2 naming it and the
    served ones, before vLLM starts."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    proc = subprocess.run([sys.executable, "-m", "attnres", "serve", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "declares architecture 'GPT2LMHeadModel', which attnres does not serve" in proc.stderr
    assert "AttnResForCausalLM" in proc.stderr
