"""Decoding: the KV cache, the choice of each next token, and generation, which runs the prompt
once and then each new token as a decode pass (``Transformer.forward(decode=True)``).
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache:
    """Keys and values of every layer, ``[n_layers, B, n_kv_heads, max_len, head_dim]``."""

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, *, dtype, device):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store ``k``, ``v`` ``[B, Hkv, T, hd]`` at positions ``start..start+T`` and return all
        keys and values so far."""
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


#: how many tokens ``generate`` adds when not told, where the context has room
DEFAULT_NEW_TOKENS = 200


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int | None = None, temperature: float = 0.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue ``prompt`` ``[B, T]`` by ``max_new_tokens`` tokens of ``model`` (a ``Transformer``:
    its ``config``, ``new_cache`` and decode pass) with a KV cache; returns
    ``[B, T + max_new_tokens]``. ``temperature=0`` is greedy; ``top_k`` keeps the k likeliest.
    ``max_new_tokens=None``: ``DEFAULT_NEW_TOKENS``, or as many as the context has room for.
    A prompt and request longer than ``max_seq_len`` are refused (no sliding window). Each
    token after the prompt runs as a decode pass (``forward(decode=True)``)."""
    config = model.config
    T = prompt.shape[-1]
    if prompt.ndim != 2 or T == 0:
        raise ValueError(f"prompt must be token ids [batch, length] with length >= 1, given shape {tuple(prompt.shape)}")
    if max_new_tokens is None:
        if T >= config.max_seq_len:
            raise ValueError(f"prompt length {T} leaves no room in the context: max_seq_len={config.max_seq_len}")
        max_new_tokens = min(DEFAULT_NEW_TOKENS, config.max_seq_len - T)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if not temperature >= 0 or temperature == float("inf"):  # NaN fails both comparisons
        raise ValueError(f"temperature={temperature} must be a finite number >= 0")
    if top_k is not None and not 1 <= top_k <= config.vocab_size:
        raise ValueError(f"top_k={top_k} must be in [1, {config.vocab_size}]")
    B, T = prompt.shape
    total = T + max_new_tokens
    if total > config.max_seq_len:
        raise ValueError(
            f"prompt length {T} + max_new_tokens {max_new_tokens} exceeds max_seq_len={config.max_seq_len}"
        )
    out = [prompt]
    if max_new_tokens == 0:
        return prompt
    cache = model.new_cache(B, total)
    logits = model(prompt, cache=cache, start_pos=0)[:, -1]
    for step in range(max_new_tokens):
        next_token = sample(logits, temperature, top_k, generator)
        out.append(next_token)
        if step + 1 < max_new_tokens:
            logits = model(next_token, cache=cache, start_pos=T + step, decode=True)[:, -1]
    return torch.cat(out, dim=1)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ``[B, 1]`` from logits ``[B, V]``: argmax at temperature 0, else sampled."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
