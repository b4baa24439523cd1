"""The model folders the serving tests give vLLM, built in the main environment with their
reference tokens: greedy decoding by the ``transformers`` model of each folder (``generate``,
which decodes through the KV cache and, for attnres's own model, the explicit decode path).

Heads of 64 dimensions, a size vLLM's CPU attention runs (``attnres serve`` reads the sizes it
runs from vLLM, ``server.cpu_head_sizes``, and refuses a model of another size). The models are random, with routing
parameters drawn away from their zero start (so that the depth routing changes every token)
and an output head scaled up, so that greedy decoding is far from ties: each folder records the
smallest gap between the two best logits over every step (``min_margin``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: prompts of mixed lengths, one of a single token: vLLM passes them flat, together
PROMPTS = ["The quick brown fox", "A", "Attention over depth mixes the earlier outputs of a stack of layers.",
           "Hello, world"]
MAX_TOKENS = 12
#: native designs served in the tests -> their ModelConfig options
NATIVE = {
    "block": {"residual": "block", "block_size": 2},
    "mhar": {"residual": "block", "block_size": 2, "heads": 2},  # multi-head AttnRes
    "full": {"residual": "full"},
    "delta": {"residual": "delta", "block_size": 2},
    "hc": {"residual": "hc"},
    "mhc": {"residual": "mhc"},
    "gr": {"residual": "gr"},
    "block-moe": {"residual": "block", "block_size": 2, "moe_experts": 4, "moe_top_k": 2},
}
#: converted sources served in the tests (``architectures.SOURCES``'s model types) -> their
#: configurations' options
CONVERTED = {
    "llama": {},
    "qwen3": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128},
}


def _draw_routing(module: torch.nn.Module) -> None:
    """Every parameter of ``module`` redrawn around its start (a routing that mixes)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.5)


def _write_reference(model, folder: Path, head: torch.nn.Linear) -> None:
    from attnres.hf.tokenizer import byte_tokenizer

    with torch.no_grad():
        head.weight.mul_(20)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    prompts = [list(p.encode()) for p in PROMPTS]
    tokens, margin = [], float("inf")
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        for scores in out.scores:
            top = scores[0].topk(2).values
            margin = min(margin, float(top[0] - top[1]))
    (folder / "reference.json").write_text(json.dumps(
        {"prompts": prompts, "max_tokens": MAX_TOKENS, "tokens": tokens, "min_margin": margin}))


def native_folder(name: str, folder: Path) -> Path:
    """attnres's own model of design ``name`` (``NATIVE``), as ``attnres export`` writes it."""
    from attnres.hf import AttnResConfig, AttnResForCausalLM
    from attnres.model import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=2, max_seq_len=256, init_std=0.1, **NATIVE[name])
    model = AttnResForCausalLM(AttnResConfig.from_model_config(config)).eval()
    _draw_routing(model.model.stream)
    _write_reference(model, folder, model.model.lm_head)
    return folder


def source_folder(folder: Path) -> Path:
    """A PreNorm run's model exported as a plain Llama folder (``attnres export --format llama``),
    which vLLM serves with its own Llama."""
    import transformers

    from attnres.hf.export import llama_config, llama_weights
    from attnres.model import ModelConfig, Transformer

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=2, max_seq_len=256, init_std=0.1)
    model = transformers.LlamaForCausalLM(llama_config(config)).eval()
    model.load_state_dict(llama_weights(Transformer(config).state_dict(), config.n_layers))
    _write_reference(model, folder, model.lm_head)
    return folder


def converted_folder(source: str, folder: Path) -> Path:
    """A random ``source`` model (``CONVERTED``) converted by ``attnres convert``."""
    import transformers

    from attnres.architectures import SOURCES
    from attnres.hf import convert_checkpoint
    from attnres.hf.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    architecture = SOURCES[source]
    config = getattr(transformers, architecture.config_class)(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256, initializer_range=0.1, **CONVERTED[source])
    base = getattr(transformers, architecture.causal_lm_class)(config)
    src = folder.parent / f"{folder.name}-source"
    base.save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    convert_checkpoint(src, folder, heads=2, block_layers=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    _draw_routing(model.routing)
    _write_reference(model, folder, model.lm_head)
    return folder
