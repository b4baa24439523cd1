"""Training a Hugging Face folder's model with attnres's own trainer (``attnres train --from``).

``saved_model(path)`` reads a folder ``attnres convert`` takes (a source architecture of
``architectures.SOURCES``), one it writes (``attnres_<source>``) or a dense ``attnres export`` and
hands the trainer a ``train.saved_model.SavedModel``: the trainer builds the model through it
and never imports ``transformers``. ``export_folder_run`` writes such a run's latest checkpoint
back as a folder of the architecture it came from, with the source folder's tokenizer.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .. import architectures
from ..streams import Stream
from ..train.saved_model import SavedModel
from ..train.source_digest import check_source, folder_digest
from .convert import save_with_tokenizer
from .destination import check_destination, held

#: the folder model types whose forward returns a router's balance loss: the MoE sources and their conversions
MOE_TYPES = (*(s.model_type for s in architectures.SOURCES.values() if s.moe),
             *(s.converted_type for s in architectures.SOURCES.values() if s.moe))
#: what a checkpoint calls the folder's model: its weights are named ``lm.<the folder's names>``
PREFIX = "lm."


def balance_loss_function(model_type: str):
    """The source architecture's own balance loss (Switch Transformer's, over every MoE layer's
    router logits), from its ``transformers`` module (``Source.balance_loss``) for a source's
    ``model_type`` or its conversion's."""
    module, _, function = architectures.SOURCES[model_type.removeprefix("attnres_")].balance_loss.partition(":")
    return getattr(importlib.import_module(module), function)


class FolderLM(nn.Module):
    """A ``transformers`` causal LM as the trainer calls a model: token ids ``[B, T]`` in,
    logits ``[B, T, V]`` out; for a mixture of experts ``(logits, balance)``, ``balance`` the
    source architecture's balance loss (unweighted: the trainer weighs it by the folder's
    ``router_aux_loss_coef``, ``SavedModel.balance_weight``). The router logits are read by hooks on the routers, because a converted
    model's forward calls each MoE block itself and the source's recording of them (through its
    base model's forward) never runs; a source and its conversion so compute it alike."""

    def __init__(self, lm: nn.Module, moe: bool):
        super().__init__()
        self.lm, self.moe = lm, moe
        self._router_logits: list[torch.Tensor] = []
        self._hooks = []
        if moe:
            self._balance = balance_loss_function(lm.config.model_type)
            for module in lm.modules():
                if type(module).__name__.endswith("TopKRouter"):
                    self._hooks.append(module.register_forward_hook(
                        lambda _m, _i, out: self._router_logits.append(out[0])))

    def remove_hooks(self) -> None:
        """Take the router hooks off ``lm`` (a model that lives on after its training)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def forward(self, input_ids: torch.Tensor):
        if not self.moe:
            return self.lm(input_ids=input_ids, use_cache=False).logits
        self._router_logits.clear()
        logits = self.lm(input_ids=input_ids, use_cache=False).logits
        balance = self._balance(tuple(self._router_logits), self.lm.num_experts, self.lm.num_experts_per_tok)
        self._router_logits.clear()
        return logits, balance


def decoder_layers(model: FolderLM) -> list[nn.Module]:
    """The units FSDP2 gathers one at a time: the modules whose forward runs. A source's
    decoder layers run whole; a converted model's forward calls each layer's attention, MLP and
    norms itself (the routing reads between them), so its units are the attention and the MLP
    (the norms stay with the whole model's unit); an attnres export's are its ``Transformer``'s
    sublayers."""
    inner = model.lm.model
    if hasattr(inner, "stream"):  # attnres's own Transformer
        return [m for layer in inner.layers for m in (layer.attn, layer.mlp)]
    if hasattr(model.lm, "routing"):  # a converted model
        return [m for layer in inner.layers for m in (layer.self_attn, layer.mlp)]
    return list(inner.layers)


def read_config(path: Path, given: str = "--from"):
    """The folder's config, its model type one ``train --from`` takes (``ValueError`` naming it as
    ``given``: the option, or a run's saved ``init_from`` when the run is resumed or exported)."""
    import attnres.hf  # noqa: F401  (registers the attnres and attnres_<source> model types)

    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"{given} {path}: not a model folder (no config.json); give a Hugging Face model's folder "
                         f"(attnres convert, attnres export, or a {architectures.titles()} folder)")
    if (path / "checkpoints").is_dir():
        raise ValueError(f"{given} {path} is a training run's folder: continue it with attnres train --resume "
                         f"--run-dir {path}, or export it first (attnres export {path} OUT)")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, KeyError) as exc:
        raise ValueError(f"{given} {path}: its config.json does not load ({str(exc).splitlines()[0][:200]})") from None
    accepted = (*architectures.SOURCES, *(s.converted_type for s in architectures.SOURCES.values()), "attnres")
    if config.model_type not in accepted:
        raise ValueError(f"{given} {path}: model_type={config.model_type!r}; train --from takes {sorted(accepted)}")
    if config.model_type == "attnres" and config.model_config().moe_experts:
        raise ValueError(f"{given} {path}: an attnres mixture-of-experts export; continue its training run with "
                         f"attnres train --resume (its balance bias and statistics are the run's)")
    return config


def saved_init_from(run_dir: Path) -> str:
    """How errors name a run's saved source folder (``read_config``'s ``given``) when the run is
    resumed or exported rather than started with ``--from``."""
    return f"the run's init_from ({Path(run_dir) / 'config.json'})"


def saved_model(path: str | Path, given: str = "--from") -> SavedModel:
    """The model in folder ``path`` as the trainer takes it (``SavedModel``); its sizes are read
    from its config alone (the weights load when the trainer builds it). ``given`` names the
    path in errors (``read_config``)."""
    path = Path(path).expanduser().resolve()
    config = read_config(path, given)
    moe = config.model_type in MOE_TYPES
    with torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in shape.parameters())  # a tied weight is one parameter
    routing = sum(len(m.routing_parameters()) for m in shape.modules() if isinstance(m, Stream))
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(path))

    def build(device: torch.device) -> FolderLM:
        lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        return FolderLM(lm, moe).to(device).train()

    return SavedModel(path, config.model_type, config.vocab_size, config.max_position_embeddings, parameters,
                       config.router_aux_loss_coef if moe else None, build, decoder_layers, tokenizer,
                       folder_digest(path), routing)


def export_folder_run(run_dir: Path, out: Path, cfg, overwrite: bool = False, source: str | Path | None = None) -> dict:
    """Write the latest checkpoint of ``run_dir``, a run that continued the model of folder
    ``cfg.init_from``, to ``out`` as a folder of that architecture, with the source folder's
    tokenizer files; returns ``{"step", "parameters", "checkpoint"}``. The source folder must
    hold the model the run started from (``source_digest.check_source``); ``source`` is the place
    it moved to (``--source``). A checkpoint that does not fit the folder's model (a run saved
    before the digest existed, its folder replaced since) is refused naming the first weight."""
    from ..train.checkpoint import is_sharded, latest_checkpoint, load_checkpoint, load_problem, load_train_state
    from ..train.sharded import read_weights

    cfg = check_source(cfg, saved_init_from(run_dir), f"attnres export {run_dir} {out} --source DIR",
                       "train a new run from the folder (attnres train --from MODEL_DIR)", source)
    source = Path(cfg.init_from)
    config = read_config(source, saved_init_from(run_dir))
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        raise ValueError(f"{run_dir} has no checkpoint to export")
    check_destination(run_dir, out, overwrite)
    with held(run_dir, out, overwrite):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if is_sharded(checkpoint):  # the shards of a run under torchrun, read whole in this process
            state = load_train_state(checkpoint)
            weights = read_weights(checkpoint, None, FolderLM(model, config.model_type in MOE_TYPES))
        else:
            weights, state = load_checkpoint(checkpoint)
        if not all(k.startswith(PREFIX) for k in weights):
            raise ValueError(f"{checkpoint}: its weights are not a folder model's (names under {PREFIX!r})")
        try:
            model.load_state_dict({k.removeprefix(PREFIX): v for k, v in weights.items()})
        except RuntimeError as exc:
            raise ValueError(f"{checkpoint}: its weights do not fit the model of {source} ({load_problem(exc)}): "
                             f"that folder is not the one the run started from; put the run's source back there"
                             ) from None
        save_with_tokenizer(model, source, out)
    return dict(step=state["step"], parameters=sum(p.numel() for p in model.parameters()), checkpoint=str(checkpoint))
