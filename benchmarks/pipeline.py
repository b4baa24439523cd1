"""What crosses each pipeline hop, per design, with and without the cross-stage cache: the
bytes per micro-batch that each stage hands to ``torch.distributed.pipelining`` to send, measured
by running the stages (``pipeline.stage_modules``) on one micro-batch in one process, against
the analytical count.

The train-step benchmark's model (dim 512, 16 sublayers; Block, MHAR and Delta in 8 blocks of 2,
HC, mHC and GR with 4 streams), a micro-batch of 2 x 256 tokens in fp32: one ``[tokens, D]``
tensor is 1 MiB. Layouts: 4 stages on 4 ranks (1F1B: no rank holds two stages, nothing to cache),
and 8 virtual stages on 4 ranks, looped (interleaved 1F1B: rank ``r`` holds ``r`` and ``r + 4``)
and V-shaped (ZBV: ``r`` and ``7 - r``; the hop 3 -> 4 stays on its rank and sends nothing).

    python benchmarks/pipeline.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_csv  # noqa: E402
from train_step import SIZES, VARIANTS  # noqa: E402

from attnres import ModelConfig, Transformer  # noqa: E402
from attnres.train.parallel_plan import CACHED_RESIDUALS, ParallelPlan, plan_parallel  # noqa: E402
from attnres.train.pipeline_stages import stage_modules  # noqa: E402

DESIGNS = ("prenorm", "block", "mhar", "full", "delta", "hc", "mhc", "gr")
BATCH, SEQ = 2, 256
RANKS = 4
#: name -> (schedule, stages per rank)
LAYOUTS = {"4 stages": ("1f1b", 1), "8 virtual, looped": ("interleaved1f1b", 2), "8 virtual, V": ("zbv", 2)}


def layout_plan(model: Transformer, schedule: str, per_rank: int, caching: bool) -> ParallelPlan:
    return plan_parallel(model.config, RANKS, pp_size=RANKS, schedule=schedule, stages_per_rank=per_rank,
                         cache="on" if caching else "off")


@torch.no_grad()
def measured(model: Transformer, schedule: str, per_rank: int, caching: bool) -> list[int]:
    """Bytes each hop sends for one micro-batch (0 where both stages are on one rank)."""
    plan = layout_plan(model, schedule, per_rank, caching)
    modules = stage_modules(model, plan)
    owner = plan.owners
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mb = torch.zeros(1, dtype=torch.long)
    sent, outputs = [], (tokens,)
    for index, module in enumerate(modules[:-1]):
        outputs = module(*outputs, microbatch=mb)
        crosses = owner[index] != owner[index + 1]
        sent.append(sum(t.numel() * t.element_size() for t in outputs) if crosses else 0)
    return sent


def analytical(model: Transformer, schedule: str, per_rank: int, caching: bool) -> list[int]:
    """``[tokens, D]`` tensors each hop needs: one running sum for PreNorm, ``n`` streams for
    HC/mHC/GR; for Full every source, for Block ``e``, the completed blocks and the partial
    mid-block, for Delta the same plus ``h``. With the cache, less the sources the receiving rank
    completed or received by the end of its stage before (not counting the stage just before it)."""
    kind, sizes = model.config.residual, getattr(model.stream, "block_sizes", None)

    def sources(cut: int) -> int:
        if kind == "full":
            return cut + 1
        return 1 + sum(sum(sizes[: k + 1]) <= cut for k in range(len(sizes)))

    def rest(cut: int) -> int:
        if kind == "prenorm":
            return 1
        if kind in ("hc", "mhc", "gr"):
            return model.config.streams
        if kind == "full":
            return 0
        ends = {sum(sizes[: k + 1]) for k in range(len(sizes))}
        return int(cut not in ends) + (kind == "delta")

    plan = layout_plan(model, schedule, per_rank, caching)
    n, owner = len(plan.stages), plan.owners
    bounds = [(stage.first, stage.last) for stage in plan.stages]
    counts = []
    for s in range(1, n):
        if owner[s] == owner[s - 1]:
            counts.append(0)
            continue
        cut = bounds[s][0]
        completed = 0 if kind in ("prenorm", "hc", "mhc", "gr") else sources(cut)
        earlier = [p for p in range(s - 1) if owner[p] == owner[s]]
        held = sources(bounds[earlier[-1]][1]) if caching and earlier else 0
        counts.append(completed - held + rest(cut))
    return counts


def main():
    rows = []
    unit = BATCH * SEQ * SIZES["dim"] * 4
    for design in DESIGNS:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**SIZES, **VARIANTS[design]))
        for layout, (schedule, per_rank) in LAYOUTS.items():
            for caching in (False, True):
                if caching and (per_rank == 1 or model.config.residual not in CACHED_RESIDUALS):
                    continue
                got = measured(model, schedule, per_rank, caching)
                expected = analytical(model, schedule, per_rank, caching)
                rows.append(dict(design=design, layout=layout, cache="on" if caching else "off",
                                 mib_per_hop=" ".join(f"{b / 2**20:g}" for b in got), mib_total=sum(got) / 2**20,
                                 analytical_mib=" ".join(f"{n * unit / 2**20:g}" for n in expected),
                                 matches=got == [n * unit for n in expected]))
    print_table(rows, list(rows[0]))
    write_csv("pipeline_hops", rows)


if __name__ == "__main__":
    main()
