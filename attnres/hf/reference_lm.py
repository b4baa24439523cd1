"""attnres's own models in Hugging Face form: ``AttnResConfig`` and ``AttnResForCausalLM``.

The causal LM wraps the reference ``Transformer`` (no second copy of the math) and speaks the
``transformers`` protocol: ``save_pretrained``/``from_pretrained`` through safetensors,
``generate`` with a ``DynamicCache`` (each step after the prompt a decode pass), ``labels`` for a
loss.
"""

from __future__ import annotations

import dataclasses

import torch
from huggingface_hub.dataclasses import strict
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from ..model import ModelConfig, Transformer, rope_tables


@strict
class AttnResConfig(PreTrainedConfig):
    """``attnres`` holds the ``ModelConfig`` fields; the usual Hugging Face size fields mirror them."""

    model_type = "attnres"
    attnres: dict | None = None
    vocab_size: int = 256
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    eos_token_id: int | None = 0
    pad_token_id: int | None = 0

    def __post_init__(self, **kwargs):
        if self.attnres is not None:
            mc = self.model_config()
            self.vocab_size, self.hidden_size = mc.vocab_size, mc.dim
            self.num_hidden_layers, self.num_attention_heads = mc.n_layers, mc.n_heads
            self.num_key_value_heads, self.max_position_embeddings = mc.n_kv_heads, mc.max_seq_len
            self.tie_word_embeddings = mc.tie_embeddings
        super().__post_init__(**kwargs)

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs) -> AttnResConfig:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls(attnres=fields, **kwargs)

    def model_config(self) -> ModelConfig:
        if self.attnres is None:
            raise ValueError("AttnResConfig has no 'attnres' model fields; build it with from_model_config")
        return ModelConfig(**self.attnres)


class _CacheAdapter:
    """Lets the reference attention write into a ``transformers`` cache."""

    def __init__(self, cache):
        self.cache = cache

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        return self.cache.update(k, v, layer)


class AttnResForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = AttnResConfig
    base_model_prefix = "model"
    _no_split_modules = ["Layer"]

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = Transformer(config.model_config())
        if config.tie_word_embeddings:
            self._tied_weights_keys = {"model.lm_head.weight": "model.tok_embeddings.weight"}
        self.post_init()

    def _init_weights(self, module):
        # The reference model initializes its own weights; only the RoPE tables, which are not
        # saved, are recomputed here (e.g. after a meta-device construction in from_pretrained).
        if isinstance(module, Transformer):
            c = module.config
            cos, sin = rope_tables(c.head_dim, c.max_seq_len, c.rope_theta)
            with torch.no_grad():
                module.rope_cos.copy_(cos)
                module.rope_sin.copy_(sin)

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def get_output_embeddings(self):
        return self.model.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs) -> CausalLMOutputWithPast:
        """Logits (and the loss, given ``labels``) of ``input_ids`` ``[B, T]``, continuing from
        ``cache`` when given. A pass that continues from a cache that already holds earlier tokens,
        with autograd off (each step of ``generate`` after the prompt), asks the reference model for
        a decode pass (``Transformer.forward(decode=True)``); any other pass is an ordinary one."""
        if inputs_embeds is not None:
            raise ValueError("AttnResForCausalLM takes input_ids, not inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("AttnResForCausalLM runs unpadded inputs only: attention_mask has zeros")
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        start = cache.get_seq_length() if cache is not None else 0
        if position_ids is not None and int(position_ids[0, 0]) != start:
            raise ValueError(f"position_ids start at {int(position_ids[0, 0])}, expected {start} (no padding)")
        hidden = self.model.hidden_states(
            input_ids, cache=_CacheAdapter(cache) if cache is not None else None, start_pos=start,
            decode=start > 0 and not torch.is_grad_enabled(),
        )
        logits = self.model.lm_head(slice_logits_to_keep(hidden, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
