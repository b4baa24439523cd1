"""Run under ``torchrun`` by ``tests/test_pipeline.py``: every case pipelines one training step
of a tiny model over the ranks and compares it, on every rank, with one process running the same
micro-batches with gradient accumulation. Writes ``OUT/rank{r}.json``."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from attnres.model import lm_loss
from attnres.train.pipeline import build_pipeline
from attnres.train.trainer import accumulate_gradients

from .conftest import randomize_stream, tiny_model

DESIGNS = ("prenorm", "block", "mhar", "mhar-uneven", "full", "delta", "mhc")
#: every design under these; the other schedules with Block and Delta (the suite's time)
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zbv")
OTHERS = {"loopedbfs": ("block", "delta"), "dualpipev": ("block", "delta")}
MICROBATCHES = 4


def case(design: str, schedule: str) -> dict:
    model = tiny_model(design, n_layers=4)  # 8 sublayers: 2 or 4 stages of 2 to 4
    randomize_stream(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (8, 8), generator=g)
    y = torch.randint(0, 64, (8, 8), generator=g)
    model.zero_grad()
    ref_loss = accumulate_gradients(lambda xs, ys: lm_loss(model(xs), ys), x, y, MICROBATCHES)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pipe = build_pipeline(model, schedule, MICROBATCHES)
    loss = pipe.step(x, y)
    worst, worst_name = 0.0, None
    for name, p in model.named_parameters():
        scale = ref[name].abs().max().clamp_min(1e-12)
        rel = float((p.grad - ref[name]).abs().max() / scale)
        if rel > worst:
            worst, worst_name = rel, name
    bitwise = all(torch.equal(p.grad, ref[n]) for n, p in model.named_parameters())
    return dict(loss=float(loss.detach()), ref_loss=float(ref_loss.detach()), max_rel_grad=worst, worst=worst_name, bitwise=bitwise)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    cases = [(d, s) for s in SCHEDULES for d in DESIGNS] + [(d, s) for s, ds in OTHERS.items() for d in ds]
    results = {f"{d}/{s}": case(d, s) for d, s in cases}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
