"""Identity-preserving conversion of a pretrained causal LM of one of the source architectures
(``architectures.SOURCES``: dense ones and mixtures of experts) to Delta AttnRes (docs/METHOD.md
section 5).

The converted model keeps the source architecture's own modules (embeddings, attention with its
head_dim, q/k norms, biases and rotary scaling, MLP or sparse MoE block with its router and
experts, norms, head); attnres's delta stream routes around them. The stream's new parameters (pseudo-queries, key gains, null source, scalar gates)
start at zero and unit gains, so at step 0 the converted model computes exactly what the source
computed; the base weights are untouched.

Each source architecture gets its own config class (``model_type = "attnres_<source>"``, the
source's fields plus ``delta_heads`` and ``delta_block_layers``) and model class, registered
with the Auto classes when ``attnres.hf`` is imported.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import torch
from huggingface_hub.dataclasses import strict
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from .. import architectures
from ..files import read_json, replace_folder
from ..streams import DeltaAttnResStream
from ..streams.delta import check_routing_options, converted_routing
from ..streams.sublayers import run_sublayers
from .destination import TOKENIZER_FILES, check_destination, held


def _source_classes(source: architectures.Source) -> tuple[type, type]:
    module = importlib.import_module(source.transformers_module)
    return getattr(module, source.config_class), getattr(module, source.causal_lm_class)


#: the source architectures (``architectures.SOURCES``) -> their ``transformers`` configuration
#: and causal LM classes
SOURCES = {model_type: _source_classes(source) for model_type, source in architectures.SOURCES.items()}


class DeltaRoutingForCausalLM:
    """The forward pass shared by every converted architecture (mixed into its causal LM).

    A pass that continues from a cache that already holds earlier tokens, with autograd off (each
    step of ``generate`` after the prompt), runs as a decode pass: the routing's decoder
    (``DeltaAttnResStream.decoder``) runs it where its backend decodes; any other pass is an
    ordinary one."""

    def _init_routing(self, config) -> None:
        self.routing = converted_routing(config)

    def _masks(self, inputs_embeds, attention_mask, cache, position_ids) -> list:
        kwargs = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                      cache=cache, position_ids=position_ids)
        n = self.config.num_hidden_layers
        if architectures.SOURCES[self.config.model_type.removeprefix("attnres_")].one_mask:
            fn = create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask
            return [fn(**kwargs)] * n
        types = getattr(self.config, "layer_types", None) or ["full_attention"] * n
        full = create_causal_mask(**kwargs)
        sliding = create_sliding_window_causal_mask(**kwargs) if "sliding_attention" in types else None
        return [sliding if t == "sliding_attention" else full for t in types]

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs) -> CausalLMOutputWithPast:
        base = self.model
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = base.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        seen = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + seen).unsqueeze(0)
        masks = self._masks(inputs_embeds, attention_mask, cache, position_ids)
        position_embeddings = base.rotary_emb(inputs_embeds, position_ids)
        decode = seen > 0 and not torch.is_grad_enabled()
        stream = self.routing.decoder(inputs_embeds) if decode else self.routing
        layers = base.layers[: self.config.num_hidden_layers]

        def sublayer(i: int, h: torch.Tensor) -> torch.Tensor:  # the source's own norms, then its sublayer
            l, layer = i >> 1, layers[i >> 1]
            if i % 2:
                return layer.mlp(layer.post_attention_layernorm(h))
            attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), attention_mask=masks[l],
                                      position_ids=position_ids, cache=cache, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
            return attn

        state = run_sublayers(stream, stream.init(inputs_embeds), sublayer, 0, 2 * len(layers))
        hidden = base.norm(stream.output(state))
        logits = self.lm_head(slice_logits_to_keep(hidden, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)


def _make_classes(source: str):
    config_cls, model_cls = SOURCES[source]
    architecture = architectures.SOURCES[source]

    config = strict(type(f"AttnRes{architecture.config_class}", (config_cls,), {
        "__module__": __name__,
        "__annotations__": {"delta_heads": int, "delta_block_layers": int | list[int]},
        "model_type": architecture.converted_type,
        "delta_heads": 8,
        "delta_block_layers": 4,
        "__doc__": f"{config_cls.__name__} plus the Delta AttnRes routing: delta_heads, delta_block_layers.",
    }))

    def __init__(self, cfg):
        model_cls.__init__(self, cfg)
        self._init_routing(cfg)

    def _init_weights(self, module):
        if isinstance(module, DeltaAttnResStream):
            module.reset_parameters()  # zero queries, null and gates; unit key gains
        else:
            model_cls._init_weights(self, module)

    model = type(architecture.converted_class, (DeltaRoutingForCausalLM, model_cls), {
        "__module__": __name__,
        "config_class": config,
        "__init__": __init__,
        "_init_weights": _init_weights,
        "__doc__": f"{model_cls.__name__} with Delta AttnRes routing around its sublayers; a pass that continues "
                   f"from a cache holding earlier tokens, with autograd off, is a decode pass.",
    })
    return config, model


CONVERTED = {source: _make_classes(source) for source in SOURCES}


def register() -> None:
    """The converted types with the Auto classes; a source whose checkpoints ``transformers``
    converts on load and back on save (Mixtral's and Qwen3-MoE's per-expert weights, fused in
    memory) lends its conversion to its converted type, so that a converted folder holds its
    weights under the source's names, as other tools (vLLM) read them."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

    for source, (config, model) in CONVERTED.items():
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModelForCausalLM.register(config, model, exist_ok=True)
        mapping = get_checkpoint_conversion_mapping(source)
        if mapping is not None:
            register_checkpoint_conversion_mapping(config.model_type, mapping, overwrite=True)


def routing_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The parameters the conversion added (``routing.*``)."""
    return {n: p for n, p in model.named_parameters() if n.startswith("routing.")}


def freeze_base(model) -> None:
    """Train only the routing: every parameter but ``routing.*`` stops requiring gradients."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("routing."))


def convert(source, *, heads: int = 8, block_layers: int | list[int] = 4, defaulted=()):
    """Convert a causal LM of a source architecture (``architectures.SOURCES``; a model or a local
    path) to Delta AttnRes. ``defaulted``: the routing options left at their defaults, which a refusal
    says so of (``check_routing_options``).

    Returns the converted model, in the source's dtype, with the source's weights and
    zero-initialized routing.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not (path / "config.json").exists():
            raise ValueError(f"{path} is not a local Hugging Face model folder (config.json missing)")
        check_source_config(path / "config.json")
        try:
            config = AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path / 'config.json'} does not load as a model config ({_first_line(exc)})") from None
        check_routing_options(config, heads, block_layers, defaulted)  # before the weights load
        try:
            source = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto")
        except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
            raise ValueError(f"the weights in {path} do not load as the model its config.json describes "
                             f"({_first_line(exc)})") from None
    model_type = getattr(source.config, "model_type", None)
    if model_type not in SOURCES or not hasattr(source, "lm_head"):
        raise ValueError(
            f"cannot convert model_type={model_type!r} ({type(source).__name__}); supported decoder "
            f"causal LMs: {sorted(SOURCES)}"
        )
    config_cls, model_cls = CONVERTED[model_type]
    fields = source.config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
        fields.pop(key, None)
    if isinstance(block_layers, tuple):  # the config's field holds a number or a list
        block_layers = list(block_layers)
    config = config_cls(**fields, delta_heads=heads, delta_block_layers=block_layers)
    converted = model_cls(config)
    missing, unexpected = converted.load_state_dict(source.state_dict(), strict=False)
    added = set(routing_parameters(converted))
    if unexpected or set(missing) - added:
        raise ValueError(f"conversion left weights unmatched: missing {sorted(set(missing) - added)}, unexpected {unexpected}")
    converted.routing.reset_parameters()
    dtype = next(source.parameters()).dtype
    return converted.to(dtype).eval() if not source.training else converted.to(dtype)


#: what a source's config.json must hold (positive integers) besides ``model_type``
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def check_source_config(path: Path) -> None:
    """``ValueError`` naming ``path`` unless it is a JSON object of a supported ``model_type``
    holding the sizes (``REQUIRED_FIELDS``) as positive integers: a missing size would be read
    as the architecture's default, a model other than the weights'."""
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds {type(config).__name__}, not a model config")
    model_type = config.get("model_type")
    if model_type not in SOURCES:
        raise ValueError(f"{path}: model_type={model_type!r}; supported decoder causal LMs: {sorted(SOURCES)}")
    for name in REQUIRED_FIELDS:
        if name not in config:
            raise ValueError(f"{path} lacks {name}: a missing size would be read as the architecture's default")
        if type(config[name]) is not int or config[name] < 1:
            raise ValueError(f"{path}: {name}={config[name]!r} must be a positive integer")


def save_with_tokenizer(model, src: Path, dst: Path) -> None:
    """``model`` and the tokenizer files of folder ``src`` (``TOKENIZER_FILES``) written to
    ``dst`` through ``replace_folder``: beside it, renamed into place when complete."""
    def fill(folder: Path) -> None:
        model.save_pretrained(str(folder))
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, folder / name)

    replace_folder(dst, fill)


def convert_checkpoint(src: str | Path, dst: str | Path, *, heads: int = 8, block_layers: int | list[int] = 4,
                       overwrite: bool = False, defaulted=()) -> dict:
    """Convert the model in folder ``src`` and save it to ``dst`` with the source's tokenizer
    files; returns ``{"added_parameters", "base_parameters", "model_type"}``.

    The destination is checked before any work (``check_destination``: ``overwrite`` replaces
    only a model folder) and held with its lock while the model is made and written
    (``destination.held``). The model is written to a temporary folder beside ``dst`` and renamed
    into place when complete, so an interrupted conversion leaves ``dst`` as it was; with
    ``overwrite`` the old ``dst`` goes only then."""
    src, dst = Path(src), Path(dst)
    check_destination(src, dst, overwrite)
    with held(src, dst, overwrite):
        model = convert(src, heads=heads, block_layers=block_layers, defaulted=defaulted)
        save_with_tokenizer(model, src, dst)
    added = sum(p.numel() for p in routing_parameters(model).values())
    return {"added_parameters": added, "base_parameters": sum(p.numel() for p in model.parameters()) - added,
            "model_type": model.config.model_type}
