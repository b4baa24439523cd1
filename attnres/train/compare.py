"""Train several residual designs on the same data, batches, seed and budget; then report."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from ..analysis.capture import capture_analysis
from ..analysis.report import write_report
from ..model import ModelConfig
from ..streams import MODEL_OPTIONS
from .config import TrainConfig
from .data import batch_at, load_corpus
from .trainer import EVAL_SEED, train

# label -> model options; "n_kv_heads" stands for the model's number of KV heads
DESIGNS: dict[str, dict] = {
    "prenorm": dict(residual="prenorm"),
    "block": dict(residual="block", num_blocks=8),
    "mhar": dict(residual="block", num_blocks=8, heads="n_kv_heads"),
    "full": dict(residual="full"),
    "mhc": dict(residual="mhc"),
    "gr": dict(residual="gr"),
    "hc": dict(residual="hc"),
    "delta": dict(residual="delta", num_blocks=8, heads="n_kv_heads"),
}
DEFAULT_DESIGNS = ("prenorm", "block", "mhar", "full", "mhc", "gr")
#: what every design of a comparison shares: the model's fields but the residual kind and options
SIZE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "residual" and f.name not in MODEL_OPTIONS)


def design_config(base: ModelConfig, label: str) -> ModelConfig:
    """``base``'s sizes with design ``label``'s residual options."""
    if label not in DESIGNS:
        raise ValueError(f"unknown design {label!r}; expected one of {sorted(DESIGNS)}")
    options = dict(DESIGNS[label])
    if options.get("heads") == "n_kv_heads":
        options["heads"] = base.n_kv_heads
    if "num_blocks" in options:
        options["num_blocks"] = min(options["num_blocks"], base.num_sublayers)
    sizes = {f: getattr(base, f) for f in SIZE_FIELDS}
    return ModelConfig(**sizes, **options)


def compare(base: TrainConfig, designs=DEFAULT_DESIGNS, seeds=(0,), out_dir: str | Path = "runs",
            log=print) -> Path:
    """Train every design for every seed into ``out_dir/compare-<timestamp>/``; returns the
    path of the report."""
    base.validate()
    configs = {label: design_config(base.model, label) for label in designs}  # fail fast on bad labels
    root = Path(out_dir) / time.strftime("compare-%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=False)
    corpus = load_corpus(base.data, base.model.vocab_size, bpe_dir=root)
    index = {"designs": list(designs), "seeds": list(seeds), "runs": []}
    start = time.time()
    for seed in seeds:
        for label in designs:
            name = label if len(seeds) == 1 else f"{label}-seed{seed}"
            cfg = dataclasses.replace(base, model=configs[label], run=dataclasses.replace(base.run, seed=seed))
            log(f"[{time.time() - start:5.0f}s] training {name} ({cfg.run.steps} steps)")
            result = train(cfg, root / name, corpus=corpus)
            x, _ = batch_at(corpus.val, min(8, cfg.run.batch_size), cfg.run.seq_len, EVAL_SEED, 0)
            analysis = capture_analysis(result.model, x)
            (root / name / "analysis.json").write_text(json.dumps(analysis))
            log(f"[{time.time() - start:5.0f}s] {name}: validation loss {result.summary['final_val_loss']:.4f}")
            index["runs"].append({"design": label, "seed": seed, "dir": name})
            (root / "compare.json").write_text(json.dumps(index, indent=2))
    index["wall_time_s"] = time.time() - start
    (root / "compare.json").write_text(json.dumps(index, indent=2))
    return write_report(root)
