"""The stream protocol every residual design follows (docs/ARCHITECTURE.md).

A stream answers three questions: what it stores (``init``/``write``), how the next sublayer
reads (``read``, pre-norm included) and what reaches the LM head (``output``, final norm
included)::

    state = stream.init(e)
    for i, sublayer in enumerate(sublayers):
        state = stream.write(state, i, sublayer(stream.read(state, i)))
    y = stream.output(state)

The state is an explicit value (a tensor or a NamedTuple of tensors), never hidden module state.
A ``Trace`` given to ``read`` and ``output`` records what analysis needs (depth weights, the RMS
of each read); a read without one runs the fast path.

A decode pass is asked for, never inferred: ``stream.decoder(e)`` gives what runs it, on the same
protocol (``streams/decode.py``).
"""

from __future__ import annotations

import inspect
import math
import typing
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

import torch
from torch import nn

from ..ops import BackendOps, Request, RMSNorm, get, pick, rms


@dataclass
class Trace:
    """What a traced forward pass records, keyed by site (``i`` for sublayer ``i``, ``M`` for
    the output routing; the same rows as ``pseudo_queries``). A traced read of the AttnRes family
    routes on the reference path, which materializes the weights; the rest of the pass runs as
    usual (Block still runs each block's phase 1, which traced reads do not use): tracing is for
    analysis, not speed.

    - ``depth_weights[site]``: routing weights ``[N_sources, ..., heads]`` (AttnRes family).
    - ``read_rms[site]``: RMS ``[...]`` of what the read normalizes (the hidden state before the
      pre-norm; for multi-stream designs the mixed read).
    - ``sources[site]``: the routed sources ``N x [..., D]`` (AttnRes family), only when
      ``keep_sources`` is set (for probes that re-route the same sources).
    """

    depth_weights: dict[int, torch.Tensor] = field(default_factory=dict)
    read_rms: dict[int, torch.Tensor] = field(default_factory=dict)
    sources: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    keep_sources: bool = False


class Option(NamedTuple):
    """One option of a stream's constructor: its name, default and type."""

    name: str
    default: Any
    type: Any


class Stream(nn.Module):
    """Base of every residual design. The four operations check their arguments against the
    stream (shapes, devices, sublayer indices and, where the state can tell, their order) and
    hand on to the design's ``_init``, ``_read``, ``_write`` and ``_output``.

    Args:
        dim: model width ``D``.
        num_sublayers: ``M``, the number of sublayers the stream serves (2 per transformer layer).
        eps: epsilon of every RMSNorm the stream owns.
    """

    kind: str = ""
    #: options for wrapping another model's sublayers, not fields of the reference LM's config
    wrapper_options: tuple[str, ...] = ()
    #: the reference LM's config field of an option, where its name differs from the option's
    config_names: dict[str, str] = {}

    @classmethod
    def options(cls) -> dict[str, Option]:
        """The options ``build_stream`` accepts for this kind, beyond dim, num_sublayers and eps:
        the keyword-only parameters of its constructor, and of each base class's constructor it
        hands ``**options`` on to. The constructors are the one declaration of every option."""
        found: dict[str, Option] = {}
        for klass in cls.__mro__:
            if "__init__" not in vars(klass):
                continue
            params = inspect.signature(klass.__init__).parameters.values()
            types = typing.get_type_hints(klass.__init__)
            for p in params:
                if p.kind is p.KEYWORD_ONLY and p.name not in found:
                    found[p.name] = Option(p.name, p.default, types[p.name])
            if not any(p.kind is p.VAR_KEYWORD for p in params):
                break
        return found

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6):
        super().__init__()
        if type(dim) is not int or dim < 1:  # a bool is an int to Python, never a size
            raise ValueError(f"dim={dim!r} must be a positive integer")
        if type(num_sublayers) is not int or num_sublayers < 1:
            raise ValueError(f"num_sublayers={num_sublayers!r} must be a positive integer")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            raise ValueError(f"eps={eps!r} must be a finite number > 0 (the RMSNorms' epsilon: 0 or less, or "
                             f"nan, makes the norms divide by zero or give nan)")
        self.dim = dim
        self.num_sublayers = num_sublayers
        self.eps = eps

    # -- the protocol: checked here, computed by each design's _init/_read/_write/_output -----
    def init(self, e: torch.Tensor) -> Any:
        """The state before sublayer 0, from the embedding ``e`` ``[..., D]``."""
        if not isinstance(e, torch.Tensor) or e.ndim < 1 or e.shape[-1] != self.dim:
            self._refuse_embedding(e, "init")
        if not e.dtype.is_floating_point:
            raise ValueError(f"init(e): e is a {e.dtype} tensor {tuple(e.shape)}; the stream routes and normalizes "
                             f"floating-point embeddings (e.g. float32)")
        return self._init(e)

    def read(self, state: Any, i: int, trace: Trace | None = None) -> torch.Tensor:
        """What sublayer ``i`` consumes, ``[..., D]``, its pre-norm included."""
        # inline and in one condition: the checks run at every routing point of every token
        if type(i) is not int or not 0 <= i < self.num_sublayers or (self.counts_writes and self._written(state) != i):
            self._refuse(state, i, "read")
        return self._read(state, i, trace)

    def write(self, state: Any, i: int, v: torch.Tensor) -> Any:
        """The state after sublayer ``i`` produced ``v`` ``[..., D]``."""
        if type(i) is not int or not 0 <= i < self.num_sublayers or (self.counts_writes and self._written(state) != i):
            self._refuse(state, i, "write")
        shape, device = self._hidden(state)
        if not isinstance(v, torch.Tensor) or v.shape != shape or v.device != device:
            refuse_output(f"{self.kind} stream", i, v, shape, device)
        return self._write(state, i, v)

    def output(self, state: Any, trace: Trace | None = None) -> torch.Tensor:
        """The final normalized hidden state ``[..., D]`` for the LM head."""
        if self.counts_writes and self._written(state) != self.num_sublayers:
            raise RuntimeError(f"{self.kind} stream: output needs all {self.num_sublayers} sublayers written, "
                               f"the state holds {self._written(state)}")
        return self._output(state, trace)

    # -- the state between pipeline stages ----------------------------------------------------
    def split_state(self, state: Any) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(completed, rest)``: the completed sources ``state`` holds, in the order they were
        completed, and the rest of it, all tensors: what a pipeline stage sends to the next
        (``join_state`` rebuilds the state there). A state without completed sources (PreNorm's
        running sum, the streams of HC/mHC/GR) is all the rest."""
        return (), (state,)

    def join_state(self, completed: tuple[torch.Tensor, ...], rest: tuple[torch.Tensor, ...], i: int) -> Any:
        """The state before sublayer ``i`` (``num_sublayers``: before the output) from what
        ``split_state`` gave, as the stage that runs sublayer ``i`` receives it. What a routing
        backend kept for the sources is made again here: it never travels."""
        if type(i) is not int or not 0 <= i <= self.num_sublayers:
            raise ValueError(f"{self.kind} stream: join_state needs a sublayer index in [0, {self.num_sublayers}], "
                             f"given {i!r}")
        return self._join_state(tuple(completed), tuple(rest), i)

    def _join_state(self, completed: tuple[torch.Tensor, ...], rest: tuple[torch.Tensor, ...], i: int) -> Any:
        if completed or len(rest) != 1:
            raise ValueError(f"{self.kind} stream: its state is one tensor, given {len(completed)} completed "
                             f"sources and {len(rest)} other tensors")
        return rest[0]

    # -- decoding --------------------------------------------------------------------------------
    def decoder(self, like: torch.Tensor) -> Any:
        """What runs a decode pass over embeddings like ``like`` ``[..., D]``, on the protocol of
        a stream (``init``, ``read``, ``write``, ``output``, ``split_state``): the design's decoder
        (``streams/decode.py``) where it has one and the routing backend decodes, otherwise the
        stream itself, whose ordinary pass then runs. The caller asks for it explicitly
        (``Transformer.forward(decode=True)``); a decode pass runs with autograd off, and a
        request with autograd on is refused (``RuntimeError``): nothing of a decode pass is
        differentiable, and a pass with gradients is an ordinary one."""
        if torch.is_grad_enabled():
            raise RuntimeError(f"{self.kind} stream: a decode pass runs with autograd off (under torch.no_grad() "
                               f"or torch.inference_mode()); a pass that needs gradients is an ordinary one "
                               f"(decode=False)")
        if not isinstance(like, torch.Tensor) or like.ndim < 1 or like.shape[-1] != self.dim:
            self._refuse_embedding(like, "decoder")
        return self._decoder(like) or self

    def _decoder(self, like: torch.Tensor) -> Any:
        """The design's decoder for a pass over data like ``like``, or None where there is none."""
        return None

    def _refuse_embedding(self, e: Any, operation: str) -> NoReturn:
        given = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
        raise ValueError(f"{self.kind} stream: {operation} takes the embedding [..., {self.dim}] (dim={self.dim}), "
                         f"given {given}")

    def _refuse(self, state: Any, i: Any, operation: str) -> None:
        """Raise for ``i``, which is not a sublayer index, or (for a design that reads its sources
        in order) not the next one."""
        if type(i) is not int or not 0 <= i < self.num_sublayers:
            refuse_index(f"{self.kind} stream", self.num_sublayers, i, operation)
        refuse_order(f"{self.kind} stream", i, operation, self._written(state))

    # -- what each design implements ----------------------------------------------------------
    def _init(self, e: torch.Tensor) -> Any:
        raise NotImplementedError

    def _read(self, state: Any, i: int, trace: Trace | None) -> torch.Tensor:
        raise NotImplementedError

    def _write(self, state: Any, i: int, v: torch.Tensor) -> Any:
        raise NotImplementedError

    def _output(self, state: Any, trace: Trace | None) -> torch.Tensor:
        raise NotImplementedError

    def _hidden(self, state: Any) -> tuple[torch.Size, torch.device]:
        """Shape ``[..., D]`` and device of the embedding the state started from: what every
        write must match."""
        raise NotImplementedError

    #: whether the state counts the sublayers written into it (``_written``): the AttnRes
    #: family's does; the running sums of the others cannot
    counts_writes = False

    def _written(self, state: Any) -> int:
        """How many sublayers ``state`` holds (for a design that ``counts_writes``)."""
        raise NotImplementedError

    # -- shared helpers -----------------------------------------------------------------------
    def _make_norms(self) -> None:
        """The per-sublayer pre-norms ``norms.{i}`` and ``final_norm``: the same parameter names
        in every stream that has them, so a PreNorm state dict loads into any of them."""
        self.norms = nn.ModuleList(RMSNorm(self.dim, self.eps) for _ in range(self.num_sublayers))
        self.final_norm = RMSNorm(self.dim, self.eps)

    def _site_norm(self, site: int) -> nn.Module:
        """The pre-norm of sublayer ``site``, or the final norm for the output (``site == M``)."""
        return self.final_norm if site == self.num_sublayers else self.norms[site]

    def _finish_read(self, site: int, hidden: torch.Tensor, trace: Trace | None) -> torch.Tensor:
        """``hidden`` through the pre-norm of ``site`` (the final norm for the output), its RMS
        recorded first when traced."""
        if trace is not None:
            record_rms(site, hidden, trace)
        return self._site_norm(site)(hidden)

    def reset_parameters(self) -> None:
        """Re-initialize the stream's own parameters (the model's init calls this)."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.reset_parameters()

    def normal_init_weights(self) -> list[nn.Parameter]:
        """The stream's parameters the model draws as its own projections, N(0, init_std)
        (``Transformer.init_weights``), after ``reset_parameters``; none by default."""
        return []

    def no_weight_decay(self) -> set[str]:
        """Names (relative to the stream) of parameters kept out of weight decay."""
        return {n for n, p in self.named_parameters() if p.ndim < 2}

    def routing_parameters(self) -> set[str]:
        """Names (relative to the stream) of its routing parameters, what ``optim.routing_lr_scale``
        scales: every parameter of the stream but its pre-norms' gains (``norms``, ``final_norm``,
        the model's own norms, which PreNorm has too) and an input-dependent query's projection
        (``query_proj``: ``optim.query_lr_scale``'s)."""
        return {n for n, _ in self.named_parameters()
                if not n.startswith(("norms.", "final_norm.")) and n != "query_proj"}

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_sublayers={self.num_sublayers}"


class KeepsEverySource:
    """The state methods of a stream whose state's ``sources`` are ``(e, v_0, ..., v_{i-1})``,
    every output written so far (Full AttnRes, DenseFormer); mixed in before ``Stream``. Across
    a pipeline stage they are the completed sources and nothing else; the state is rebuilt by
    writing them again, so that what the stream keeps beside them is made again too."""

    counts_writes = True

    def _hidden(self, state) -> tuple[torch.Size, torch.device]:
        first = state.sources[0]
        return first.shape, first.device

    def _written(self, state) -> int:
        return len(state.sources) - 1

    def split_state(self, state) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return state.sources, ()

    def _join_state(self, completed, rest, i: int):
        if len(completed) != i + 1 or rest:
            raise ValueError(f"{self.kind} stream: the state before sublayer {i} is its {i + 1} sources (e, v_0, "
                             f"..., v_{i - 1}), given {len(completed)} and {len(rest)} other tensors")
        state = self._init(completed[0])
        for j, v in enumerate(completed[1:]):
            state = self._write(state, j, v)
        return state


class MultiStream(Stream):
    """Base of the designs that keep ``n`` copies of the hidden state, ``[..., n, D]``, each
    starting as a copy of the embedding (HC, mHC, GR).

    Their per-token work (a read's mix, a write's update, mHC's Sinkhorn) runs on a backend of
    ``ops`` (``BackendOps.stream_mix``, ``stream_update``, ``sinkhorn``): ``backend`` names it
    (``"auto"``: ``ops.pick``'s choice for the state's device and dtype, the CPU kernels for
    fp32/fp64 CPU tensors)."""

    def __init__(self, dim: int, num_sublayers: int, eps: float, streams: int, minimum: int = 1,
                 backend: str = "auto"):
        super().__init__(dim, num_sublayers, eps)
        if not isinstance(streams, int) or streams < minimum:
            raise ValueError(f"streams={streams!r} must be an integer >= {minimum} for {self.kind}")
        if backend != "auto":
            get(backend)  # ValueError naming the accepted ones
        self.streams = streams
        self.backend = backend

    def _ops(self, like: torch.Tensor) -> BackendOps:
        """The operations of the backend that serves a pass over ``like``'s device and dtype."""
        return pick(self.backend, Request(like.device.type, like.dtype)).ops

    def _init(self, e: torch.Tensor) -> torch.Tensor:
        return e.unsqueeze(-2).expand(*e.shape[:-1], self.streams, self.dim)

    def _hidden(self, H: torch.Tensor) -> tuple[torch.Size, torch.device]:
        return H.shape[:-2] + H.shape[-1:], H.device

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, streams={self.streams}, backend={self.backend}"


class PreparedStreams(NamedTuple):
    """The state of a multi-stream design whose read and write of a site both take something
    computed from the same streams: the streams ``H`` ``[..., n, D]`` and ``prepared``, what the
    site that takes ``H`` next needs from them (HC's and mHC's projections, every column of its
    read and its write in one product; GR's normalized branches and their product through its
    read's and its write's weights), formed once by the write that made ``H`` (or by ``init``);
    None where the site needs nothing."""

    H: torch.Tensor
    prepared: torch.Tensor | tuple[torch.Tensor, ...] | None
    site: int  # the site ``prepared`` was formed for


class PreparesNextSite:
    """The state methods of a multi-stream design whose state is ``PreparedStreams``; mixed in
    before ``MultiStream``. The design gives ``_prepare(H, site)``. Formed once per site in place
    of once by the read and again by the write: two skinny products took 1.6-2.2x the time of
    one as wide as both together (docs/BENCHMARKS.md). Across a pipeline stage only ``H``
    travels; the receiving stage prepares it again."""

    def _prepare(self, H: torch.Tensor, site: int) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """What site ``site`` (``num_sublayers``: the output) needs from the streams ``H``."""
        raise NotImplementedError

    def _state(self, state: Any, site: int | None = None) -> PreparedStreams:
        """``state``, refused (``TypeError``) unless it is a ``PreparedStreams`` (a bare tensor of
        streams would unpack along its first dim), and (``RuntimeError``) when ``site`` is given
        and the state was prepared for another site (its ``prepared`` would be read with the
        wrong site's parameters)."""
        if type(state) is not PreparedStreams:
            raise TypeError(f"{self.kind} stream: its state is the PreparedStreams that init, write and join_state "
                            f"make, given {type(state).__name__}; from streams H [..., n, D] before sublayer i: "
                            f"join_state((), (H,), i)")
        if site is not None and state.site != site:
            where = "the output" if state.site == self.num_sublayers else f"sublayer {state.site}"
            raise RuntimeError(f"{self.kind} stream: the state is prepared for {where}, not for site {site}; "
                               f"sublayers are read and written in order (from streams H before sublayer i: "
                               f"join_state((), (H,), i))")
        return state

    def _carry(self, H: torch.Tensor, site: int) -> PreparedStreams:
        """The state holding ``H`` before ``site`` (``num_sublayers``: the output)."""
        return PreparedStreams(H, self._prepare(H, site), site)

    def _init(self, e: torch.Tensor) -> PreparedStreams:
        return self._carry(super()._init(e), 0)

    def _hidden(self, state: PreparedStreams) -> tuple[torch.Size, torch.device]:
        return super()._hidden(self._state(state).H)

    def split_state(self, state: PreparedStreams):
        return (), (self._state(state).H,)

    def _join_state(self, completed, rest, i: int) -> PreparedStreams:
        return self._carry(super()._join_state(completed, rest, i), i)


def refuse_index(who: str, num_sublayers: int, i: Any, operation: str) -> NoReturn:
    """Raise ``ValueError``: ``i`` is not a sublayer index of ``num_sublayers``."""
    raise ValueError(f"{who}: {operation}({i!r}) needs a sublayer index, an integer in [0, {num_sublayers - 1}]")


def refuse_order(who: str, i: int, operation: str, written: int) -> NoReturn:
    """Raise ``RuntimeError``: sublayer ``i`` is not the next one of a state holding ``written``
    sublayers (sublayer ``i`` is read and written after the writes of ``0..i-1``)."""
    held = f"the writes of sublayers 0..{written - 1}" if written else "no write yet"
    raise RuntimeError(f"{who}: {operation}({i}) out of order: the state holds {held}, so the next sublayer is "
                       f"{written}")


def refuse_output(who: str, i: int, v: Any, shape: torch.Size, device: torch.device) -> NoReturn:
    """Raise ``ValueError``: ``v`` is not an output of sublayer ``i`` (the embedding's
    ``shape`` on its ``device``)."""
    given = f"{tuple(v.shape)} on {v.device}" if isinstance(v, torch.Tensor) else type(v).__name__
    raise ValueError(f"{who}: write({i}) takes the sublayer's output {tuple(shape)} on {device} (the embedding's "
                     f"shape and device), given {given}")


def record_rms(site: int, hidden: torch.Tensor, trace: Trace | None) -> None:
    if trace is not None:
        trace.read_rms[site] = rms(hidden).detach()


def resolve_block_sizes(num_sublayers: int, block_size: int | None = None, num_blocks: int | None = None,
                        block_sizes=None) -> tuple[tuple[int, ...], bool]:
    """The blocks' sizes in sublayers ``(n_0, ..., n_{N-1})``, summing to ``M``, from one of
    ``block_sizes`` (explicit, docs/METHOD.md section 3 "Uneven blocks"), ``block_size`` or ``num_blocks``
    (equal blocks of ``S`` but a possibly shorter last one; default 8 blocks); and whether the
    last block is completed after its last sublayer. Explicit sizes always complete it; equal
    blocks complete it only when ``S`` divides ``M`` (otherwise the output reads it as the
    partial, as the block-size formulas of docs/METHOD.md section 3 have
    it; both give the same sources)."""
    m = num_sublayers
    if block_sizes is None:
        size = resolve_block_size(m, block_size, num_blocks)
        return (size,) * (m // size) + ((m % size,) if m % size else ()), m % size == 0
    given = [name for name, value in (("block_size", block_size), ("num_blocks", num_blocks)) if value is not None]
    if given:
        raise ValueError(f"give block_sizes={block_sizes!r} or {given[0]}, not both")
    sizes = tuple(block_sizes) if isinstance(block_sizes, (list, tuple)) else None
    if not sizes or any(type(n) is not int or n < 1 for n in sizes) or sum(sizes) != m:
        raise ValueError(f"block_sizes={block_sizes!r} must be positive integers summing to {m} "
                         f"(the number of sublayers)")
    return sizes, True


def resolve_block_size(num_sublayers: int, block_size: int | None, num_blocks: int | None) -> int:
    """Block size in sublayers from either ``block_size`` or ``num_blocks`` (default 8 blocks,
    capped at one block per sublayer). ``N = ceil(M / S)`` blocks result."""
    m = num_sublayers
    if block_size is not None and num_blocks is not None:
        raise ValueError(
            f"give block_size={block_size} or num_blocks={num_blocks}, not both"
        )
    if block_size is not None:
        if not isinstance(block_size, int) or not 1 <= block_size <= m:
            raise ValueError(
                f"block_size={block_size!r} must be an integer in [1, {m}] (the number of sublayers)"
            )
        return block_size
    if num_blocks is None:
        num_blocks = min(8, m)
    if not isinstance(num_blocks, int) or not 1 <= num_blocks <= m:
        raise ValueError(
            f"num_blocks={num_blocks!r} must be an integer in [1, {m}] (the number of sublayers)"
        )
    return math.ceil(m / num_blocks)
