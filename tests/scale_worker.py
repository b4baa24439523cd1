"""Run under ``torchrun`` by ``tests/test_scale.py``: two ranks save a sharded checkpoint of a
tiny model, then start a second save during which rank 1 dies (``os._exit``) after writing its
shard, before the checkpoint is complete. Rank 0 writes what it saw to ``OUT/rank0.json``
before the second save; the job then fails."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from attnres.train.config import OptimConfig
from attnres.train.sharded import save_sharded
from attnres.train.trainer import build_optimizer

from .conftest import tiny_model


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    model = tiny_model("block")
    optimizer = build_optimizer(OptimConfig(), model)
    model(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    state = dict(rng=torch.get_rng_state(), step=1, config={}, grad_norm_sums=None, grad_norm_count=0)
    save_sharded(out / "checkpoints", 1, model, optimizer, state)
    if dist.get_rank() == 0:
        weights = {k: v.tolist() for k, v in model.state_dict().items()}
        (out / "rank0.json").write_text(json.dumps(weights))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if dist.get_rank() == 1:  # this rank writes its shard, then dies
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            written = write_data(self, plan, planner)
            written.wait()
            os._exit(9)

        FileSystemWriter.write_data = write_then_die
    save_sharded(out / "checkpoints", 2, model, optimizer, {**state, "step": 2})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
