"""The input-dependent queries' projections in a parameter group of their own, their learning
rate ``optim.query_lr_scale`` times the schedule's, matched by name when a checkpoint loads."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from attnres.model import match_param_groups, param_groups

from .conftest import cli_in_process, tiny_model

INPUT_QUERY = ["--preset", "tiny", "--set", "model.residual=full", "--set", "model.query=input", "--set",
               "run.steps=4", "--set", "run.ckpt_every=2", "--set", "run.progress=false", "--set",
               "run.tensorboard=false"]


def projection(run_dir, step: int) -> torch.Tensor:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:07d}" / "model.safetensors"))["stream.query_proj"]


def test_a_tiny_scale_barely_moves_the_projection_and_a_resume_continues_bit_for_bit(tmp_path):
    moved = {}
    for scale in ("1", "1e-6"):
        run = tmp_path / scale
        out = cli_in_process("train", *INPUT_QUERY, "--set", f"optim.query_lr_scale={scale}", "--run-dir", str(run))
        assert out.returncode == 0, out.stderr
        moved[scale] = float(projection(run, 4).abs().max())  # the projection starts at zero
    assert moved["1"] > 0 and moved["1e-6"] < 1e-3 * moved["1"], moved
    # resumed from step 2, the run ends as the one that never stopped
    run = tmp_path / "1e-6"
    whole = projection(run, 4)
    shutil.rmtree(run / "checkpoints" / "step-0000004")
    (run / "checkpoints" / "latest").write_text("step-0000002")
    out = cli_in_process("train", "--run-dir", str(run), "--resume")
    assert out.returncode == 0, out.stderr
    assert torch.equal(projection(run, 4), whole)


def test_the_groups_are_named_and_the_projection_has_its_own_when_scaled():
    model = tiny_model("full-input-query")
    plain = param_groups(model, 0.1)
    assert [g["name"] for g in plain] == ["decay", "no_decay"]
    assert any(p is model.stream.query_proj for p in plain[0]["params"])  # a matrix: decays
    scaled = param_groups(model, 0.1, query_lr_scale=0.1)
    assert [g["name"] for g in scaled] == ["decay", "no_decay", "query_projection"]
    assert scaled[2]["params"] == [model.stream.query_proj] and scaled[2]["lr_scale"] == 0.1
    assert all(p is not model.stream.query_proj for g in scaled[:2] for p in g["params"])


def test_saved_groups_are_matched_by_name_and_unnamed_ones_by_their_old_order():
    current = [{"name": "decay"}, {"name": "no_decay"}, {"name": "query_projection"}]
    saved = [{"name": "query_projection", "params": [2]}, {"name": "decay", "params": [0]},
             {"name": "no_decay", "params": [1]}]
    assert [g["params"] for g in match_param_groups(saved, current)] == [[0], [1], [2]]
    unnamed = [{"params": [0]}, {"params": [1]}]
    assert [g["name"] for g in match_param_groups(unnamed, current[:2])] == ["decay", "no_decay"]
    with pytest.raises(ValueError, match=r"holds the parameter groups \['decay', 'no_decay'\], the model's "
                                         r"optimizer \['decay', 'no_decay', 'query_projection'\]"):
        match_param_groups(unnamed, current)


def test_a_query_lr_scale_without_input_queries_is_refused():
    out = cli_in_process("train", "--preset", "tiny", "--set", "optim.query_lr_scale=0.1")
    assert out.returncode == 2 and "optim.query_lr_scale=0.1 scales the learning rate" in out.stderr
    assert "model.query='static'" in out.stderr


def test_a_resume_with_another_scale_trains_at_the_new_one(tmp_path):
    """The checkpoint's groups load with the checkpoint's settings; the run's own scale wins."""
    import dataclasses

    from attnres import Transformer
    from attnres.train.checkpoint import latest_checkpoint, load_checkpoint
    from attnres.train.resume import ResumePoint, restore
    from attnres.train.run_files import load_run_config
    from attnres.train.trainer import build_optimizer

    run = tmp_path / "run"
    out = cli_in_process("train", *INPUT_QUERY, "--set", "optim.query_lr_scale=2.0", "--run-dir", str(run))
    assert out.returncode == 0, out.stderr
    cfg = load_run_config(run)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, query_lr_scale=4.0))
    path = latest_checkpoint(run / "checkpoints")
    weights, state = load_checkpoint(path, cfg.model)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(cfg.optim, model)
    assert state["optimizer"]["param_groups"][2]["lr_scale"] == 2.0
    restore(ResumePoint(path, weights, state), model, optimizer, cfg, False)
    assert {g["name"]: g.get("lr_scale") for g in optimizer.param_groups} == {
        "decay": None, "no_decay": None, "query_projection": 4.0}
