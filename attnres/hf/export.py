"""``attnres export RUN_DIR OUT``: a training run's latest checkpoint as a Hugging Face folder.

The folder is what ``AttnResForCausalLM.save_pretrained`` writes (``config.json`` with
``model_type: attnres``, ``model.safetensors``) and the byte tokenizer's files: the form
``attnres eval``, ``transformers``' ``from_pretrained`` and serving engines load. The checkpoint
may come from any layout: one process's, or the shards of a pipelined or FSDP2 run, read here in
one process. ``OUT`` is checked before any work (a folder with files is refused unless
``overwrite``), written beside itself and renamed into place when complete.
"""

from __future__ import annotations

from pathlib import Path

from ..files import replace_folder
from ..train.checkpoint import latest_checkpoint, load_checkpoint
from ..train.run_dir import load_run_config
from .convert import check_destination
from .tokenizer import BYTE_VOCAB


def export_run(run_dir: str | Path, out: str | Path, *, overwrite: bool = False) -> dict:
    """Write run ``run_dir``'s latest checkpoint to ``out``; returns ``{"step", "parameters",
    "checkpoint"}``. Refused, naming the reason: a folder that holds no run or no checkpoint,
    a run on a BPE tokenizer or with a vocabulary other than the bytes' (a run on token files
    with ``model.vocab_size=1000``: the exported folder carries the byte tokenizer, which
    would neither cover the model's tokens nor mean what its token ids meant), an ``out``
    inside the run, under a file or holding files (without ``overwrite``)."""
    from .native import AttnResConfig, AttnResForCausalLM
    from .tokenizer import byte_tokenizer

    run_dir, out = Path(run_dir), Path(out)
    cfg = load_run_config(run_dir)
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
    weights, state = load_checkpoint(checkpoint, cfg.model)
    model = AttnResForCausalLM(AttnResConfig.from_model_config(cfg.model))
    model.model.load_state_dict(weights)

    def fill(folder: Path) -> None:
        model.save_pretrained(str(folder))
        byte_tokenizer().save_pretrained(str(folder))

    replace_folder(out, fill)
    return dict(step=state["step"], parameters=sum(p.numel() for p in model.parameters()),
                checkpoint=str(checkpoint))
