"""The reference decoder LM: RoPE, grouped-query attention, SwiGLU, and any residual stream.

The transformer never knows which residual design it has::

    state = stream.init(embed(tokens))
    for i, sublayer in enumerate(sublayers):          # attn, mlp, attn, mlp, ...
        state = stream.write(state, i, sublayer(stream.read(state, i)))
    logits = lm_head(stream.output(state))

Parameter names do not depend on the stream: ``tok_embeddings``, ``layers.{l}.attn.{wq,wk,wv,wo}``,
``layers.{l}.mlp.{w1,w2,w3}``, ``stream.norms.{i}``, ``stream.final_norm``, ``lm_head``; a stream's
own parameters live under ``stream.``. With ``moe_experts > 0`` every MLP is a mixture of experts
(``moe.MoE``): ``layers.{l}.mlp.gate``, ``layers.{l}.mlp.{w1,w2,w3}`` stacked over experts,
``layers.{l}.mlp.shared.{w1,w2,w3}`` and the buffer ``layers.{l}.mlp.expert_bias``.

Its configuration is ``model_config.ModelConfig``; decoding (the KV cache, the choice of a token,
``generate``) is in ``generation.py``; ``ModelConfig``, ``KVCache``, ``sample`` and
``DEFAULT_NEW_TOKENS`` are imported from here too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from .generation import DEFAULT_NEW_TOKENS, KVCache, generate, sample  # noqa: F401
from .model_config import ModelConfig
from .moe import ExpertStats, MoE, SwiGLU
from .streams import Stream, Trace, build_stream
from .streams.sublayers import run_sublayers


#: positions whose rotary angles are computed at once (in float64: a block's temporaries, not
#: the whole context's, which for a long ``max_seq_len`` would be several times the tables)
ROPE_BLOCK = 1 << 16


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_len, head_dim]`` for the rotate-half RoPE convention (fp32), computed
    in float64 ``ROPE_BLOCK`` positions at a time into the tables (the same values as at once):
    building them takes about their own memory. On the meta device nothing is computed."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    cos = torch.empty(max_len, head_dim, dtype=torch.float32)
    sin = torch.empty(max_len, head_dim, dtype=torch.float32)
    if cos.is_meta:
        return cos, sin
    for start in range(0, max_len, ROPE_BLOCK):
        end = min(start + ROPE_BLOCK, max_len)
        angles = torch.outer(torch.arange(start, end, dtype=torch.float64), inv_freq)  # [t, hd/2]
        angles = torch.cat([angles, angles], dim=-1)  # [t, hd]
        cos[start:end] = angles.cos()
        sin[start:end] = angles.sin()
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, T, hd]`` by position; ``cos``/``sin`` ``[T, hd]``."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE through ``scaled_dot_product_attention``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x, cos, sin, cache: KVCache | None = None, layer: int = 0, start_pos: int = 0):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask, causal = None, True
        if cache is not None:
            k, v = cache.update(layer, start_pos, k, v)
            if start_pos > 0:
                causal = False
                if T > 1:  # a chunk after a prefix: query t sees keys up to start_pos + t
                    pos_q = torch.arange(start_pos, start_pos + T, device=x.device)
                    mask = pos_q[:, None] >= torch.arange(k.shape[2], device=x.device)[None, :]
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def mlp(config: ModelConfig) -> nn.Module:
    """The MLP sublayer: a SwiGLU of width ``ffn_dim``, or a mixture of experts."""
    if not config.moe_experts:
        return SwiGLU(config.dim, config.ffn_dim)
    return MoE(config.dim, config.moe_experts, config.moe_top_k, config.expert_hidden,
               shared_experts=config.moe_shared_experts, balance=config.moe_balance,
               bias_rate=config.moe_bias_rate, capacity=config.moe_capacity)


class Layer(nn.Module):
    """One transformer layer: two sublayers, attention then MLP. It owns no norms: the stream does."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn = Attention(config)
        self.mlp = mlp(config)


class TransformerParts(nn.Module):
    """The modules and buffers of attnres's own model, under the names its checkpoints and
    exports use: ``tok_embeddings``, ``layers`` (``make_layer(l)`` for each ``l``), ``stream``,
    ``lm_head`` (tied to the embedding where ``config.tie_embeddings``) and the RoPE tables
    ``rope_cos``/``rope_sin`` ``[max_seq_len, head_dim]``. Its hosts add the pass: the
    ``Transformer`` below, and vLLM's model (``serving/exported.py``), whose layers attend
    through vLLM's paged KV cache."""

    def __init__(self, config: ModelConfig, make_layer: Callable[[int], nn.Module]):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(make_layer(l) for l in range(config.n_layers))
        self.stream: Stream = build_stream(
            config.residual,
            dim=config.dim,
            num_sublayers=config.num_sublayers,
            eps=config.stream_eps,
            **config.stream_options(),
        )
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)


class Transformer(TransformerParts):
    """Decoder-only LM with a pluggable residual stream (``config.residual``).

    ``initialize=False`` leaves the weights as the modules' constructors made them, for a caller
    that runs ``init_weights`` itself (``train/materialize.py``: a distributed rank draws the
    values one process draws, for its part of the model only). A pipeline rank's model lacks the
    parts other ranks hold (``train/stage_local.py``): ``tok_embeddings``, ``lm_head`` and
    sublayers may be None there."""

    def __init__(self, config: ModelConfig, *, initialize: bool = True):
        super().__init__(config, lambda l: Layer(config))
        if initialize:
            self.init_weights()

    def init_weights(self) -> None:
        """The one place weights are initialized: N(0, init_std) for embeddings and projections,
        scaled by 1/sqrt(2 n_layers) for the projections that write into the residual (wo, w2);
        the stream initializes its own parameters (zero queries: uniform depth weights), but for
        those it asks to be drawn as projections (``Stream.normal_init_weights``)."""
        std = self.config.init_std
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for layer in self.layers:
            attn, mlp = layer.attn, layer.mlp
            inputs, outputs = [attn.wq.weight, attn.wk.weight, attn.wv.weight], [attn.wo.weight]
            if isinstance(mlp, SwiGLU):
                inputs += [mlp.w1.weight, mlp.w3.weight]
                outputs.append(mlp.w2.weight)
            else:  # routed experts, the router, then the shared experts
                inputs += [mlp.w1, mlp.w3, mlp.gate.weight]
                outputs.append(mlp.w2)
                if mlp.shared is not None:
                    inputs += [mlp.shared.w1.weight, mlp.shared.w3.weight]
                    outputs.append(mlp.shared.w2.weight)
                nn.init.zeros_(mlp.expert_bias)
            for weight in inputs:
                nn.init.normal_(weight, std=std)
            for weight in outputs:
                nn.init.normal_(weight, std=out_std)
        self.stream.reset_parameters()
        for weight in self.stream.normal_init_weights():
            nn.init.normal_(weight, std=std)

    def _check_tokens(self, tokens: torch.Tensor, start_pos: int) -> None:
        if tokens.ndim != 2 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(
                f"tokens must be an integer tensor [B, T], got {tokens.dtype} {tuple(tokens.shape)}"
            )
        if tokens.shape[0] == 0 or tokens.shape[1] == 0:
            raise ValueError(f"tokens {tuple(tokens.shape)}: an empty batch or sequence; give at least one token "
                             f"in each of at least one row")
        end = start_pos + tokens.shape[1]
        if end > self.config.max_seq_len:
            raise ValueError(
                f"sequence end {end} (start_pos={start_pos} + length {tokens.shape[1]}) exceeds "
                f"max_seq_len={self.config.max_seq_len}"
            )
        # A value check needs a device sync on accelerators; on the CPU it is one cheap reduction.
        if tokens.device.type == "cpu" and tokens.numel() and not torch.compiler.is_compiling():
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")

    def hidden_states(self, tokens, *, cache: KVCache | None = None, start_pos: int = 0, decode: bool = False,
                      trace: Trace | None = None, experts: ExpertStats | None = None) -> torch.Tensor:
        """The final normalized hidden state ``[B, T, D]`` (the stream's output); ``trace``
        records what analysis reads (``streams.Trace``), ``experts`` what the MoE layers route
        (``moe.ExpertStats``). ``decode=True``: a decode pass (``forward``)."""
        self._check_tokens(tokens, start_pos)
        T = tokens.shape[1]
        cos = self.rope_cos[start_pos : start_pos + T]
        sin = self.rope_sin[start_pos : start_pos + T]
        e = self.tok_embeddings(tokens)
        stream = self.stream.decoder(e) if decode else self.stream
        state = self.run_sublayers(stream.init(e), 0, self.config.num_sublayers, cos, sin, cache=cache,
                                   start_pos=start_pos, trace=trace, experts=experts, stream=stream)
        return stream.output(state, trace)

    def run_sublayers(self, state, first: int, last: int, cos: torch.Tensor, sin: torch.Tensor, *,
                      cache: KVCache | None = None, start_pos: int = 0, trace: Trace | None = None,
                      experts: ExpertStats | None = None, stream=None):
        """The stream ``state`` after sublayers ``first .. last - 1`` (attention at even indices,
        the MLP at odd ones), each read, run and written in turn: the whole pass from 0 to ``M``,
        or one pipeline stage's part of it. ``cos``/``sin``: the RoPE rows of the tokens' positions.
        ``stream``: what runs the pass, the model's stream (default) or, for a decode pass, what
        its ``decoder`` gave."""
        layers = list(self.layers)  # a list: ModuleList indexing costs ~10 calls

        def sublayer(i: int, x: torch.Tensor) -> torch.Tensor:
            layer = layers[i >> 1]
            return layer.attn(x, cos, sin, cache, i >> 1, start_pos) if i % 2 == 0 else layer.mlp(x, experts)

        return run_sublayers(self.stream if stream is None else stream, state, sublayer, first, last, trace)

    def forward(self, tokens, *, cache: KVCache | None = None, start_pos: int = 0, decode: bool = False,
                return_depth_weights: bool = False, trace: Trace | None = None,
                experts: ExpertStats | None = None):
        """Logits ``[B, T, V]`` for ``tokens`` ``[B, T]``.

        ``decode=True`` asks for a decode pass, which ``generate`` does for each token after the
        prompt: with autograd off (a request with autograd on raises ``RuntimeError``), the
        stream's decoder runs it (``Stream.decoder``: Full, Block and Delta AttnRes read their
        sources from one buffer, on a backend that decodes); the other designs and backends run
        their ordinary pass. Any number of positions gives the ordinary pass's logits (to
        round-off). Without the flag a pass is an ordinary one, whatever its shape.

        ``trace`` records the depth weights and read RMS of every site::

            trace = Trace()
            model(tokens, trace=trace)
            trace.depth_weights[3]  # [N_sources, B, T, heads]

        With ``return_depth_weights=True`` returns ``(logits, weights)`` where ``weights[site]`` is
        the routing of sublayer ``site`` (``M`` for the output), ``[N_sources, B, T, heads]``.

        ``experts`` (an MoE model) records each MoE layer's expert counts and balance loss; a
        training loop adds ``moe_aux_loss(experts)`` to the loss (``loss`` does)::

            experts = ExpertStats()
            loss = lm_loss(model(x, experts=experts), y) + model.moe_aux_loss(experts)
        """
        if return_depth_weights and trace is None:
            trace = Trace()
        hidden = self.hidden_states(tokens, cache=cache, start_pos=start_pos, decode=decode, trace=trace,
                                    experts=experts)
        logits = self.lm_head(hidden)
        return (logits, trace.depth_weights) if return_depth_weights else logits

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of ``targets`` ``[B, T]`` given ``tokens``, plus
        the MoE balance loss where the model has one (``moe_aux_loss``)."""
        experts = ExpertStats()
        return lm_loss(self(tokens, experts=experts), targets) + self.moe_aux_loss(experts)

    def moe_layers(self) -> list[MoE]:
        """The mixture-of-experts sublayers, in depth order (none for a dense model)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def moe_aux_loss(self, experts: ExpertStats) -> torch.Tensor | float:
        """``moe_aux_weight`` times the mean balance loss of the layers ``experts`` recorded, for
        ``moe_balance="aux"``; 0 otherwise (a dense model, or the ``bias`` balance)."""
        c = self.config
        if not c.moe_experts or c.moe_balance != "aux" or not experts.aux:
            return 0.0
        return c.moe_aux_weight * experts.aux_loss()

    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """The ``bias`` balance's step: ``counts`` ``[L, E]`` are one optimizer step's assignments
        per layer and expert (every micro-batch and rank summed; every layer's MLP is an MoE
        sublayer). Nothing for ``aux``."""
        if self.config.moe_balance != "bias":
            return
        expected = (self.config.n_layers, self.config.moe_experts)
        if tuple(counts.shape) != expected:
            raise ValueError(f"counts of shape {tuple(counts.shape)}, expected {expected}")
        for layer, layer_counts in zip(self.layers, counts):  # a pipeline rank holds some of them
            if isinstance(layer.mlp, MoE):
                layer.mlp.update_bias(layer_counts)

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        c = self.config
        ref = self.lm_head.weight
        return KVCache(c.n_layers, batch, c.n_kv_heads, max_len or c.max_seq_len, c.head_dim,
                       dtype=ref.dtype, device=ref.device)

    def generate(self, prompt: torch.Tensor, max_new_tokens: int | None = None, temperature: float = 0.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """``prompt`` ``[B, T]`` continued by ``max_new_tokens`` tokens, ``[B, T + max_new_tokens]``:
        ``generation.generate`` with this model (greedy at ``temperature=0``, ``top_k`` the k
        likeliest; each token after the prompt a decode pass)."""
        return generate(self, prompt, max_new_tokens, temperature, top_k, generator)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits ``[B, T, V]`` against targets ``[B, T]``, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def param_groups(model: nn.Module, weight_decay: float, only: set[str] | None = None,
                 query_lr_scale: float = 1.0, routing_lr_scale: float = 1.0) -> list[dict]:
    """AdamW's parameter groups, each named (``"name"``: checkpoints match groups by it):
    ``decay``, the matrices; ``no_decay``, norms, gains, pseudo-queries, biases, gates and the
    other vectors a stream declares (``Stream.no_weight_decay``). With ``query_lr_scale != 1`` a
    third, ``query_projection``: the input-dependent queries' projections ``W_i`` (AttnRes
    ``query="input"``), decaying as matrices, with ``"lr_scale": query_lr_scale`` (the trainer
    sets each group's learning rate to its ``lr_scale`` times the schedule's). With
    ``routing_lr_scale != 1`` a ``routing`` group: every stream's routing parameters
    (``Stream.routing_parameters``: pseudo-queries, key-norm gains, Delta's gates and null,
    DenseFormer's and static mixing's weights, HC's, mHC's and GR's mixing; a converted model's
    ``routing.*``, its routing being a stream), decaying as they would in the two groups above
    (the vectors not at all), with ``"lr_scale": routing_lr_scale``. Parameters that do not
    require gradients are left out, and so are those not named in ``only`` (when given)."""
    exempt: set[str] = set()
    scaled: set[str] = set()
    routing: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, Stream):
            name = (lambda n, prefix=prefix: f"{prefix}.{n}" if prefix else n)
            exempt |= {name(n) for n in module.no_weight_decay()}
            if query_lr_scale != 1.0 and getattr(module, "query_proj", None) is not None:
                scaled.add(name("query_proj"))
            if routing_lr_scale != 1.0:
                routing |= {name(n) for n in module.routing_parameters()}
    decay, no_decay, query, routed = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or (only is not None and name not in only):
            continue
        if name in scaled:
            query.append(p)
        elif name in routing:
            routed.append(p)
        else:
            (no_decay if p.ndim < 2 or name in exempt else decay).append(p)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    if scaled:
        groups.append({"name": "query_projection", "params": query, "weight_decay": weight_decay,
                       "lr_scale": query_lr_scale})
    if routing:
        groups += _routing_groups(model, routed, exempt, weight_decay, routing_lr_scale)
    return groups


def _routing_groups(model: nn.Module, routed: list, exempt: set[str], weight_decay: float,
                    scale: float) -> list[dict]:
    """The ``routing`` group of ``param_groups`` (its vectors and exempt parameters), and
    ``routing_decay`` for a routing matrix (HC's dynamic projections, GR's low-rank layer) that
    decays as the other matrices do, both at ``"lr_scale": scale``."""
    names = {id(p): n for n, p in model.named_parameters()}
    flat = [p for p in routed if p.ndim < 2 or names[id(p)] in exempt]
    matrices = [p for p in routed if not (p.ndim < 2 or names[id(p)] in exempt)]
    groups = [{"name": "routing", "params": flat, "weight_decay": 0.0, "lr_scale": scale}]
    if matrices:
        groups.append({"name": "routing_decay", "params": matrices, "weight_decay": weight_decay, "lr_scale": scale})
    return groups


#: the groups of an optimizer state saved before groups carried names, in their order
UNNAMED_GROUPS = ("decay", "no_decay")


def match_param_groups(saved: list[dict], current: list[dict]) -> list[dict]:
    """The saved optimizer's parameter groups (``state_dict()["param_groups"]``) in the order of
    the ``current`` optimizer's, matched by name (``param_groups``; groups saved without names
    are ``UNNAMED_GROUPS`` in order); ``ValueError`` naming both when they hold other groups."""
    named = [dict(g, name=g.get("name", UNNAMED_GROUPS[k] if k < len(UNNAMED_GROUPS) else None))
             for k, g in enumerate(saved)]
    by_name = {g["name"]: g for g in named}
    want = [g.get("name") for g in current]
    if sorted(by_name, key=str) != sorted(want, key=str) or len(by_name) != len(named):
        raise ValueError(f"the optimizer state holds the parameter groups {[g['name'] for g in named]}, the "
                         f"model's optimizer {want} (optim.query_lr_scale and optim.routing_lr_scale of 1 or not "
                         f"decide whether the query_projection and routing groups exist: resume with the run's own "
                         f"side of 1)")
    return [by_name[name] for name in want]
