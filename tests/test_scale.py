"""Training past one process's memory, on real torchrun with gloo ranks: each rank builds its part
of the model on the meta device with one process's values; a pipeline of 2 stages times 2
copies sharded with FSDP2 trains as one process does, saves a sharded checkpoint, and every
other layout resumes it; a rank killed mid-save leaves the previous checkpoint; two launches
joined over a rendezvous endpoint ("two hosts") train as one launch does."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnres.model import Transformer
from attnres.train.materialize import rank_model
from attnres.train.parallel_plan import plan_parallel
from attnres.train.stage_local import Part, trim

from .conftest import tiny_config

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# batch 8 in micro-batches of 2 rows under every layout: one process accumulates 4, a data-
# parallel rank 2 of its 4 rows, a pipeline copy (dp 2) 2 of its 4, a pipeline of 4 stages 4
# the head tied to the embedding: under 1F1B the first and the last rank each hold it, under 4
# stages the last holds it alone (named as one process names it only in the checkpoint)
COMMON = ["--preset", "tiny", "--set", "model.residual=block", "--set", "model.tie_embeddings=true",
          "--set", "run.batch_size=8", "--set", "run.log_every=1",
          "--set", "run.progress=false", "--set", "run.tensorboard=false", "--set", "run.eval_every=4",
          "--set", "run.eval_batches=1"]
PP2_FSDP2 = ["--set", "run.pp_size=2", "--set", "run.pp_microbatches=2", "--set", "run.parallel=fsdp"]
#: every layout a pp 2 x FSDP2 2 checkpoint is resumed in: (processes, settings)
RESUMED = {
    "pp4": (4, ["--set", "run.pp_size=4", "--set", "run.pp_microbatches=4"]),
    "fsdp2": (2, ["--set", "run.pp_size=1", "--set", "run.parallel=fsdp", "--set", "run.grad_accum=2"]),
    "ddp2": (2, ["--set", "run.pp_size=1", "--set", "run.parallel=ddp", "--set", "run.grad_accum=2"]),
    "one": (1, ["--set", "run.pp_size=1", "--set", "run.grad_accum=4"]),
}

# under pytest-xdist the module runs in one worker, which launches each job once; the tests that
# launch torchrun are marked slow (make test-slow)
pytestmark = pytest.mark.xdist_group("scale_launches")


def launcher(processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable, "-m", "attnres"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--standalone", "-m",
            "attnres"]


def run(cmd, cwd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]


def train_losses(run_dir: Path) -> list[float]:
    """Each logged step's loss and gradient norm (before clipping), in step order: a gradient
    reduced or scaled wrongly changes the norm even where Adam's first steps hide it in the loss."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [value for r in rows if r["split"] == "train" for value in (r["loss"], r["grad_norm"])]


def close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process for 4 steps (the reference); pp 2 x FSDP2 2 for 2 steps, saved, then resumed
    to 4 steps in each layout of ``RESUMED`` (each from its own copy of the run)."""
    tmp = tmp_path_factory.mktemp("scale")
    run([*launcher(1), "train", *COMMON, "--set", "run.steps=4", "--set", "run.grad_accum=4", "--set",
         "run.ckpt_every=2", "--run-dir", str(tmp / "reference")], tmp)
    # the one-process checkpoint of step 2 (today's format), resumed by pp 2 x FSDP2 2
    shutil.copytree(tmp / "reference", tmp / "from_one")
    (tmp / "from_one" / "checkpoints" / "latest").write_text("step-0000002")
    shutil.rmtree(tmp / "from_one" / "checkpoints" / "step-0000004")
    run([*launcher(4), "train", "--run-dir", str(tmp / "from_one"), "--resume", *PP2_FSDP2, "--set",
         "run.grad_accum=1"], tmp)
    run([*launcher(4), "train", *COMMON, *PP2_FSDP2, "--set", "run.steps=2", "--run-dir", str(tmp / "saved")], tmp)
    for name, (processes, layout) in RESUMED.items():
        shutil.copytree(tmp / "saved", tmp / name)
        run([*launcher(processes), "train", "--run-dir", str(tmp / name), "--resume", "--set", "run.steps=4",
             *layout], tmp)
    return tmp


@pytest.mark.slow
def test_a_pipeline_of_fsdp2_copies_trains_as_one_process_and_each_rank_holds_its_part(runs):
    """pp 2 x FSDP2 2: the losses of one process within 1e-5; the checkpoint sharded (DCP's
    metadata, a file per rank, no whole-model file); each rank's entry in the summary: its
    stage, and a quarter of the model's sublayer parameters (half the stages, half their rows)."""
    saved = train_losses(runs / "saved")
    assert close(saved, train_losses(runs / "reference")[:4], 1e-5), saved
    checkpoint = runs / "saved" / "checkpoints" / "step-0000002"
    assert (checkpoint / ".metadata").is_file() and len(list(checkpoint.glob("*.distcp"))) == 4
    assert not (checkpoint / "model.safetensors").exists()
    summary = json.loads((runs / "saved" / "summary.json").read_text())
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and [r["stages"] for r in ranks] == [[0], [1], [0], [1]]
    whole = summary["parameters"]
    assert all(r["param_count"] < 0.35 * whole for r in ranks), (ranks, whole)
    assert all(r["state_bytes"] >= 16 * r["param_count"] for r in ranks)  # weights, grads, two moments (fp32)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(RESUMED))
def test_a_sharded_checkpoint_resumes_in_every_layout(runs, layout):
    """Saved by pp 2 x FSDP2 2 after 2 steps and resumed in ``layout``: steps 3 and 4 give one
    uninterrupted process's losses within 1e-5 (every layout trains the same micro-batches), and
    the log holds every step once."""
    losses = train_losses(runs / layout)
    assert close(losses, train_losses(runs / "reference"), 1e-5), (layout, losses)
    summary = json.loads((runs / layout / "summary.json").read_text())
    assert summary["world_size"] == RESUMED[layout][0] and summary["steps"] == 4


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_in_a_pipeline_of_fsdp2_copies(runs):
    """One process's checkpoint (safetensors and the numbered optimizer state) of step 2,
    resumed by pp 2 x FSDP2 2, each rank taking its part: steps 3 and 4 give the uninterrupted
    process's losses within 1e-5; the new checkpoint is sharded."""
    assert close(train_losses(runs / "from_one"), train_losses(runs / "reference"), 1e-5)
    assert (runs / "from_one" / "checkpoints" / "step-0000004" / ".metadata").is_file()
    assert (runs / "reference" / "checkpoints" / "step-0000004" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_resumed_run_keeps_its_batch(runs, tmp_path):
    """A resume may change the layout, not the batch it draws: another run.batch_size is
    refused naming it, before any process starts."""
    shutil.copytree(runs / "saved", tmp_path / "run")
    proc = subprocess.run([*launcher(1), "train", "--run-dir", str(tmp_path / "run"), "--resume", "--set",
                           "run.steps=4", "--set", "run.pp_size=1", "--set", "run.batch_size=4"],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert proc.returncode != 0
    assert "run.batch_size: the run's 8, given 4" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_export_writes_a_sharded_run_as_a_hugging_face_folder(runs, tmp_path):
    """``attnres export`` of the pp 2 x FSDP2 2 run: a folder ``from_pretrained`` loads, with the
    checkpoint's weights, giving the run's model's logits; refused without --overwrite once
    the folder holds files."""
    from attnres.commands import load_run
    from attnres.hf import AttnResForCausalLM
    from attnres.hf.export import export_run

    info = export_run(runs / "saved", tmp_path / "hf")
    assert info["step"] == 2
    loaded = AttnResForCausalLM.from_pretrained(tmp_path / "hf")
    model, _ = load_run(runs / "saved")
    tokens = torch.randint(0, 256, (2, 16))
    assert torch.equal(loaded(tokens).logits, model(tokens))
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match=r"exists and is not empty \(a model folder\); pass --overwrite"):
        export_run(runs / "saved", tmp_path / "hf")


@pytest.mark.parametrize("design,extra", [("block", {}), ("delta", {}), ("mhc", {}), ("block", {"tie_embeddings": True}),
                                          ("full", {"moe_experts": 4})])
def test_each_rank_builds_its_part_with_one_process_values(design, extra):
    """Built on the meta device, each rank's part under pp 2, pp 4, interleaved stages and a V
    holds exactly one process's initial values (the generator advanced as one process's), and
    nothing else; without a pipeline, the whole model."""
    from .conftest import DESIGNS

    config = tiny_config(**DESIGNS[design], **{"n_layers": 4, **extra})
    torch.manual_seed(3)
    reference = Transformer(config).state_dict()
    after = torch.get_rng_state()
    layouts = [("1f1b", 2, None), ("1f1b", 4, None), ("interleaved1f1b", 2, 2), ("zbv", 2, None)]
    for schedule, ranks, per_rank in layouts:
        for rank in range(ranks):
            part = plan_parallel(config, ranks, pp_size=ranks, schedule=schedule, stages_per_rank=per_rank).part(rank)
            model = rank_model(config, 3, part)
            assert torch.equal(torch.get_rng_state(), after)
            with torch.device("meta"):
                expected = trim(Transformer(config, initialize=False), part).state_dict()
            state = model.state_dict()
            assert sorted(state) == sorted(expected), (schedule, rank)
            for name, value in state.items():
                assert torch.equal(value, reference[name]), (schedule, rank, name)
            assert not any(p.is_meta for p in model.parameters()) and not model.rope_cos.is_meta
    whole = rank_model(config, 3, plan_parallel(config).part(0)).state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in whole.items()) and len(whole) == len(reference)


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """Two ranks save step 1; during step 2's save rank 1 dies after writing its shard: the job
    fails, no step-2 folder exists, ``latest`` names step 1, and step 1 reads back with the
    weights it was saved with."""
    from attnres.train.checkpoint import latest_checkpoint, load_train_state
    from attnres.train.sharded import read_weights

    from .conftest import tiny_model

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           "-m", "tests.scale_worker", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=ENV, cwd=REPO)
    assert proc.returncode != 0
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-0000001"]
    assert latest_checkpoint(root).name == "step-0000001"
    assert load_train_state(root / "step-0000001")["step"] == 1
    saved = json.loads((tmp_path / "rank0.json").read_text())
    weights = read_weights(root / "step-0000001", tiny_model("block").config)
    assert all(torch.equal(weights[k], torch.tensor(v)) for k, v in saved.items())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_launches_joined_as_two_hosts_train_as_one_launch(runs, tmp_path):
    """pp 2 x FSDP2 2 as two launches of two processes each ("hosts"), joined through a c10d
    rendezvous on a loopback endpoint, against the one launch of four: the same losses. Both
    launches are killed if either fails or the join takes too long."""
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={endpoint}", "--rdzv-conf=join_timeout=60", "-m", "attnres", "train", *COMMON,
           *PP2_FSDP2, "--set", "run.steps=2", "--run-dir", str(tmp_path / "run")]
    hosts = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                              cwd=tmp_path, start_new_session=True) for _ in range(2)]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and any(h.poll() is None for h in hosts):
            if any(h.poll() not in (None, 0) for h in hosts):
                break
            time.sleep(0.2)
        codes = [h.poll() for h in hosts]
    finally:
        for h in hosts:
            if h.poll() is None:
                os.killpg(h.pid, signal.SIGKILL)
            h.wait()
    errors = [h.stderr.read()[-1500:] for h in hosts]
    assert codes == [0, 0], errors
    assert train_losses(tmp_path / "run") == train_losses(runs / "saved")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tied_embeddings_optimizer_state_follows_it_to_the_rank_that_holds_the_head(tmp_path):
    """A tied embedding is ``tok_embeddings.weight`` to one process and ``lm_head.weight`` to a
    pipeline rank that holds the head alone: its AdamW moments reach that rank from a sharded
    checkpoint of the whole model and from one process's checkpoint (numbered), and that rank's
    save names them as one process does."""
    import torch.distributed.checkpoint as dcp

    from attnres.train.config import OptimConfig
    from attnres.train.sharded import load_full, load_sharded, local_state
    from attnres.train.trainer import build_optimizer

    config = tiny_config(residual="block", block_size=3, tie_embeddings=True)
    torch.manual_seed(0)
    whole = Transformer(config)
    optimizer = build_optimizer(OptimConfig(), whole)
    whole(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizer.step()
    moments = optimizer.state[whole.tok_embeddings.weight]
    dcp.save(local_state(whole, optimizer), checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    head = Part.of_stages([(3, 6)], 6)
    for load in ("sharded", "one process"):
        part = rank_model(config, 0, head)
        part_optimizer = build_optimizer(OptimConfig(), part)
        if load == "sharded":
            load_sharded(tmp_path / "ckpt", part, part_optimizer)
        else:
            load_full(part, part_optimizer, whole.state_dict(), optimizer.state_dict(), config, OptimConfig())
        got = part_optimizer.state[part.lm_head.weight]
        assert torch.equal(got["exp_avg"], moments["exp_avg"]) and torch.equal(got["exp_avg_sq"], moments["exp_avg_sq"])
        assert torch.equal(part.lm_head.weight, whole.tok_embeddings.weight)
        saved = local_state(part, part_optimizer)["optimizer"]
        assert "state.tok_embeddings.weight.exp_avg" in saved and not any("lm_head" in k for k in saved)


@pytest.mark.slow
def test_a_tied_embedding_held_whole_by_one_rank_trains_in_a_pipeline_of_fsdp2_copies(runs, tmp_path):
    """pp 2 x FSDP2 2 under ZBV: rank 0 holds both ends, one tied parameter FSDP2 cannot shard
    as two roots, kept whole and averaged over the copies; one process's losses within 1e-5
    (under 1F1B, where each end is sharded, ``runs`` trains the same model)."""
    run([*launcher(4), "train", *COMMON, *PP2_FSDP2, "--set", "run.pp_schedule=zbv", "--set", "run.steps=2",
         "--run-dir", str(tmp_path / "run")], tmp_path)
    assert close(train_losses(tmp_path / "run"), train_losses(runs / "reference")[:4], 1e-5)


class _RunsCode:
    """Unpickled, it would call ``Path.touch`` on its path: what a crafted ``.metadata`` can do
    to a reader that unpickles it with ``pickle.load``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoints_metadata_is_read_as_data(tmp_path):
    """DCP's ``.metadata`` is a pickle: a checkpoint's own loads, one naming anything else is
    refused with ``CheckpointError`` naming it, and what it names is never called."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from attnres.train.checkpoint import CheckpointError
    from attnres.train.sharded import read_weights

    config = tiny_config(residual="block", block_size=3)
    torch.manual_seed(0)
    model = Transformer(config)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    weights = read_weights(tmp_path / "ckpt", config)
    assert all(torch.equal(weights[n], t) for n, t in model.state_dict().items())
    touched = tmp_path / "touched"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_RunsCode(touched)))
    with pytest.raises(CheckpointError, match=r"names pathlib.*Path.touch"):
        read_weights(tmp_path / "ckpt", config)
    assert not touched.exists()
