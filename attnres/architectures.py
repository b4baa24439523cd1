"""The source architectures: the Hugging Face causal LMs that ``attnres convert`` turns into Delta
AttnRes models, that ``attnres train --from`` trains and that the vLLM plugin serves, each
written once (``SOURCES``), in a module that imports nothing.

The modules that act on them read this table: ``hf/convert.py`` (the ``transformers`` classes
of each source and of its conversion), ``hf/training.py`` (the folder types it trains, which of
them are mixtures of experts and their balance loss), ``serving/`` (the configurations, vLLM's
model of each source and the architectures ``attnres serve`` takes) and ``cli.py`` (help texts).
Each resolves a class by its name where it needs it (``importlib.import_module`` and
``getattr``): the command line's help reads this table before PyTorch loads, and the serving
environment, whose ``transformers`` is another version, never imports ``attnres.hf``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """One source architecture. ``model_type``: its ``config.json``'s ``model_type`` and the name
    of its module in ``transformers`` (``transformers.models.<model_type>``) and in vLLM
    (``vllm.model_executor.models.<model_type>``); ``name``: the CamelCase prefix of its classes
    (``<name>Config``, ``<name>ForCausalLM``, in ``transformers`` and vLLM alike) and of its
    conversion's (``AttnRes<name>ForCausalLM``); ``title``: how help texts and messages name it;
    ``one_mask``: all its layers take one attention mask, causal or, when ``sliding_window`` is
    set, sliding-window (the others list each layer's kind in ``layer_types``);
    ``balance_loss``: a mixture of experts' load-balancing loss as ``module:function``, ``None``
    for a dense model; ``vllm_mlp``: the attribute of vLLM's decoder layer that holds its MLP or
    sparse MoE block."""

    model_type: str
    name: str
    title: str
    one_mask: bool = False
    balance_loss: str | None = None
    vllm_mlp: str = "mlp"

    @property
    def moe(self) -> bool:
        """Whether it is a mixture of experts (its forward returns a router's balance loss)."""
        return self.balance_loss is not None

    @property
    def config_class(self) -> str:
        """Its configuration class in ``transformers`` (``transformers_module``, and
        ``transformers`` itself)."""
        return f"{self.name}Config"

    @property
    def causal_lm_class(self) -> str:
        """Its causal LM class in ``transformers`` and in vLLM, and the architecture its
        ``config.json`` declares."""
        return f"{self.name}ForCausalLM"

    @property
    def transformers_module(self) -> str:
        return f"transformers.models.{self.model_type}"

    @property
    def vllm_module(self) -> str:
        return f"vllm.model_executor.models.{self.model_type}"

    @property
    def converted_type(self) -> str:
        """The ``model_type`` of its Delta AttnRes conversion."""
        return f"attnres_{self.model_type}"

    @property
    def converted_class(self) -> str:
        """The causal LM class of its conversion, and the architecture a converted folder's
        ``config.json`` declares."""
        return f"AttnRes{self.name}ForCausalLM"


def _balance_loss(model_type: str) -> str:
    return f"transformers.models.{model_type}.modeling_{model_type}:load_balancing_loss_func"


#: the source architectures by ``model_type``, in the order the package registers them
SOURCES: dict[str, Source] = {source.model_type: source for source in (
    Source("llama", "Llama", "Llama"),
    Source("mistral", "Mistral", "Mistral", one_mask=True),
    Source("qwen2", "Qwen2", "Qwen2"),
    Source("qwen3", "Qwen3", "Qwen3"),
    Source("mixtral", "Mixtral", "Mixtral", one_mask=True, balance_loss=_balance_loss("mixtral"),
           vllm_mlp="block_sparse_moe"),
    Source("qwen3_moe", "Qwen3Moe", "Qwen3-MoE", one_mask=True, balance_loss=_balance_loss("qwen3_moe")),
)}


def titles(sources=None) -> str:
    """The titles of ``sources`` (default: every one), joined by ``/`` as help texts and messages
    list them: ``Llama/Mistral/...``."""
    return "/".join(source.title for source in (SOURCES.values() if sources is None else sources))
