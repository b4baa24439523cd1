"""``attnres export RUN_DIR OUT``: a training run's latest checkpoint as a Hugging Face folder.

The folder is what ``AttnResForCausalLM.save_pretrained`` writes (``config.json`` with
``model_type: attnres``, ``model.safetensors``) and the byte tokenizer's files: the form
``attnres eval``, ``transformers``' ``from_pretrained`` and serving engines load. With
``--format llama`` a PreNorm run is written as a plain ``LlamaForCausalLM`` instead (no remote
code): the reference model with a PreNorm stream is Llama's architecture (rotate-half RoPE,
grouped-query attention, SwiGLU, RMSNorm, no biases), each weight renamed (``LLAMA_NAMES``), the
stream's effective epsilon as ``rms_norm_eps``, a tied embedding as ``tie_word_embeddings``. The checkpoint
may come from any layout: one process's, or the shards of a pipelined or FSDP2 run, read here in
one process. ``OUT`` is checked before any work (``destination.check_destination``: a run's
folder, live or finished, and files export does not write are refused; a model folder unless
``overwrite``), held with its lock while it is written, written beside itself and renamed into
place when complete. A run that
continued a folder's model (``train --from``) is written as that folder's architecture, with its
tokenizer (``training.export_folder_run``).
"""

from __future__ import annotations

from pathlib import Path

from ..files import replace_folder
from ..train.checkpoint import latest_checkpoint, load_checkpoint
from ..train.run_files import load_run_config
from .destination import check_destination, held
from .tokenizer import BYTE_VOCAB


#: the export's formats: attnres's own classes, or a PreNorm run as Llama
FORMATS = ("attnres", "llama")
#: a PreNorm reference model's weights -> Llama's (``{i}``: the layer; ``{n}``: the stream's norm
#: index, ``2i`` before attention and ``2i + 1`` before the MLP)
LLAMA_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attn.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attn.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attn.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attn.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "stream.norms.{2i}.weight": "model.layers.{i}.input_layernorm.weight",
    "stream.norms.{2i+1}.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "stream.final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def llama_weights(weights: dict, n_layers: int) -> dict:
    """A PreNorm reference model's ``weights`` under Llama's names (``LLAMA_NAMES``), every one
    renamed: ``ValueError`` naming any that has no Llama name."""
    names = {}
    for ours, theirs in LLAMA_NAMES.items():
        if "{i}" not in theirs:
            names[ours] = theirs
            continue
        for i in range(n_layers):
            ours_i = ours.replace("{2i+1}", str(2 * i + 1)).replace("{2i}", str(2 * i)).replace("{i}", str(i))
            names[ours_i] = theirs.replace("{i}", str(i))
    left = sorted(set(weights) - set(names))
    if left:
        raise ValueError(f"weights with no Llama name: {left[:4]}")
    return {names[name]: tensor for name, tensor in weights.items()}


def llama_config(config):
    """The ``LlamaConfig`` of a PreNorm reference model's ``ModelConfig``; ``ValueError`` naming
    what Llama's architecture has no place for (another residual design, MoE MLPs)."""
    from transformers import LlamaConfig

    if config.residual != "prenorm":
        raise ValueError(f"--format llama writes Llama's architecture, whose residual is PreNorm's; this run's "
                         f"model.residual={config.residual!r} (export it with --format attnres)")
    if config.moe_experts:
        raise ValueError(f"--format llama writes Llama's dense MLPs; this run has model.moe_experts="
                         f"{config.moe_experts} (export it with --format attnres)")
    return LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_dim,
                       num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
                       num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim,
                       max_position_embeddings=config.max_seq_len, rope_theta=config.rope_theta,
                       rms_norm_eps=config.stream_eps, tie_word_embeddings=config.tie_embeddings,
                       attention_bias=False, mlp_bias=False, hidden_act="silu", bos_token_id=None,
                       eos_token_id=None, pad_token_id=None)


def export_run(run_dir: str | Path, out: str | Path, *, overwrite: bool = False, format: str = "attnres",
               source: str | Path | None = None) -> dict:
    """Write run ``run_dir``'s latest checkpoint to ``out``; returns ``{"step", "parameters",
    "checkpoint"}``. Refused, naming the reason: a folder that holds no run or no checkpoint,
    a run on a BPE tokenizer or with a vocabulary other than the bytes' (a run on token files
    with ``model.vocab_size=1000``: the exported folder carries the byte tokenizer, which
    would neither cover the model's tokens nor mean what its token ids meant), an ``out``
    inside the run, under a file or holding files (without ``overwrite``). ``format``: one of
    ``FORMATS``; ``llama`` takes PreNorm runs only (``llama_config``). ``source``: for a run that
    continued a folder's model, the place that folder moved to (``--source``)."""
    from .reference_lm import AttnResConfig, AttnResForCausalLM
    from .tokenizer import byte_tokenizer

    if format not in FORMATS:
        raise ValueError(f"--format {format!r} is not one of {FORMATS}")
    run_dir, out = Path(run_dir), Path(out)
    cfg = load_run_config(run_dir)
    if cfg.init_from is not None:  # a run that continued a folder's model goes back to that architecture
        if format != "attnres":
            raise ValueError(f"--format {format!r} applies to attnres's own runs; {run_dir} continued the model of "
                             f"{cfg.init_from} and is exported as that folder's architecture: leave --format out")
        from .training import export_folder_run

        return export_folder_run(run_dir, out, cfg, overwrite, source)
    if source is not None:
        raise ValueError(f"--source {source} gives the new place of the folder a run continued (train --from); "
                         f"{run_dir} built its own model: leave --source out")
    if format == "llama":
        llama_config(cfg.model)  # refused before any weight is read
    if cfg.data.tokenizer != "byte":
        raise ValueError(f"{run_dir} trained on data.tokenizer={cfg.data.tokenizer!r}; export writes the byte "
                         f"tokenizer with the model, so it takes byte-level runs only")
    if cfg.model.vocab_size != BYTE_VOCAB:
        raise ValueError(f"{run_dir}'s model has model.vocab_size={cfg.model.vocab_size} tokens, and export writes "
                         f"the byte tokenizer of {BYTE_VOCAB} with the model: it takes byte-level runs only (a run "
                         f"on token files needs the tokenizer that made them)")
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        raise ValueError(f"{run_dir} has no checkpoint to export")
    check_destination(run_dir, out, overwrite)
    with held(run_dir, out, overwrite):
        weights, state = load_checkpoint(checkpoint, cfg.model)
        if format == "llama":
            from transformers import LlamaForCausalLM

            model = LlamaForCausalLM(llama_config(cfg.model))
            model.load_state_dict(llama_weights(weights, cfg.model.n_layers))
        else:
            model = AttnResForCausalLM(AttnResConfig.from_model_config(cfg.model))
            model.model.load_state_dict(weights)

        def fill(folder: Path) -> None:
            model.save_pretrained(str(folder))
            byte_tokenizer().save_pretrained(str(folder))

        replace_folder(out, fill)
    return dict(step=state["step"], parameters=sum(p.numel() for p in model.parameters()),
                checkpoint=str(checkpoint))
