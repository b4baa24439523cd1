"""``studies/regime_lr.py``: the regime's learning-rate grid, read from the committed sweeps,
gives the rates docs/RESULTS.md reports; the seed count follows the power rule worked by hand; a
sweep over depth whose designs name their rates reads as one grid per design and depth."""

import json
import math
from pathlib import Path

import pytest

from .conftest import load_study

STUDY = Path(__file__).parents[1] / "docs" / "study" / "regime-lr"


def load():
    return load_study("regime_lr")


def test_a_label_gives_its_rate_and_keeps_its_other_options():
    regime_lr = load()
    assert regime_lr.split_rate("block:norm_eps=1e-6:lr=5e-3") == ("block:norm_eps=1e-6", 0.005)
    assert regime_lr.split_rate("prenorm") == ("prenorm", None)


def test_the_committed_grid_chooses_the_rates_results_reports():
    regime_lr = load()
    grid = regime_lr.read_grid([STUDY / "sweep-20261206-174646", STUDY / "sweep-20261207-004048"])
    best = regime_lr.best_rates(grid, [0, 1])
    assert best == {"prenorm": (8e-3, False), "block:norm_eps=1e-12": (5e-3, False),
                    "mhar:norm_eps=1e-12": (3e-3, False), "full:norm_eps=1e-12": (2e-3, False)}
    # the table's PreNorm row: 1.1556 at 8e-3 (seeds 1.1551, 1.1560), 1.1643 at the extension's 1.3e-2
    assert math.isclose((grid["prenorm"][8e-3][0] + grid["prenorm"][8e-3][1]) / 2, 1.1556, abs_tol=5e-5)
    assert math.isclose(grid["prenorm"][1.3e-2][0], 1.1698, abs_tol=5e-5)


def test_the_seed_count_follows_the_power_rule():
    regime_lr = load()
    # by hand: t(0.975, 11) = 2.2010, t(0.8, 11) = 0.8755; (2.2010 + 0.8755) * 0.0323 / sqrt(12) = 0.02869
    n, resolved = regime_lr.seeds_needed(0.0323, 0.02, 12)
    assert n is None and math.isclose(resolved, 0.02869, abs_tol=5e-5)
    # at n = 11: (2.2281 + 0.8791) * 0.0323 / sqrt(11) = 0.03026 > 0.03, so 12 is the first to resolve 0.03
    assert regime_lr.seeds_needed(0.0323, 0.03, 20)[0] == 12


def test_a_depth_sweep_reads_as_one_grid_per_design_and_depth():
    regime_lr = load()
    grid = regime_lr.read_grid([STUDY / "depth-sweep-20261207-035227"])
    assert set(grid["block (model.n_layers=4)"]) == {5e-3, 8e-3, 1.3e-2}
    # at 4 layers the regime's 8 blocks hold one sublayer each, so Block is Full, to the last bit
    for rate in (5e-3, 8e-3):
        assert grid["block (model.n_layers=4)"][rate] == grid["full (model.n_layers=4)"][rate]
    # docs/RESULTS.md's depth table: each best, and whether it lies at an end of its three rates
    assert regime_lr.best_rates(grid, [0]) == {
        "prenorm (model.n_layers=4)": (3e-3, False), "block (model.n_layers=4)": (8e-3, False),
        "mhar (model.n_layers=4)": (3e-3, False), "full (model.n_layers=4)": (8e-3, True),
        "prenorm (model.n_layers=32)": (3e-3, False), "block (model.n_layers=32)": (5e-3, True),
        "mhar (model.n_layers=32)": (3e-3, False), "full (model.n_layers=32)": (3e-3, True)}


def test_a_depth_sweep_whose_design_names_no_rate_is_refused(tmp_path):
    regime_lr = load()
    (tmp_path / "point-0").mkdir()
    (tmp_path / "sweep.json").write_text(json.dumps(
        {"over": {"model.n_layers": ["4"]}, "points": [{"values": {"model.n_layers": "4"}, "dir": "point-0"}]}))
    (tmp_path / "point-0" / "results.json").write_text(json.dumps({"designs": {"block": {"val_loss": {"0": 1.7}}}}))
    with pytest.raises(SystemExit, match="'block' names no rate"):
        regime_lr.read_grid([tmp_path])
