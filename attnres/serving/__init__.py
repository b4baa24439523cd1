"""Serving attnres models with vLLM: a plugin that vLLM loads in each of its processes.

``register`` is the ``vllm.general_plugins`` entry point (``pyproject.toml``). It makes the model
types of our folders known to ``transformers`` (``configs``) and the architectures they declare
known to vLLM's ``ModelRegistry`` in the lazy ``"module:Class"`` form, so that nothing of vLLM's
model code is imported before a model is built:

- ``AttnResForCausalLM``: attnres's own model (``attnres export`` folders and
  ``AttnResForCausalLM.save_pretrained``), every residual design (``exported``);
- ``AttnRes<Source>ForCausalLM``: ``attnres convert``'s Delta AttnRes models, vLLM's own layers
  of the source architecture with our routing between them (``converted``).

The routing runs per token on the flat ``[tokens, D]`` batch vLLM passes (prompt tokens and
decode steps of many requests together), through the stream's decoder (``Stream.decoder``: one
buffer of sources, read at any number of positions, exact as the ordinary pass is), whatever
the batch's shape: depth routing mixes a token's own sublayer outputs, so vLLM's paged KV cache
and continuous batching serve it as they are. This package needs no part of ``attnres.hf``: the serving environment holds an
older ``transformers`` (README, "Serving").
"""

from __future__ import annotations

from ..architectures import SOURCES

#: the architectures the plugin serves -> the class vLLM builds, as ``module:Class``
ARCHITECTURES = {
    "AttnResForCausalLM": "attnres.serving.exported:AttnResForCausalLM",
    **{source.converted_class: f"attnres.serving.converted:{source.converted_class}" for source in SOURCES.values()},
}


def register() -> None:
    """vLLM's plugin entry point: our configurations with ``transformers``, our architectures
    with vLLM (idempotent: vLLM calls it in every process)."""
    from vllm import ModelRegistry

    from .configs import register_configs

    register_configs()
    for architecture, target in ARCHITECTURES.items():
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, target)
