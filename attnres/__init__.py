"""attnres: Attention Residuals and every residual design they are compared with, on one
stream protocol, with a reference decoder LM.

The names below load on first use (``from attnres import Transformer`` as ever): importing the
package, as the command line does before it knows its command, loads no PyTorch (seconds).
"""

import importlib

__version__ = "0.1.0"

#: each name the package exports -> the module of the package that defines it
_EXPORTS = {
    "ExpertStats": ".moe",
    "KINDS": ".streams",
    "KVCache": ".generation",
    "ModelConfig": ".model_config",
    "MoE": ".moe",
    "Stream": ".streams",
    "Trace": ".streams",
    "Transformer": ".model",
    "build_stream": ".streams",
    "depth_attention": ".ops",
    "param_groups": ".model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """An exported name, its module imported the first time it is asked for (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later reads find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
