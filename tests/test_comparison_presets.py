"""The presets `attnres compare` names: each one's size, designs and seeds (docs/RESULTS.md)."""

import pytest


def test_the_study_preset_names_its_designs_and_seeds():
    from attnres.names import DEFAULT_DESIGNS
    from attnres.experiments.designs import comparison_choice
    from attnres.train.config import preset
    from attnres.train.validate import check_run

    assert comparison_choice("study") == (["prenorm", "block", "mhar", "full"], [0, 1, 2, 3, 4, 5])
    assert comparison_choice("study", ["block", "full"], [4]) == (["block", "full"], [4])  # given ones win
    assert comparison_choice("demo") == (list(DEFAULT_DESIGNS), [0])
    check_run(preset("study"))  # `attnres train --preset study` trains one run of that size


def test_the_ablations_preset_is_the_studys_size_with_every_row_as_a_valid_design():
    from attnres.experiments.compare import plan_comparison
    from attnres.experiments.designs import comparison_choice
    from attnres.train.config import ABLATIONS, preset, to_dict

    designs, seeds = comparison_choice("ablations")
    assert (designs, seeds) == (list(ABLATIONS), [0, 1, 2]) and len(designs) == 14
    assert to_dict(preset("ablations")) == to_dict(preset("study"))
    plan = plan_comparison(preset("ablations"), designs, seeds, {}, None)  # every label parses and builds
    config = plan.configs
    assert (config["block"].num_blocks, config["block:block_size=4"].block_size) == (8, 4)
    assert (config["full:window=8"].window, config["full:mixing=learned"].mixing) == (8, "learned")
    assert config["block:heads=16"].heads == 16 and config["denseformer"].residual == "denseformer"


def test_the_regime_preset_trains_twenty_tokens_per_parameter_without_repeating_its_data():
    """The papers' regime (docs/RESULTS.md): at least 20 tokens per parameter, and the compute
    ladder's largest budget (3) samples its prefix of the corpus at most once on average."""
    from attnres.model import Transformer
    from attnres.train.config import preset
    from attnres.train.validate import check_run

    cfg = preset("regime")
    params = sum(p.numel() for p in Transformer(cfg.model).parameters())
    tokens = cfg.run.steps * cfg.run.batch_size * cfg.run.seq_len
    assert params == 246_576 and 20 <= tokens / params < 21
    assert 3 * tokens <= cfg.data.max_train_tokens / 3
    study = preset("study")
    assert cfg.optim.warmup_steps / cfg.run.steps == pytest.approx(study.optim.warmup_steps / study.run.steps, abs=5e-4)
    check_run(cfg)


def test_the_regime_preset_runs_each_design_at_its_own_learning_rate():
    """`compare --preset regime` trains PreNorm, Block, MHAR and Full, each at the rate its
    label names (which ends in the run's optimizer, not the shared 3e-3), at its kind's own
    default epsilon, on seeds 4-15, which chose nothing."""
    from attnres.experiments.compare import plan_comparison
    from attnres.experiments.designs import comparison_choice, parse_design
    from attnres.model_config import default_norm_eps
    from attnres.train.config import apply_override, preset

    designs, seeds = comparison_choice("regime")
    assert seeds == list(range(4, 16))
    base = apply_override(preset("regime"), "optim.lr=1e-4")  # a shared rate no label takes
    plan = plan_comparison(base, designs, seeds, {}, None)
    assert [plan.configs[label].residual for label in designs] == ["prenorm", "block", "block", "full"]
    assert plan.configs[designs[2]].heads > 1  # MHAR: a Block with routing heads
    assert plan.baseline == designs[0]
    rates = {label: plan.run_config(label, 4).optim.lr for label in designs}
    assert rates == {label: float(parse_design(label)[1]["lr"]) for label in designs}
    assert len(set(rates.values())) == 4
    for label in designs:
        config = plan.configs[label]
        assert config.norm_eps == default_norm_eps(config.residual, config.norm_eps_scale)


@pytest.mark.parametrize("args, given", [
    (["compare", "--preset", "regime", "--set", "optim.lr=1e-3"], "--set optim.lr=1e-3"),
    (["compare", "--preset", "tiny", "--designs", "block:routing_lr_scale=2", "full:routing_lr_scale=4",
      "--set", "optim.routing_lr_scale=3"], "--set optim.routing_lr_scale=3"),
    (["sweep", "--preset", "regime", "--over", "optim.lr=1e-3,2e-3"], "--over optim.lr=1e-3,2e-3"),
])
def test_a_shared_rate_every_design_replaces_is_refused(tmp_path, args, given):
    """The regime's designs carry their own rates: a shared `optim.lr` (or a sweep over it) would
    train every design at its label's rate all the same, so it is refused before any work."""
    from .conftest import cli_in_process

    short = ["--seeds", "4", "--set", "run.steps=1", "--set", "run.eval_batches=1"]  # were it not refused
    proc = cli_in_process(*args, *short, "--out", tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{given} applies to none of the designs" in proc.stderr and "each sets its own" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # refused before any folder is made


def test_a_shared_rate_reaches_the_designs_without_their_own(tmp_path):
    """`--set optim.lr` given beside a label with its own rate is not refused: the designs
    without one take it, the label's own wins."""
    from attnres.commands import comparison_settings
    from attnres.cli import build_parser
    from attnres.experiments.compare import plan_comparison

    args = build_parser().parse_args(["compare", "--preset", "regime", "--designs", "prenorm", "block:lr=5e-3",
                                      "--set", "optim.lr=1e-3", "--seeds", "4"])
    cfg, designs, seeds, overrides = comparison_settings(args)
    plan = plan_comparison(cfg, designs, seeds, overrides, None)
    assert [plan.run_config(label, 4).optim.lr for label in designs] == [1e-3, 5e-3]


@pytest.mark.parametrize("designs, given, folder, refused", [
    (["prenorm", "block:routing_lr_scale=2"], "optim.routing_lr_scale", False, True),  # prenorm has no routing
    (["prenorm", "block"], "optim.routing_lr_scale", False, False),  # block's routing takes it
    (["prenorm:lr=8e-3", "block:lr=5e-3"], "optim.warmup_steps", False, False),  # not a design's own field
    (["source", "convert"], "optim.lr", True, False),  # compare --from's documented --set optim.lr
    (["source:lr=1e-3", "convert:lr=2e-3"], "optim.lr", True, True),
    (["source", "convert:routing_lr_scale=10"], "optim.routing_lr_scale", True, True),  # the control has none
    (["source", "convert:heads=1"], "optim.routing_lr_scale", True, False),
])
def test_a_shared_optimizer_field_is_refused_only_where_it_reaches_no_design(designs, given, folder, refused):
    from attnres.experiments.designs import check_shared_optim

    how = f"--set {given}=3"
    if refused:
        with pytest.raises(ValueError, match=f"{how} applies to none of the designs"):
            check_shared_optim(designs, {given: how}, folder=folder)
    else:
        check_shared_optim(designs, {given: how}, folder=folder)
