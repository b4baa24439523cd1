"""``attnres convert``'s Delta AttnRes models in vLLM: the source architecture's own vLLM model
(its embedding, attention with its rotary scaling, q/k norms and biases, MLP or sparse MoE
block, norms and head, and its weight loading), with the Delta routing between its sublayers.

vLLM passes the tokens of every request flat, ``[N]``; the routing runs on them as one row
``[1, N, D]`` (per token, so exact), through its decoder with autograd off, each layer's norms
applied to what the routing reads (``own_norms=False``), as
``attnres.hf.convert.DeltaRoutingForCausalLM`` does.
"""

from __future__ import annotations

import importlib

import torch

from ..architectures import SOURCES, Source
from ..streams.delta import converted_routing
from ..streams.sublayers import run_sublayers

#: the converted architectures' class names -> their source (``architectures.SOURCES``)
SOURCE_MODELS = {source.converted_class: source for source in SOURCES.values()}


class DeltaRouting:
    """The forward pass shared by every converted architecture (mixed into vLLM's causal LM of
    its source, whose ``__init__`` builds the base model)."""

    #: the attribute of vLLM's decoder layer that holds its MLP or sparse MoE block (``Source.vllm_mlp``)
    mlp_attribute = "mlp"

    def _init_routing(self, vllm_config) -> None:
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError(f"converted attnres models are served on one device: tensor_parallel_size="
                             f"{parallel.tensor_parallel_size}, pipeline_parallel_size="
                             f"{parallel.pipeline_parallel_size}; both must be 1")
        self.routing = converted_routing(vllm_config.model_config.hf_config)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The final normalized hidden states ``[N, D]`` of the flat batch ``input_ids`` ``[N]``."""
        base = self.model
        x = inputs_embeds if inputs_embeds is not None else base.embed_input_ids(input_ids)
        x = x[None]
        routing = self.routing.decoder(x) if not torch.is_grad_enabled() else self.routing
        layers = list(base.layers)

        def sublayer(i: int, h: torch.Tensor) -> torch.Tensor:  # the flat row [1, N, D] as vLLM's [N, D]
            layer = layers[i >> 1]
            if i % 2:
                return getattr(layer, self.mlp_attribute)(layer.post_attention_layernorm(h[0]))[None]
            return layer.self_attn(positions=positions, hidden_states=layer.input_layernorm(h[0]))[None]

        state = run_sublayers(routing, routing.init(x), sublayer, 0, 2 * len(layers))
        return base.norm(routing.output(state)[0])


def _make_class(source: Source) -> type:
    base = getattr(importlib.import_module(source.vllm_module), source.causal_lm_class)

    def __init__(self, *, vllm_config, prefix: str = ""):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self._init_routing(vllm_config)

    return type(source.converted_class, (DeltaRouting, base), {
        "__module__": __name__,
        "__init__": __init__,
        "mlp_attribute": source.vllm_mlp,
        "__doc__": f"vLLM's {source.causal_lm_class} with Delta AttnRes routing around its sublayers.",
    })


def __getattr__(name: str):
    """``AttnRes<Source>ForCausalLM``, built when vLLM asks for it (the plugin registers the
    ``module:Class`` form, so only the served source's vLLM module is imported)."""
    if name in SOURCE_MODELS:
        cls = globals()[name] = _make_class(SOURCE_MODELS[name])
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
