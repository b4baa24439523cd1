"""A pipelined training step against DDP on the same two ranks: time per optimizer step, the
bubble of each schedule, and peak memory per rank, for Block AttnRes on the train-step
benchmark's model.

Variants, each a ``torchrun --nproc_per_node=2`` job (gloo on CPU) that builds the model as a
distributed run does (each rank its part, on the meta device), takes ``--warmup`` steps, then
times ``--steps`` optimizer steps (forward, backward, AdamW) of one batch of 8 x 256 tokens:
- ``ddp``: DDP, each rank on 4 rows;
- ``pp-1f1b``: 2 stages, 1F1B, 4 micro-batches of 2 rows;
- ``pp-interleaved``: 4 stages (2 per rank), interleaved 1F1B, 4 micro-batches, cache off;
- ``pp-interleaved-cache``: the same with the cross-stage cache;
- ``pp-zbv``: 4 stages in a V (rank 0 holds 0 and 3), ZBV, 4 micro-batches, cache off.
The variants run in turn in every round; each round's ratio is against that round's ``ddp``.
Memory is the growth of peak RSS (VmHWM) above the RSS before the model was built, per rank.

The bubble is read from each rank's own profile: one more forward and backward runs under the
profiler, and the share of its wall time in which the rank runs no profiled operation (the sum
of every event's self time is the time inside operations) is the rank's idle fraction: waiting
for the other rank, plus the Python between operations. DDP's idle fraction, taken the same
way, is that Python share and its all-reduce; a schedule's excess over it is its bubble. (The
schedules' own ``record_function`` events are not in the profile under torch 2.13's runtime, and
their time would include the waits for received tensors.) On two cores each rank has one; the
two ranks' compute does not contend.

    python benchmarks/pipeline_step.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, peak_rss_mib, print_table, rss_mib, write_csv  # noqa: E402

VARIANTS = {
    "ddp": None,
    "pp-1f1b": dict(schedule="1f1b", cache="off"),
    "pp-interleaved": dict(schedule="interleaved1f1b", cache="off"),
    "pp-interleaved-cache": dict(schedule="interleaved1f1b", cache="on"),
    "pp-zbv": dict(schedule="zbv", cache="off"),
}
BATCH, SEQ, MICROBATCHES = 8, 256, 4


def worker(variant: str, steps: int, warmup: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from train_step import SIZES, VARIANTS as DESIGNS

    from attnres import ModelConfig, Transformer
    from attnres.model import lm_loss
    from attnres.train.materialize import rank_model
    from attnres.train.parallel_plan import plan_parallel
    from attnres.train.pipeline import build_pipeline

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = rss_mib()
    config = ModelConfig(**SIZES, **DESIGNS["block"])
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=g)
    y = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=g)
    options = VARIANTS[variant]
    if options is None:
        model = rank_model(config, 0, plan_parallel(config, world).part(0))
        ddp = DistributedDataParallel(model)
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)

        def backward():
            lm_loss(ddp(x[rows]), y[rows]).backward()
    else:
        plan = plan_parallel(config, world, pp_size=world, schedule=options["schedule"], microbatches=MICROBATCHES,
                             cache=options["cache"])
        model = rank_model(config, 0, plan.part(rank))
        pipe = build_pipeline(model, plan)

        def backward():
            pipe.step(x, y)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        backward()
        optimizer.step()
        dist.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    growth = peak_rss_mib() - base
    from torch.profiler import ProfilerActivity, profile

    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        backward()
        wall = time.perf_counter() - start
    busy = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    bubble = 1 - busy / wall
    (out / f"{variant}.rank{rank}.json").write_text(json.dumps(dict(seconds=statistics.median(times),
                                                                     growth_mib=growth, bubble=bubble)))
    dist.destroy_process_group()


def launch(variant: str, steps: int, warmup: int, out: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", __file__,
           "--worker", variant, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"{variant}.rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--csv", default="pipeline_step")
    ap.add_argument("--worker")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out)
        return
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="pipeline-step-"))
    runs = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            runs[variant].append(launch(variant, args.steps, args.warmup, out))
    rows = []
    for variant, rounds in runs.items():
        ratios = [max(r["seconds"] for r in run) / max(b["seconds"] for b in base)
                  for run, base in zip(rounds, runs["ddp"])]
        rows.append(dict(variant=variant, step_s=statistics.median(max(r["seconds"] for r in run) for run in rounds),
                         ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                         rank0_mib=statistics.median(run[0]["growth_mib"] for run in rounds),
                         rank1_mib=statistics.median(run[1]["growth_mib"] for run in rounds),
                         idle_rank0=statistics.median(run[0]["bubble"] for run in rounds),
                         idle_rank1=statistics.median(run[1]["bubble"] for run in rounds)))
    print_table(rows, list(rows[0]))
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
