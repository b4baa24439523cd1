"""``attnres train --preset regime``: a model that is one of the regime's designs trains at the
rate its label in ``names.REGIME_DESIGNS`` gives it, as ``compare --preset regime`` trains it
(``experiments/train_rate.py``)."""

import dataclasses
import json

import pytest

from .conftest import cli_in_process


@pytest.mark.parametrize("given,label", [
    ([], "prenorm:lr=8e-3"),
    (["model.residual=block"], "block:lr=5e-3"),
    (["model.residual=block", "model.block_size=2"], "block:lr=5e-3"),  # 8 blocks, given another way
    (["model.residual=block", "model.block_sizes=2,2,2,2,2,2,2,2"], "block:lr=5e-3"),
    (["model.residual=block", "model.heads=2"], "mhar:lr=3e-3"),
    (["model.residual=block", "model.n_heads=4"], "block:lr=5e-3"),  # one routing head: not MHAR's 4
    (["model.residual=block", "model.n_heads=4", "model.heads=4"], "mhar:lr=3e-3"),  # MHAR: heads = KV heads
    (["model.residual=block", "model.n_heads=4", "model.heads=2"], None),
    (["model.residual=full", "model.backend=reference"], "full:lr=2e-3"),  # the kernels do not make a design
    (["model.residual=full", "model.norm_eps=1e-6"], "full:lr=2e-3"),  # nor does the epsilon
    (["model.residual=full", "model.query=input"], None),
    (["model.residual=block", "model.num_blocks=4"], None),  # another Block: not the one tuned
    (["model.residual=mhc"], None),
])
def test_a_model_that_is_one_of_the_regimes_designs_takes_its_rate(given, label):
    """A model that is one of the designs the preset tunes trains at its rate and says so;
    any other at the preset's 3e-3, naming the tuned designs; `--set optim.lr` wins; a preset
    without tuned designs changes nothing."""
    from attnres.experiments.designs import parse_design
    from attnres.experiments.train_rate import preset_train_rate
    from attnres.names import REGIME_DESIGNS
    from attnres.train.config import apply_overrides, preset

    cfg = apply_overrides(preset("regime"), given)
    trained, note = preset_train_rate("regime", cfg, given)
    if label is None:
        assert trained == cfg and trained.optim.lr == 3e-3 and " ".join(REGIME_DESIGNS) in note
    else:
        assert label in REGIME_DESIGNS and trained.optim.lr == float(parse_design(label)[1]["lr"])
        assert f"the rate {label} has in attnres compare --preset regime;" in note
        assert trained == dataclasses.replace(cfg, optim=trained.optim)  # nothing else changed
    mine = apply_overrides(preset("regime"), [*given, "optim.lr=1e-3"])
    assert preset_train_rate("regime", mine, [*given, "optim.lr=1e-3"]) == (mine, None)
    assert preset_train_rate("study", cfg, given) == (cfg, None)  # a preset without per-design rates


def test_the_line_names_the_sizes_the_rate_was_not_chosen_at():
    from attnres.experiments.train_rate import preset_train_rate
    from attnres.train.config import apply_overrides, preset

    given = ["model.residual=block", "model.n_layers=32", "run.steps=484"]
    _, note = preset_train_rate("regime", apply_overrides(preset("regime"), given), given)
    assert note.endswith("chosen at the preset's own size and steps, not at this run's model.n_layers, run.steps; "
                         "--set optim.lr=X for another")


def test_a_model_that_is_two_designs_at_different_rates_is_refused_before_any_work(tmp_path):
    """One KV head makes MHAR (heads = KV heads) and Block the same model, which the preset
    trains at 3e-3 and 5e-3: no rate is chosen for the user."""
    out = cli_in_process("train", "--preset", "regime", "--set", "model.residual=block", "--set", "model.n_kv_heads=1",
                         "--run-dir", tmp_path / "run")
    assert out.returncode == 2, out.stderr
    assert "block:lr=5e-3 and mhar:lr=3e-3 at once" in out.stderr and "give --set optim.lr=X" in out.stderr
    assert not (tmp_path / "run").exists()


def test_train_records_the_designs_rate_and_says_so(tmp_path):
    out = cli_in_process("train", "--preset", "regime", "--set", "model.residual=full", "--set", "run.steps=1",
                         "--set", "run.eval_every=1", "--set", "run.eval_batches=1", "--set", "run.progress=false",
                         "--set", "run.tensorboard=false", "--run-dir", tmp_path / "run")
    assert out.returncode == 0, out.stderr
    assert ("optim.lr=2e-3: the rate full:lr=2e-3 has in attnres compare --preset regime; chosen at the preset's "
            "own size and steps, not at this run's run.steps") in out.stderr
    assert json.loads((tmp_path / "run" / "config.json").read_text())["optim"]["lr"] == 0.002
