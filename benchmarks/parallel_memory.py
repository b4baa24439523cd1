"""Memory per rank under each layout the trainer builds: the bytes of parameters + gradients +
optimizer state after the first optimizer step (what ``summary.json``'s ``ranks`` reports as
``state_bytes``), and the growth of peak RSS (VmHWM) over the first step above the RSS before the
model was built, for Block AttnRes on the train-step benchmark's model (dim 512, 8 layers,
vocab 256, untied head; batch 8 x 256 in 4 micro-batches of 2 rows).

Layouts, each a job of its own (gloo on CPU), built as ``attnres train`` builds them
(``trainer.build_model``: the meta device, each rank's part, the wrappers):
- ``one``: one process (4 gradient-accumulation steps);
- ``ddp2``: DDP on 2 ranks;
- ``pp2``: 2 stages, 1F1B;
- ``pp4``: 4 stages, 1F1B;
- ``pp2-fsdp2``: 2 stages times 2 copies, each stage sharded with FSDP2 over its copies.
Each rank is given as a ratio to ``one``. Memory does not depend on the two cores the four
processes share (time does; times are not reported here).

    python benchmarks/parallel_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, peak_rss_mib, print_table, rss_mib, write_csv  # noqa: E402

LAYOUTS = {
    "one": (1, {"grad_accum": 4}),
    "ddp2": (2, {"grad_accum": 2}),
    "pp2": (2, {"pp_size": 2, "pp_microbatches": 4}),
    "pp4": (4, {"pp_size": 4, "pp_microbatches": 4}),
    "pp2-fsdp2": (4, {"pp_size": 2, "pp_microbatches": 2, "parallel": "fsdp"}),
}
BATCH, SEQ = 8, 256


def worker(layout: str, out: Path) -> None:
    import torch
    from train_step import SIZES, VARIANTS as DESIGNS

    from attnres import ModelConfig
    from attnres.model import lm_loss
    from attnres.train.config import RunConfig, TrainConfig
    from attnres.train.parallel_plan import run_plan
    from attnres.train.stage_local import rank_footprint
    from attnres.train.steps import accumulate_gradients
    from attnres.train.trainer import build_model, build_optimizer, start_processes

    processes, run = LAYOUTS[layout]
    cfg = TrainConfig(model=ModelConfig(**SIZES, **DESIGNS["block"]),
                      run=RunConfig(batch_size=BATCH, seq_len=SEQ, device="cpu", **run))
    place = start_processes(cfg, run_plan(cfg, processes))
    base = rss_mib()
    model, wrapped, forward, pipe = build_model(cfg, place)
    optimizer = build_optimizer(cfg.optim, model)
    built = peak_rss_mib() - base
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=g)
    y = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=g)
    rows = slice(place.dp_rank * BATCH // place.dp_size, (place.dp_rank + 1) * BATCH // place.dp_size)
    if pipe is not None:
        pipe.step(x[rows], y[rows])
        pipe.clip_gradients(1.0)
    else:
        accumulate_gradients(lambda xs, ys: lm_loss(forward(xs), ys), x[rows], y[rows], cfg.run.grad_accum)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    entry = dict(rank=place.info.rank, stages=pipe.stage_indices if pipe is not None else [],
                 **rank_footprint(model, optimizer), build_peak_mib=built, peak_growth_mib=peak_rss_mib() - base)
    (out / f"{layout}.rank{place.info.rank}.json").write_text(json.dumps(entry))
    if place.info.distributed:
        torch.distributed.destroy_process_group()


def launch(layout: str, out: Path) -> list[dict]:
    processes, _ = LAYOUTS[layout]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    runner = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--standalone"]
    proc = subprocess.run([*runner, __file__, "--worker", layout, "--out", str(out)], capture_output=True, text=True,
                          env=env, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{layout} failed:\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"{layout}.rank{r}.json").read_text()) for r in range(processes)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="parallel_memory")
    ap.add_argument("--worker")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.out)
        return
    out = Path(tempfile.mkdtemp(prefix="parallel-memory-"))
    results = {layout: launch(layout, out) for layout in LAYOUTS}
    one = results["one"][0]
    rows = []
    for layout, ranks in results.items():
        for r in ranks:
            rows.append(dict(layout=layout, rank=r["rank"], stages=" ".join(map(str, r["stages"])) or "-",
                             param_count=r["param_count"], state_mib=r["state_bytes"] / 2**20,
                             state_ratio=r["state_bytes"] / one["state_bytes"], build_peak_mib=r["build_peak_mib"],
                             peak_growth_mib=r["peak_growth_mib"],
                             peak_ratio=r["peak_growth_mib"] / one["peak_growth_mib"]))
    print_table(rows, list(rows[0]))
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
