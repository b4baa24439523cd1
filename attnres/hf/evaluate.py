"""Evaluation with lm-evaluation-harness on a saved attnres model (native or converted).

Importing ``attnres.hf`` registers the model classes with the Auto classes, so lm-eval's ``HFLM``
loads the folder like any Hugging Face model: no ``trust_remote_code``, nothing executed from
the checkpoint. Generation tasks need ``batch_size=1`` (the models run unpadded inputs).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..files import read_json


def runnable_config(model_dir: Path, device: str) -> dict:
    """``from_pretrained``'s ``config`` for a native attnres folder whose routing backend cannot
    run on ``device`` (a model trained with ``backend=triton`` on a GPU, evaluated on a CPU):
    the same model with ``backend="auto"``, said in one line; ``{}`` otherwise."""
    import sys

    from transformers import AutoConfig

    from ..train.validate import runnable_model

    config = AutoConfig.from_pretrained(str(model_dir))
    if getattr(config, "model_type", None) != "attnres":
        return {}
    model, note = runnable_model(config.model_config(), torch.device(device))
    if note is None:
        return {}
    print(f"attnres eval: {note}", file=sys.stderr)
    config.attnres = {**config.attnres, "backend": model.backend}
    return {"config": config}


def lm_eval_model(model_dir: str | Path, device: str = "cpu", batch_size: int = 1):
    """lm-eval's ``HFLM`` around the model and tokenizer saved in ``model_dir``."""
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as exc:
        raise ValueError(f"evaluation needs lm-evaluation-harness with its hf extra ({exc}): "
                         "pip install 'attnres[hf]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import register  # noqa: F401  (the Auto classes know attnres models from here on)

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise ValueError(f"{model_dir} is not a saved model folder (config.json missing)")
    config = read_json(model_dir / "config.json")
    vocab = config.get("vocab_size") if isinstance(config, dict) else None
    if type(vocab) is not int or vocab < 1:
        raise ValueError(f"{model_dir / 'config.json'} holds no vocab_size (a positive integer)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{model_dir} holds no tokenizer that loads ({reason})") from None
    if len(tokenizer) > vocab:  # a token id past the embedding would index out of it
        raise ValueError(f"the tokenizer in {model_dir} has {len(tokenizer)} tokens, more than the model's vocabulary "
                         f"(vocab_size={vocab} in config.json): save the model's own tokenizer with it")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **runnable_config(model_dir, device)).eval()
    return HFLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size)


def task_manager(tasks: list[str], include_path: str | None = None):
    """lm-eval's ``TaskManager`` (with the task YAMLs of ``include_path``), every one of
    ``tasks`` known to it (``ValueError`` naming those that are not)."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise ValueError(f"evaluation needs lm-evaluation-harness with its hf extra ({exc}): "
                         "pip install 'attnres[hf]'") from None
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; `lm_eval ls tasks` lists them "
                         f"(and --include-path adds a folder of task YAML files)")
    return manager


def check_known_tasks(tasks: list[str], include_path: str | None = None) -> None:
    """``ValueError`` naming the ``tasks`` lm-eval does not know, as ``task_manager`` does, but
    without indexing lm-eval's own task files when the include path's alone hold every one (an
    index of a folder is instant; lm-eval's own takes seconds)."""
    if include_path:
        try:
            from lm_eval.tasks import TaskManager
        except ImportError:
            TaskManager = None
        if TaskManager is not None:
            local = TaskManager(include_path=include_path, include_defaults=False)
            if all(local.match_tasks([t]) for t in tasks):
                return
    task_manager(tasks, include_path)


def evaluate(model_dir: str | Path, tasks: list[str], *, include_path: str | None = None,
             limit: int | None = None, device: str = "cpu", batch_size: int = 1,
             log_samples: bool = False) -> dict:
    """Run ``lm_eval.simple_evaluate`` on ``tasks``; ``include_path`` adds a folder of task YAMLs."""
    if limit is not None and not limit > 0:
        raise ValueError(f"limit={limit} must be a positive number of examples per task, a fraction in (0, 1) "
                         f"of them, or None for all")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    try:
        torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a torch device (cpu, cuda, cuda:1, mps, ...)") from None
    from lm_eval import simple_evaluate

    manager = task_manager(tasks, include_path)
    lm = lm_eval_model(model_dir, device=device, batch_size=batch_size)
    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=log_samples)
