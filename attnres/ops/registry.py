"""The routing backends by name, what each accepts, and the one choice among them (``pick``).

Adding a backend is one module in ``ops/backends`` with an object implementing
``ops.backends.BackendOps`` (its ``OPS``) and one ``Backend`` line in ``BACKENDS`` below; the
parity tests run every registered backend against ``naive`` without a new test.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .backends import BackendOps, cpu_ops

SCORES = ("softmax", "sigmoid")
ANY_DEVICE = "any"


@dataclass(frozen=True)
class Request:
    """What one routing pass asks of a backend."""

    device: str  # device type of the sources: "cpu", "cuda", ...
    dtype: torch.dtype  # the sources' dtype
    score: str = "softmax"
    key_norm: bool = True
    per_token_query: bool = False  # queries [..., D], the input-dependent ablation


@dataclass(frozen=True)
class Backend:
    """One routing backend: its operations (``ops``, the object ``OPS`` of the module
    ``attnres.ops.backends.<name>``), and what it accepts."""

    name: str
    #: device types ``auto`` picks it for (``ANY_DEVICE``: all), tried in registry order
    auto: tuple[str, ...] = ()
    #: device types it runs on (None: any), a function so that it can follow the environment
    devices: Callable[[], tuple[str, ...]] | None = None
    #: what an error about the device adds, e.g. how to run it elsewhere
    device_note: str = ""
    #: source dtypes it takes (None: any)
    dtypes: tuple[torch.dtype, ...] | None = None
    #: the sigmoid score and keys without RMSNorm (docs/METHOD.md section 9)
    ablations: bool = True
    #: queries ``[..., D]`` (the input-dependent ablation) besides one query ``[D]`` per site
    per_token_query: bool = False
    #: runs while ``torch.compile`` traces (its kernels are ops the compiler can capture; an
    #: opaque foreign call cannot be traced)
    traceable: bool = True
    #: offers ``score_source``/``attend_scored`` (inference: each source scored once)
    scores_ahead: bool = False
    #: its ``attend`` reads the ``logits`` scored when each source was written (training, eager,
    #: with the ledger: ``ops.routing``), instead of scoring each token of each read
    scores_in_training: bool = False
    #: offers ``decode_read`` (a decode pass: each read one call over a buffer of the sources)
    decodes: bool = False
    #: its ``attend`` leaves the gradients of sources an ``ops.source_ledger`` tracks to the
    #: ledger, and it offers ``source_grad`` to form them (training: one gradient per source)
    defers_source_grads: bool = False
    #: why it cannot run on this machine (not installed, failed build), or None
    setup: Callable[[], str | None] | None = None
    #: imported with the registry (so that no import happens while torch.compile traces); False
    #: for a backend whose import is heavy and needs an optional package
    preload: bool = True

    @property
    def ops(self) -> BackendOps:
        """The backend's operations (``ops.backends.BackendOps``), its module imported on first
        use."""
        return _load(self.name)

    def unsupported(self, score: str, key_norm: bool, per_token_query: bool) -> str | None:
        """Why it cannot serve these routing options on any data, or None."""
        if per_token_query and not self.per_token_query:
            return ("it takes one query [D] shared by all tokens; per-token queries [..., D] (the "
                    "input-dependent ablation) run on backend='naive'")
        if (score != "softmax" or not key_norm) and not self.ablations:
            return "it implements the method (softmax over RMS-normalized keys), not the score/key-norm ablations"
        return None

    def unsuited(self, request: Request) -> str | None:
        """Why ``request``'s data is not of the kind it takes, or None."""
        devices = self.devices() if self.devices is not None else None
        if devices is not None and request.device not in devices:
            names = " or ".join(d.upper() for d in devices)
            return f"it runs on {names} tensors{self.device_note}, got {request.device} tensors"
        if self.dtypes is not None and request.dtype not in self.dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"it takes {names} sources, got {request.dtype}"
        return None

    def problem(self, request: Request) -> str | None:
        """Why it cannot serve ``request``, or None when it can."""
        return (self.unsupported(request.score, request.key_norm, request.per_token_query)
                or self.unsuited(request) or (self.setup() if self.setup is not None else None))


def _triton_devices() -> tuple[str, ...]:
    return ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)


#: each backend's operations once its module is imported: every ``preload`` one, and any other
#: once ``pick`` chose it
_LOADED: dict[str, BackendOps] = {}


def _load(name: str) -> BackendOps:
    """The operations of backend ``name``: its module's ``OPS``, the module imported on first use
    (``pick`` imports it before a pass runs, so that no import happens while ``torch.compile``
    traces)."""
    ops = _LOADED.get(name)
    if ops is None:
        ops = _LOADED[name] = importlib.import_module(f"{__package__}.backends.{name}").OPS
    return ops


@functools.cache
def _triton_setup() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'attnres[triton]')"
    return None


#: every backend, in the order ``auto`` tries them
BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("triton", auto=("cuda",), devices=_triton_devices, device_note=" (or on the CPU under TRITON_INTERPRET=1)",
            dtypes=(torch.float32, torch.bfloat16, torch.float16), ablations=False, setup=_triton_setup,
            preload=False),
    Backend("cpu", auto=("cpu",), devices=lambda: ("cpu",), dtypes=(torch.float32, torch.float64),
            scores_ahead=True, scores_in_training=True, decodes=True, defers_source_grads=True,
            setup=cpu_ops.build_problem),
    Backend("torch", auto=(ANY_DEVICE,), scores_ahead=True),
    Backend("naive", per_token_query=True, decodes=True),
)}
#: what a ``backend=`` option accepts
NAMES = ("auto", *BACKENDS)
#: the backend that serves every request: the reference
REFERENCE = "naive"

_warned: set[str] = set()
for _backend in BACKENDS.values():
    if _backend.preload:
        _load(_backend.name)


def get(name: str) -> Backend:
    """The registered backend ``name``; ``ValueError`` naming the accepted ones otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not one of {NAMES}")
    return BACKENDS[name]


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def validate(name: str, *, score: str = "softmax", key_norm: bool = True, per_token_query: bool = False) -> None:
    """Raise ``ValueError`` for an unknown backend, an unknown score, or an explicit backend that
    cannot serve these options on any data (checked before any work)."""
    if score not in SCORES:
        raise ValueError(f"score={score!r} is not one of {SCORES}")
    if name != "auto":
        problem = get(name).unsupported(score, key_norm, per_token_query)
        if problem:
            raise ValueError(f"backend={name!r} cannot run: {problem}")


def pick(name: str, request: Request) -> Backend:
    """The backend that serves ``request``.

    An explicit ``name`` is that backend, or ``RuntimeError`` saying why it cannot serve (one
    that ``torch.compile`` cannot trace runs there between graph breaks). ``auto`` takes the
    first backend in registry order whose ``auto`` devices include the request's and that can
    serve it (Triton on CUDA, the CPU kernels for fp32/fp64 CPU tensors, also while
    ``torch.compile`` traces, else ``torch``; ``naive`` for per-token queries). It passes
    quietly over a backend for data that is not its kind (dtype, tracing) and warns once when one
    it would have picked cannot run (not installed or built, an option it lacks).
    """
    if name != "auto":
        backend = get(name)
        problem = backend.problem(request)
        if problem:
            raise RuntimeError(f"backend={name!r} cannot run: {problem}")
        backend.ops  # noqa: B018  (imported before a pass runs)
        return backend
    passed_over = None
    for backend in BACKENDS.values():
        if not (ANY_DEVICE in backend.auto or request.device in backend.auto) or backend.unsuited(request):
            continue
        if not backend.traceable and torch.compiler.is_compiling():
            continue
        problem = backend.problem(request)
        if problem is None:
            break
        passed_over = passed_over or (backend.name, problem)
    else:
        backend = BACKENDS[REFERENCE]
    if passed_over:
        warn_once(f"depth attention: using the {backend.name} backend on {request.device.upper()} "
                  f"because {passed_over[0]} cannot run: {passed_over[1]}")
    backend.ops  # noqa: B018  (imported before a pass runs)
    return backend
