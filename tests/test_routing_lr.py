"""The routing parameters in a parameter group of their own, their learning rate
``optim.routing_lr_scale`` times the schedule's: for attnres's own designs, a converted folder's
model, a comparison's variants (``block:routing_lr_scale=S``) and the conversions of ``compare
--from`` (``convert:routing_lr_scale=S``); and ``lr`` as a variant's own learning rate."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from attnres.model import param_groups
from attnres.experiments.compare import plan_comparison
from attnres.train.config import apply_overrides, tiny

from .conftest import cli_in_process, tiny_model

QUIET = ["--set", "run.progress=false", "--set", "run.tensorboard=false"]


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("design", ["block", "mhar", "delta", "hc", "gr", "denseformer"])
def test_the_routing_group_holds_each_streams_routing_parameters_and_nothing_else(design):
    model = tiny_model(design)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: g for g in param_groups(model, 0.1, routing_lr_scale=3.0)}
    routed = {names[id(p)] for g in groups.values() if g["name"].startswith("routing") for p in g["params"]}
    stream = {f"stream.{n}" for n, _ in model.stream.named_parameters()}
    norms = {n for n in stream if n.startswith(("stream.norms.", "stream.final_norm."))}
    assert routed == stream - norms and routed
    assert all(g["lr_scale"] == 3.0 for name, g in groups.items() if name.startswith("routing"))
    assert groups["routing"]["weight_decay"] == 0.0
    assert [g["name"] for g in param_groups(model, 0.1)] == ["decay", "no_decay"]  # 1: no group of its own


def test_the_scale_reaches_the_optimizer_and_the_routing_moves_in_proportion(tmp_path):
    """One step of Block from the same initial model and batch at routing_lr_scale 1 and 4: the
    pseudo-queries (zero at the start) move 4 times as far (Adam's first step is the learning
    rate times the gradient's sign, for every entry whose gradient is well above its epsilon),
    every other parameter alike."""
    runs = {}
    for scale in ("1", "4"):
        run = tmp_path / scale
        out = cli_in_process("train", "--preset", "tiny", "--set", "model.residual=block", "--set",
                             "model.num_blocks=2", "--set", "run.steps=1", "--set", "optim.warmup_steps=0",
                             "--set", f"optim.routing_lr_scale={scale}", "--run-dir", run, *QUIET)
        assert out.returncode == 0, out.stderr
        runs[scale] = final_weights(run)
    one, four = runs["1"]["stream.pseudo_queries"], runs["4"]["stream.pseudo_queries"]
    moved = one.abs() > 1e-6
    assert moved.sum() > 10
    torch.testing.assert_close(four[moved], 4 * one[moved], rtol=1e-4, atol=0)
    for name, weight in runs["1"].items():
        if not name.startswith(("stream.pseudo_queries", "stream.key_gains")):
            assert torch.equal(weight, runs["4"][name]), name


def test_a_model_without_routing_is_refused_before_any_work(tmp_path):
    out = cli_in_process("train", "--preset", "tiny", "--set", "model.residual=prenorm", "--set",
                         "optim.routing_lr_scale=10", "--run-dir", tmp_path / "r")
    assert out.returncode == 2 and "model.residual='prenorm' has none" in out.stderr
    assert not (tmp_path / "r").exists()
    bad = cli_in_process("train", "--preset", "tiny", "--set", "optim.routing_lr_scale=0", "--run-dir", tmp_path / "s")
    assert bad.returncode == 2 and "optim.routing_lr_scale" in bad.stderr


def test_variants_carry_their_own_learning_rates():
    """``block:lr=5e-3:routing_lr_scale=10`` runs at its own rate and routing scale; PreNorm at the
    shared ones, and at routing scale 1 when the comparison sets one for every design that routes."""
    base = apply_overrides(tiny(), ["model.n_layers=2"])
    plan = plan_comparison(base, ["prenorm", "block:lr=5e-3:routing_lr_scale=10"], [0], {}, None)
    block = plan.run_config("block:lr=5e-3:routing_lr_scale=10", 0).optim
    prenorm = plan.run_config("prenorm", 0).optim
    assert (block.lr, block.routing_lr_scale) == (5e-3, 10.0) and (prenorm.lr, prenorm.routing_lr_scale) == (
        base.optim.lr, 1.0)
    shared = dataclasses.replace(base, optim=dataclasses.replace(base.optim, routing_lr_scale=3.0))
    plan = plan_comparison(shared, ["prenorm", "block"], [0], {}, None)
    assert plan.run_config("prenorm", 0).optim.routing_lr_scale == 1.0
    assert plan.run_config("block", 0).optim.routing_lr_scale == 3.0
    with pytest.raises(ValueError, match="'routing_lr_scale' is not an option of 'prenorm'"):
        plan_comparison(base, ["prenorm:routing_lr_scale=2", "block"], [0], {}, None)
    with pytest.raises(ValueError, match=r"design 'block:lr=-1': optim.lr=-1.0"):
        plan_comparison(base, ["prenorm", "block:lr=-1"], [0], {}, None)
