"""Real torchrun with two gloo ranks: DDP and FSDP2 match one process on the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# every test here launches torchrun
pytestmark = pytest.mark.slow

COMMON = ["--preset", "tiny", "--set", "model.residual=block", "--set", "run.steps=5",
          "--set", "run.log_every=1", "--set", "run.progress=false", "--set", "run.tensorboard=false",
          "--set", "run.eval_every=5"]


def train_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


def run(cmd, tmp):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    run([sys.executable, "-m", "attnres", "train", *COMMON, "--run-dir", str(tmp / "run")], tmp)
    return train_losses(tmp / "run")


@pytest.mark.xdist_group("distributed_single")  # one worker runs the one-process twin once
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(single, tmp_path, parallel):
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         "-m", "attnres", "train", *COMMON, "--set", f"run.parallel={parallel}", "--run-dir", str(tmp_path / "run")],
        tmp_path)
    losses = train_losses(tmp_path / "run")
    assert len(losses) == len(single) == 5
    for a, b in zip(losses, single):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, single)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2
    # the checkpoint is sharded (each rank wrote its part: DCP's metadata, one file per rank),
    # and reads back whole in one process
    from attnres.train.checkpoint import latest_checkpoint, load_checkpoint

    checkpoint = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert (checkpoint / ".metadata").is_file() and not (checkpoint / "model.safetensors").exists()
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    weights, _ = load_checkpoint(checkpoint)
    assert weights["tok_embeddings.weight"].shape == (256, 32)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1] and all(r["stages"] == [] for r in summary["ranks"])
    if parallel == "fsdp":  # each rank holds half of every sharded parameter's rows
        assert all(r["param_count"] < summary["parameters"] for r in summary["ranks"])
    else:
        assert all(r["param_count"] == summary["parameters"] for r in summary["ranks"])


MOE = ["--set", "model.moe_experts=4", "--set", "model.moe_balance=bias", "--set", "model.moe_bias_rate=0.01",
       "--set", "model.moe_capacity=1.0"]


@pytest.fixture(scope="module")
def single_moe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single_moe")
    run([sys.executable, "-m", "attnres", "train", *COMMON, *MOE, "--set", "run.grad_accum=2",
         "--run-dir", str(tmp / "single")], tmp)
    return tmp / "single"


@pytest.mark.xdist_group("distributed_moe")  # one worker runs the one-process twin once
@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "pipeline"])
def test_moe_on_two_ranks_matches_one_process_with_the_same_micro_batches(single_moe, tmp_path, parallel):
    """Two ranks of half the batch each, or a pipeline of two stages over two micro-batches,
    against one process with two micro-batches of that size (the capacity counts a forward's
    tokens): the same losses, expert load and balance bias, the load summed over ranks (in the
    pipeline, each layer's on the rank that holds it) as over micro-batches."""
    (tmp_path / "single").symlink_to(single_moe)
    layout = (["--set", "run.pp_size=2", "--set", "run.pp_microbatches=2"] if parallel == "pipeline"
              else ["--set", f"run.parallel={parallel}"])
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "attnres",
         "train", *COMMON, *MOE, *layout, "--run-dir", str(tmp_path / "ddp")], tmp_path)
    rows = {}
    for name in ("single", "ddp"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        rows[name] = [json.loads(line) for line in lines if '"split": "train"' in line]
    assert len(rows["ddp"]) == len(rows["single"]) == 5
    for a, b in zip(rows["ddp"], rows["single"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])
        assert a["expert_load"] == b["expert_load"] and a["expert_dropped"] == b["expert_dropped"]
    from attnres.train.checkpoint import latest_checkpoint, load_checkpoint

    bias = [load_checkpoint(latest_checkpoint(tmp_path / name / "checkpoints"))[0]["layers.1.mlp.expert_bias"]
            for name in ("single", "ddp")]
    assert bias[0].abs().sum() > 0 and torch.equal(bias[0], bias[1])


def test_a_pipelined_run_matches_one_process_and_its_checkpoint_resumes_in_one(tmp_path):
    """attnres train with run.pp_size=2 (1F1B, 2 micro-batches) on two ranks against one process
    with 2 gradient-accumulation steps: the same losses; the checkpoint is sharded, holds the
    same weights, and a single process resumes it (the pipeline's settings dropped with
    run.pp_size=1)."""
    run([sys.executable, "-m", "attnres", "train", *COMMON, "--set", "run.grad_accum=2",
         "--run-dir", str(tmp_path / "single")], tmp_path)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m",
                           "attnres", "train", *COMMON, "--set", "run.pp_size=2", "--set", "run.pp_microbatches=2",
                           "--run-dir", str(tmp_path / "pp")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("done: step 5") == 1  # one rank reports
    single, pp = train_losses(tmp_path / "single"), train_losses(tmp_path / "pp")
    assert len(pp) == 5 and all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(pp, single)), (pp, single)
    from attnres.train.checkpoint import latest_checkpoint, load_checkpoint

    weights = [load_checkpoint(latest_checkpoint(tmp_path / name / "checkpoints"))[0] for name in ("single", "pp")]
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, rtol=1e-5, atol=1e-7, msg=name)
    run([sys.executable, "-m", "attnres", "train", "--run-dir", str(tmp_path / "pp"), "--resume",
         "--set", "run.steps=6", "--set", "run.pp_size=1", "--set", "run.grad_accum=2"], tmp_path)
    assert len(train_losses(tmp_path / "pp")) == 6


def test_two_pipelines_side_by_side_match_one_process(tmp_path):
    """Four ranks on a (dp 2, pp 2) mesh: two pipelines of four interleaved stages (two per
    rank, the cross-stage cache on by default), each on half of a batch of 6 in 3 micro-batches,
    against one process with 6 gradient-accumulation steps: the same losses, and the same
    validation loss (every row of the batch evaluated once per pipeline)."""
    sizes = ["--set", "run.steps=3", "--set", "run.batch_size=6", "--set", "run.eval_every=3"]
    run([sys.executable, "-m", "attnres", "train", *COMMON, *sizes, "--set", "run.grad_accum=6",
         "--run-dir", str(tmp_path / "single")], tmp_path)
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--standalone", "-m", "attnres", "train",
         *COMMON, *sizes, "--set", "run.pp_size=2", "--set", "run.pp_microbatches=3",
         "--set", "run.pp_schedule=interleaved1f1b", "--run-dir", str(tmp_path / "pp")], tmp_path)
    single, pp = train_losses(tmp_path / "single"), train_losses(tmp_path / "pp")
    assert len(pp) == 3 and all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(pp, single)), (pp, single)
    val = [json.loads((tmp_path / name / "summary.json").read_text())["final_val_loss"] for name in ("single", "pp")]
    assert abs(val[0] - val[1]) <= 1e-6 * abs(val[0]), val


@pytest.mark.parametrize("placement", [
    [],
    ["--set", "run.pp_size=2", "--set", "run.pp_schedule=interleaved1f1b", "--set", "run.pp_microbatches=2"],
], ids=["ddp", "pipeline"])
def test_a_killed_rank_ends_the_job_in_bounded_time_and_the_job_resumes(tmp_path, placement):
    """One of two ranks is killed mid-run, under DDP and in a pipeline of 4 interleaved stages
    (the other rank then waits on a hop that never comes): the job ends with an error within a
    minute, no rank is left waiting, and the job resumes from its last checkpoint, every step
    logged once."""
    import signal
    import time

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "attnres",
           "train", *COMMON, *placement, "--set", "run.steps=400", "--set", "run.ckpt_every=5",
           "--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    log = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while (not log.exists() or len(log.read_text().splitlines()) < 12) and agent.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    workers = [int(p) for p in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()]
    assert agent.poll() is None and len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)  # one rank dies mid-step
    killed = time.time()
    _, err = agent.communicate(timeout=120)
    assert agent.returncode != 0 and time.time() - killed < 60, err[-2000:]
    for pid in workers:  # no rank is left waiting on the dead one
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "attnres",
         "train", *COMMON[2:], *placement, "--set", "run.steps=20", "--run-dir", str(tmp_path / "run"), "--resume"],
        tmp_path)
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines() if '"train"' in line]
    assert steps == list(range(1, 21))  # every step once, across the crash


def test_bad_input_under_torchrun_is_reported_once(tmp_path):
    """Every rank refuses the same input; rank 0 says so, once, and the others exit quietly."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "attnres",
           "train", *COMMON, "--set", "optim.grad_clip=-1", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("attnres train: error:")]
    assert errors == ["attnres train: error: optim.grad_clip=-1.0 must be in (0, inf)"], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
