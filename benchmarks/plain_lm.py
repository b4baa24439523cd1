"""A plain nanoGPT-style PreNorm LM with the reference model's shapes, written without streams:
the yardstick that shows the project's own PreNorm baseline carries no overhead."""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F

from attnres.model import apply_rope, rope_tables


class PlainBlock(nn.Module):
    def __init__(self, dim, n_heads, ffn_dim):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False)  # fused q, k, v
        self.c_proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-6)
        self.w13 = nn.Linear(dim, 2 * ffn_dim, bias=False)  # fused gate and up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        q, k, v = self.c_attn(self.attn_norm(x)).view(B, T, 3, self.n_heads, D // self.n_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, D))
        a, b = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(a) * b)


class PlainLM(nn.Module):
    def __init__(self, vocab_size, dim, n_layers, n_heads, ffn_dim, max_seq_len):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, n_heads, ffn_dim) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        cos, sin = rope_tables(dim // n_heads, max_seq_len, 10000.0)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)

    def loss(self, tokens, targets):
        T = tokens.shape[1]
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x, self.cos[:T], self.sin[:T])
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
