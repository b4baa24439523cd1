"""Pipeline parallelism on real torchrun with two gloo ranks: one launch runs every case
(``tests/pipeline_worker.py``): each design and schedule pipelines one training step and is
compared, on every rank, with one process running the same micro-batches."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnres.train.pipeline import SCHEDULES, stage_bounds, stage_indices

from .pipeline_worker import DESIGNS, OTHERS

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           "-m", "tests.pipeline_worker", str(out)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_pipelined_step_equals_one_process_with_the_same_micro_batches(results, schedule):
    """The loss bit for bit and every gradient within 1e-6 relative, on both ranks: every design
    (uneven blocks included) under GPipe, 1F1B, interleaved 1F1B and ZBV; Block and Delta under
    looped BFS and DualPipeV."""
    for rank in results:
        for design in OTHERS.get(schedule, DESIGNS):
            r = rank[f"{design}/{schedule}"]
            assert r["loss"] == r["ref_loss"], (design, r)
            assert r["max_rel_grad"] <= 1e-6, (design, r)
    # a running sum's gradients cross the boundary unchanged: bitwise where each stage owns its
    # parameters' reads (the schedules that keep one process's accumulation order)
    if schedule not in OTHERS:
        assert all(rank[f"prenorm/{schedule}"]["bitwise"] for rank in results)


def test_stages_cover_the_sublayers_as_given_or_evenly():
    assert stage_bounds(8, 2) == [(0, 4), (4, 8)]
    assert stage_bounds(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert stage_bounds(8, 3, [2, 5, 1]) == [(0, 2), (2, 7), (7, 8)]
    assert stage_indices("gpipe", 1, 2) == [1]
    assert stage_indices("interleaved1f1b", 1, 2) == [1, 3]
    assert stage_indices("zbv", 0, 2) == [0, 3] and stage_indices("dualpipev", 1, 2) == [1, 2]


@pytest.mark.parametrize("call,message", [
    (lambda: stage_bounds(4, 5), r"5 stages for 4 sublayers: a stage needs at least one sublayer"),
    (lambda: stage_bounds(8, 3, [4, 4]), r"split=\[4, 4\] must be 3 positive sublayer counts summing to 8"),
    (lambda: stage_bounds(8, 2, [8, 0]), r"split=\[8, 0\] must be 2 positive sublayer counts summing to 8"),
    (lambda: stage_indices("pipedream", 0, 2), r"pipeline schedule 'pipedream' is not one of"),
])
def test_bad_stage_layouts_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("sets,message", [
    (["run.pp_size=2", "run.pp_schedule=pipedream"], "run.pp_schedule='pipedream' must be one of"),
    (["run.pp_size=2", "run.pp_microbatches=3"], "3 micro-batches must be a positive integer dividing the batch of 4"),
    (["run.pp_size=2", "run.pp_microbatches=1"], "'1f1b' needs at least as many micro-batches as stages (2), given 1"),
    (["run.pp_size=8"], "8 stages for 4 sublayers: a stage needs at least one sublayer"),
    (["run.pp_size=2", "run.pp_split=3,2"], "split=[3, 2] must be 2 positive sublayer counts summing to 4"),
    (["run.pp_size=2", "run.grad_accum=2"], "grad_accum is not supported with it"),
    (["run.pp_size=2", "run.pp_schedule=zbv", "run.pp_stages_per_rank=3"], "runs exactly 2 stages per rank, given 3"),
    (["run.pp_microbatches=2"], "apply to a pipelined run: set run.pp_size > 1"),
])
def test_bad_pipeline_options_are_refused_before_any_work(sets, message):
    from attnres.train.config import apply_override, tiny

    cfg = tiny()  # 2 layers (4 sublayers), batch 4
    for assignment in sets:
        cfg = apply_override(cfg, assignment)
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg.validate()


def test_a_pipeline_without_its_processes_is_refused_in_one_line(tmp_path, capsys):
    from attnres.cli import main

    assert main(["train", "--preset", "tiny", "--set", "run.pp_size=2", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "run.pp_size=2 must divide the job's 1 processes" in err
    assert not (tmp_path / "run").exists()
