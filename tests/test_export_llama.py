"""``attnres export --format llama``: a PreNorm run as a plain Llama folder, loaded by
``transformers`` without remote code, computing the run's logits."""

import pytest
import torch

from .conftest import cli_in_process

TINY = ["--preset", "tiny", "--set", "run.steps=2", "--set", "run.progress=false", "--set", "run.tensorboard=false"]


@pytest.mark.parametrize("extra", [[], ["--set", "model.tie_embeddings=true", "--set", "model.n_kv_heads=1"]])
def test_a_prenorm_run_exports_as_llama_with_the_native_exports_logits(tmp_path, extra):
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    assert cli_in_process("train", *TINY, *extra, "--run-dir", str(run)).returncode == 0
    for fmt in ("attnres", "llama"):
        out = cli_in_process("export", str(run), str(tmp_path / fmt), "--format", fmt)
        assert out.returncode == 0, out.stderr
    import attnres.hf  # noqa: F401  (registers the attnres classes for the native folder)

    llama = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"))
    native = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "attnres"))
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert "auto_map" not in llama.config.to_dict()  # no remote code
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = llama(tokens).logits, native(tokens).logits
    assert (a - b).abs().max() <= 1e-5
    from attnres.train.run_files import load_run_config

    assert llama.config.rms_norm_eps == load_run_config(run).model.stream_eps
    assert llama.config.tie_word_embeddings == bool(extra)
    from attnres.serving.server import served_architecture

    assert served_architecture(tmp_path / "llama") == "LlamaForCausalLM"  # attnres serve takes it as it is


@pytest.mark.parametrize("sets,message", [
    (["--set", "model.residual=block"], "model.residual='block' (export it with --format attnres)"),
    (["--set", "model.moe_experts=2"], "model.moe_experts=2 (export it with --format attnres)"),
])
def test_other_designs_are_refused_naming_them(tmp_path, sets, message):
    run = tmp_path / "run"
    assert cli_in_process("train", *TINY, *sets, "--run-dir", str(run)).returncode == 0
    out = cli_in_process("export", str(run), str(tmp_path / "out"), "--format", "llama")
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()
