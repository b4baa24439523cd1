"""How far a conversion's routing moved from its identity initialization over a continuation
(docs/RESULTS.md, "Mid-training a converted model: the run"): for each routing tensor of a run of
``attnres compare --from``, the largest absolute change from the converted folder the run started
from (``init_from`` in its ``config.json``) to its last checkpoint, beside the sum of the run's
learning rates over its steps (how far AdamW, whose step is at most about the learning rate per
coordinate, could have moved one parameter that always pushed one way).

    python studies/routing_movement.py runs/conversion/compare-<ts>/convert+heads=1+block_layers=2-seed1
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file

from attnres.files import read_json
from attnres.train.checkpoint_store import latest_checkpoint
from attnres.train.config import from_dict
from attnres.train.steps import lr_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, nargs="+")
    args = parser.parse_args()
    for run_dir in args.run_dir:
        cfg = from_dict(read_json(run_dir / "config.json"))
        if cfg.init_from is None:
            raise SystemExit(f"{run_dir}: not a run --from a folder (its config.json has no init_from)")
        ckpt = latest_checkpoint(run_dir / "checkpoints")
        if ckpt is None:
            raise SystemExit(f"{run_dir}: no checkpoint")
        start = load_file(Path(cfg.init_from) / "model.safetensors")
        end = load_file(ckpt / "model.safetensors")
        reach = sum(lr_at(step, cfg.run.steps, cfg.optim) for step in range(cfg.run.steps))
        print(f"{run_dir.name} ({ckpt.name}): the sum of its learning rates {reach:.3f}")
        for name in sorted(start):
            if not name.startswith("routing."):
                continue
            final = end.get(name, end.get(f"lm.{name}"))
            if final is None:
                raise SystemExit(f"{ckpt}: no tensor {name} (nor lm.{name})")
            change = (final.float() - start[name].float()).abs().max().item()
            print(f"  {name} {tuple(start[name].shape)}: largest change {change:.4f} "
                  f"(from |x| <= {start[name].float().abs().max().item():.4f})")


if __name__ == "__main__":
    main()
