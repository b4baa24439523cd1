"""Hugging Face integration: native attnres models, conversion of pretrained models of the
source architectures (``architectures.SOURCES``) to Delta AttnRes, and evaluation with
lm-evaluation-harness.

Importing this module registers the Auto classes (``AutoConfig``, ``AutoModelForCausalLM``) for
``model_type="attnres"`` and the converted ``attnres_<source>`` types. ``transformers`` is an
optional dependency of attnres: ``pip install 'attnres[hf]'``.
"""

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the optional extra
    raise ImportError("attnres.hf needs transformers: pip install 'attnres[hf]'") from exc

from transformers import AutoConfig, AutoModelForCausalLM

from .convert import CONVERTED, SOURCES, convert, convert_checkpoint, freeze_base, register, routing_parameters
from .reference_lm import AttnResConfig, AttnResForCausalLM
from .tokenizer import byte_tokenizer

AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)
register()

__all__ = [
    "CONVERTED",
    "SOURCES",
    "AttnResConfig",
    "AttnResForCausalLM",
    "byte_tokenizer",
    "convert",
    "convert_checkpoint",
    "freeze_base",
    "routing_parameters",
]
