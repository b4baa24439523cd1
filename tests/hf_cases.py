"""Small Hugging Face source models shared by the integration tests: one per supported family,
with non-trivial norm gains, the byte ids they read, and ``attnres convert`` run in process."""

import contextlib
import io
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnres.hf import byte_tokenizer  # noqa: E402  (registers the Auto classes too)

AutoModelForCausalLM = transformers.AutoModelForCausalLM
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def source_model(kind, **overrides):
    torch.manual_seed(0)
    cfgs = {
        "llama": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True, **overrides),
        "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True, **overrides),
        "qwen2": lambda: transformers.Qwen2Config(**SMALL, **overrides),
        "mistral": lambda: transformers.MistralConfig(**SMALL, **overrides),
        "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2,
                                                      **overrides),
        # unnormalized top-k weights, MoE on every second layer (a dense MLP between): both of
        # Qwen3-MoE's own options
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=48, norm_topk_prob=False,
                                                         decoder_sparse_step=2, tie_word_embeddings=True, **overrides),
    }
    model = AutoModelForCausalLM.from_config(cfgs[kind]())
    with torch.no_grad():  # non-trivial norm gains, so that a norm applied twice or skipped would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def ids(b=2, t=20, seed=0):
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def saved_source(tmp_path):
    src = tmp_path / "src"
    source_model("llama").save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    return src, {p.name: p.read_bytes() for p in src.iterdir()}


def run_convert(src, dst, *extra, block_layers="2"):
    """``attnres convert`` run in this process (a fresh interpreter spends seconds importing
    transformers): its exit code and what it printed."""
    from attnres.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["convert", str(src), str(dst), "--heads", "4", "--block-layers", block_layers, *extra])
    return types.SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=err.getvalue())
