"""The reference LM's configuration: its sizes, its residual design and the design's options,
its mixture-of-experts settings, each checked when the config is made.

The residual options are not written here: one field per option that a stream's constructor
declares (``streams.MODEL_OPTIONS``), so that a new option of a stream is a field of the config
without an edit of this file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .moe import BALANCE
from .streams import KINDS, MODEL_OPTIONS, STREAMS


def _with_residual_options(cls):
    """Add one field per residual option (``streams.MODEL_OPTIONS``, declared by the streams'
    constructors), with the option's type and default, after the fields written in ``cls``."""
    for name, option in MODEL_OPTIONS.items():
        cls.__annotations__[name] = option.type
        setattr(cls, name, option.default)
    return cls


@dataclass
@_with_residual_options
class ModelConfig:
    """Sizes and residual design of the reference LM.

    After the sizes and ``residual`` (the kind) come the residual options, flat fields made from
    the streams' constructors (``streams.MODEL_OPTIONS``): ``heads``, ``query``, ``score``,
    ``key_norm``, ``backend`` (every kind but prenorm: the AttnRes family's routing, HC/mHC/GR's
    per-token work), ``block_size``, ``num_blocks`` (default 8) or
    ``block_sizes`` (uneven blocks, in sublayers, e.g. ``(4, 4, 6, 2)``),
    ``two_phase`` (block/delta), ``streams`` (hc/mhc/gr), ``sinkhorn_iterations`` (mhc),
    ``gr_rank`` (GR's ``rank``), ``mixing``, ``window`` and ``window_output`` (full), and with
    ``query="input"`` ``query_scale`` and ``query_gate`` (full/block/delta). Each applies only to the kinds
    that take it: setting one for another kind is an error, so nothing is silently ignored.

    ``norm_eps`` is the epsilon of every RMSNorm the stream owns, as given
    (``norm_eps_scale="absolute"``, what a converted model keeps of its source), or relative to
    the initial scale (``"init"``: ``norm_eps * init_std**2``; ``stream_eps``). Not given (None),
    it is the residual kind's own default (``default_norm_eps``), filled in when the config is
    made, so that a saved config always holds the value its model ran with.

    ``moe_experts > 0`` makes every MLP a mixture of that many routed experts (``moe.MoE``):
    ``moe_top_k`` chosen per token, ``moe_shared_experts`` every token passes through, each of
    width ``moe_hidden`` (default ``ffn_dim``); ``moe_balance`` ``"aux"`` adds the balance loss
    times ``moe_aux_weight``, ``"bias"`` moves a selection bias by ``moe_bias_rate`` after each
    optimizer step; ``moe_capacity`` > 0 caps each expert at that factor of an even share in
    training (0: no token dropped). The ``moe_*`` options need ``moe_experts > 0``.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # default: n_heads (no grouping)
    ffn_dim: int | None = None  # default: 8/3 dim rounded up to a multiple of 32
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float | None = None  # default: the residual kind's (default_norm_eps)
    norm_eps_scale: str = "absolute"
    tie_embeddings: bool = False
    init_std: float = 0.02
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_shared_experts: int = 0
    moe_hidden: int | None = None  # default: ffn_dim
    moe_balance: str = "aux"
    moe_aux_weight: float = 0.01
    moe_bias_rate: float = 1e-3
    moe_capacity: float = 0.0
    residual: str = "prenorm"

    def __post_init__(self):
        if isinstance(self.block_sizes, list):  # as a saved config (JSON) holds it
            self.block_sizes = tuple(self.block_sizes)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:  # a bool is an int to Python, never a size
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_dim is None:
            self.ffn_dim = 32 * math.ceil(8 * self.dim / 3 / 32)
        if self.norm_eps is None:  # an unknown residual kind is refused below, by name
            self.norm_eps = default_norm_eps(self.residual, self.norm_eps_scale)
        if type(self.ffn_dim) is not int or self.ffn_dim < 1:
            raise ValueError(f"ffn_dim={self.ffn_dim!r} must be a positive integer (or None: 8/3 dim)")
        for name in ("norm_eps", "init_std", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a finite number > 0")
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide dim={self.dim}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")
        if type(self.n_kv_heads) is not int or self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads!r} must be a positive integer dividing n_heads={self.n_heads}"
            )
        if self.norm_eps_scale not in NORM_EPS_SCALES:
            raise ValueError(f"norm_eps_scale={self.norm_eps_scale!r} is not one of {NORM_EPS_SCALES}")
        self._check_moe()
        if self.residual not in KINDS:
            raise ValueError(f"residual={self.residual!r} is not one of {KINDS}")
        accepted = STREAMS[self.residual].options()
        for name, option in MODEL_OPTIONS.items():
            if option.name not in accepted and getattr(self, name) != option.default:
                raise ValueError(f"{name}={getattr(self, name)!r} does not apply to residual={self.residual!r}")

    def _check_moe(self) -> None:
        """The ``moe_*`` options: in range, and set only for an MoE model (nothing ignored)."""
        defaults = {f: type(self).__dataclass_fields__[f].default for f in MOE_FIELDS}

        def count(name, low, none=False):
            value = getattr(self, name)
            if not (none and value is None) and (type(value) is not int or value < low):
                raise ValueError(f"{name}={value!r} must be an integer >= {low}{' or None' if none else ''}")

        def amount(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")

        count("moe_experts", 0)
        if self.moe_experts == 0:
            given = [f"{f}={getattr(self, f)!r}" for f in MOE_FIELDS[1:] if getattr(self, f) != defaults[f]]
            if given:
                raise ValueError(f"{', '.join(given)} applies to mixture-of-experts models only: set "
                                 f"moe_experts > 0 (with --set, before it)")
            return
        count("moe_top_k", 1)
        if self.moe_top_k > self.moe_experts:
            raise ValueError(f"moe_top_k={self.moe_top_k!r} must be an integer in [1, moe_experts={self.moe_experts}]")
        count("moe_shared_experts", 0)
        count("moe_hidden", 1, none=True)
        for name in ("moe_aux_weight", "moe_bias_rate", "moe_capacity"):
            amount(name)
        if self.moe_balance not in BALANCE:
            raise ValueError(f"moe_balance={self.moe_balance!r} is not one of {BALANCE}")
        unused = {"aux": "moe_bias_rate", "bias": "moe_aux_weight"}[self.moe_balance]
        if getattr(self, unused) != defaults[unused]:
            raise ValueError(f"{unused}={getattr(self, unused)!r} does not apply to moe_balance={self.moe_balance!r}")

    @property
    def expert_hidden(self) -> int:
        """Each expert's hidden width: ``moe_hidden``, or ``ffn_dim`` when not given."""
        return self.moe_hidden or self.ffn_dim

    @property
    def num_sublayers(self) -> int:
        return 2 * self.n_layers

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def stream_eps(self) -> float:
        """The epsilon of the stream's RMSNorms: ``norm_eps`` itself (``norm_eps_scale="absolute"``),
        or ``norm_eps * init_std**2`` (``"init"``: in units of the mean square the embedding and the
        sublayers' weights start at, so that the norms damp the same fraction of an initial read
        whatever ``init_std`` is)."""
        return self.norm_eps if self.norm_eps_scale == "absolute" else self.norm_eps * self.init_std**2

    def stream_options(self) -> dict:
        """The options of ``build_stream`` this config sets for its residual kind."""
        accepted = STREAMS[self.residual].options()
        return {option.name: getattr(self, name) for name, option in MODEL_OPTIONS.items() if option.name in accepted}


#: each residual kind's default ``norm_eps`` where it is not ``NORM_EPS``: the one docs/RESULTS.md
#: found best for it ("Epsilon: six seeds of every design"; "Epsilon for every design"). At 1e-6
#: the AttnRes family's reads are damped early (Block 0.025 and Full 0.058 nats worse than at
#: 1e-12, resolved over six seeds; MHAR, a Block with heads, 0.022, not resolved); at 1e-12 the
#: multi-stream designs and Delta end worse on the mean (+0.012 to +0.047, not resolved), and
#: PreNorm and DenseFormer move by less than 0.006.
KIND_NORM_EPS = {"block": 1e-12, "full": 1e-12}
#: the default ``norm_eps`` of every other residual kind
NORM_EPS = 1e-6


def default_norm_eps(residual: str, scale: str = "absolute") -> float:
    """The ``norm_eps`` a model of residual kind ``residual`` has when none is given: its kind's
    (``KIND_NORM_EPS``) when absolute; ``NORM_EPS`` for every kind when relative to the initial
    scale (``scale="init"``: the setting measured, 4e-10 at ``init_std=0.02``)."""
    return NORM_EPS if scale == "init" else KIND_NORM_EPS.get(residual, NORM_EPS)


#: how ``ModelConfig.norm_eps`` is read (``ModelConfig.stream_eps``)
NORM_EPS_SCALES = ("absolute", "init")
#: the mixture-of-experts options of ``ModelConfig``; the first is the number of experts
MOE_FIELDS = ("moe_experts", "moe_top_k", "moe_shared_experts", "moe_hidden", "moe_balance", "moe_aux_weight",
              "moe_bias_rate", "moe_capacity")
