"""The ``transformers`` configurations of the folders the plugin serves, for the serving
environment's ``transformers`` (which lacks what ``attnres.hf`` builds on). Module-level classes:
vLLM pickles the configuration into its engine process.

- ``attnres``: attnres's own model; ``attnres`` holds the ``ModelConfig`` fields, and the usual
  size fields (``hidden_size``, ``num_attention_heads``...) mirror them in ``config.json``, which
  is what vLLM reads to size its KV cache.
- ``attnres_<source>``: a converted model; the source's configuration plus ``delta_heads`` and
  ``delta_block_layers``.
"""

from __future__ import annotations

import transformers

from ..architectures import SOURCES


class AttnResConfig(transformers.PretrainedConfig):
    """attnres's own model: ``attnres`` holds its ``ModelConfig`` fields."""

    model_type = "attnres"


#: model type -> its configuration class (a converted type's: its source's ``transformers``
#: configuration, ``architectures.SOURCES``, with the converted ``model_type``)
CONFIGS = {"attnres": AttnResConfig}
for _source in SOURCES.values():
    _name = _source.config_class
    CONFIGS[_source.converted_type] = globals()[f"AttnRes{_name}"] = type(f"AttnRes{_name}", (getattr(transformers, _name),), {
        "__module__": __name__,
        "model_type": _source.converted_type,
        "__doc__": f"{_name} plus the Delta AttnRes routing: delta_heads, delta_block_layers.",
    })


def register_configs() -> None:
    """Each model type with ``transformers.AutoConfig`` (kept if one is already registered)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, cls in CONFIGS.items():
        if model_type not in CONFIG_MAPPING:
            transformers.AutoConfig.register(model_type, cls)
