"""``attnres serve`` reads the head sizes vLLM's CPU attention runs from vLLM itself, and refuses
a model of another size before the server starts (it would start, then fail its first request)."""

from __future__ import annotations

import subprocess

from .test_vllm import REPO, serve_python


def test_serve_refuses_an_unsupported_head_size_from_vllms_own_list(tmp_path):
    """An exported ``--preset tiny`` model (head size 16), given to ``attnres serve`` in the
    serving environment: one line naming 16 and vLLM's sizes, exit 2, no server started."""
    from attnres.hf import AttnResConfig, AttnResForCausalLM
    from attnres.model import ModelConfig

    folder = tmp_path / "tiny"
    config = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2, max_seq_len=64, residual="block", block_size=2)
    AttnResForCausalLM(AttnResConfig.from_model_config(config)).save_pretrained(str(folder))
    listed = subprocess.run([serve_python(), "-c", "from attnres.serving.server import cpu_head_sizes; "
                             "print(cpu_head_sizes())"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert listed.returncode == 0, listed.stderr
    sizes = listed.stdout.strip().splitlines()[-1]
    assert 64 in eval(sizes) and 16 not in eval(sizes)  # the serving tests' folders (64) serve
    proc = subprocess.run([serve_python(), "-m", "attnres", "serve", str(folder), "--port", "1"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("attnres serve: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert f"head size is 16 (dim / n_heads), which vLLM's CPU attention does not run; it runs head sizes {sizes}" \
        in errors[0], errors[0]
