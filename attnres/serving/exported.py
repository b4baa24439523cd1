"""attnres's own model in vLLM: ``AttnResForCausalLM`` of an ``attnres export`` folder, every
residual design.

The model keeps the reference ``Transformer``'s modules and names (``model.tok_embeddings``,
``model.layers.{l}.attn.wq`` ..., ``model.stream``, ``model.lm_head``), so the folder's
safetensors load by name; only the attention's score computation is vLLM's (``PagedAttention``:
its paged KV cache, shared by the requests of a continuous batch). vLLM passes the tokens of
every request flat, ``[N]`` with their ``positions`` ``[N]``; the stream runs on them as one row
``[1, N, D]`` through its decoder (with autograd off, as vLLM runs; the ordinary pass where a
design has none), which is exact because every design's routing is per token.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..model import Attention, ModelConfig, TransformerParts, apply_rope, mlp
from ..streams.sublayers import run_sublayers


class PagedAttention(Attention):
    """``model.Attention``'s projections and RoPE around vLLM's paged attention.

    ``x`` ``[N, D]`` (the flat batch), ``cos``/``sin`` ``[N, head_dim]`` (each token's RoPE row)
    -> ``[N, D]``. The KV cache is vLLM's, bound to the layer named ``prefix``."""

    def __init__(self, config: ModelConfig, cache_config, prefix: str):
        super().__init__(config)
        from vllm.model_executor.layers.attention import Attention as VllmAttention

        self.paged = VllmAttention(self.n_heads, self.head_dim, self.head_dim ** -0.5, num_kv_heads=self.n_kv_heads,
                                   cache_config=cache_config, prefix=f"{prefix}.paged")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        N = x.shape[0]
        q = self.wq(x).view(N, self.n_heads, self.head_dim)
        k = self.wk(x).view(N, self.n_kv_heads, self.head_dim)
        v = self.wv(x)
        cos, sin = cos[:, None], sin[:, None]  # one row per token, broadcast over heads
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.wo(self.paged(q.reshape(N, -1), k.reshape(N, -1), v))


class Layer(nn.Module):
    """One transformer layer: attention (``PagedAttention``) then the MLP (``model.mlp``)."""

    def __init__(self, config: ModelConfig, cache_config, prefix: str):
        super().__init__()
        self.attn = PagedAttention(config, cache_config, f"{prefix}.attn")
        self.mlp = mlp(config)


class Model(TransformerParts):
    """``Transformer``'s parts under its names, with ``Layer`` for its layers."""

    def __init__(self, config: ModelConfig, cache_config, prefix: str):
        super().__init__(config, lambda l: Layer(config, cache_config, f"{prefix}.layers.{l}"))

    def hidden_states(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The stream's output ``[N, D]`` for the embedded tokens ``x`` ``[N, D]`` at
        ``positions`` ``[N]``: the sublayer loop ``Transformer`` runs (``streams.sublayers``), on
        the tokens as one row (through the stream's decoder with autograd off)."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x, layers = x[None], list(self.layers)
        stream = self.stream.decoder(x) if not torch.is_grad_enabled() else self.stream

        def sublayer(i: int, h: torch.Tensor) -> torch.Tensor:
            layer = layers[i >> 1]
            return layer.attn(h[0], cos, sin)[None] if i % 2 == 0 else layer.mlp(h)

        return stream.output(run_sublayers(stream, stream.init(x), sublayer, 0, self.config.num_sublayers))[0]


def check_served(vllm_config) -> ModelConfig:
    """The folder's ``ModelConfig``; ``ValueError`` for what the plugin does not serve (tensor or
    pipeline parallel vLLM: the model's linears are not split)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError(f"attnres models are served on one device: tensor_parallel_size="
                         f"{parallel.tensor_parallel_size}, pipeline_parallel_size="
                         f"{parallel.pipeline_parallel_size}; both must be 1")
    fields = getattr(vllm_config.model_config.hf_config, "attnres", None)
    if not isinstance(fields, dict):
        raise ValueError("config.json has no 'attnres' model fields: not a folder of attnres's own model")
    return ModelConfig(**fields)


class AttnResForCausalLM(nn.Module):
    """vLLM's model class for ``architectures: ["AttnResForCausalLM"]``."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = check_served(vllm_config)
        self.config = vllm_config.model_config.hf_config
        self.model = Model(config, vllm_config.cache_config, f"{prefix}.model" if prefix else "model")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states ``[N, D]`` of the flat batch ``input_ids`` ``[N]``."""
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        return self.model.hidden_states(x, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self).load_weights(weights)  # a tied head: saved once, as the embedding
