"""`attnres compare` end to end on the tiny preset: the report's numbers are the saved ones."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import cli_in_process


# under pytest-xdist (make test) the module runs in one worker, which trains the comparison once
pytestmark = pytest.mark.xdist_group("comparison")


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    proc = subprocess.run(
        [sys.executable, "-m", "attnres", "compare", "--preset", "tiny", "--out", str(out),
         "--designs", "prenorm", "block", "mhar", "hc", "--set", "run.steps=6", "--set", "run.progress=false"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = Path(proc.stdout.strip().splitlines()[-1])  # the path is the last line
    assert report.name == "report.md" and report.exists()
    return report


def table_rows(text, columns=6):
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == columns and cells[0] not in ("design", "---"):
            rows[cells[0]] = cells
    return rows


def test_report_table_matches_saved_metrics(comparison):
    rows = table_rows(comparison.read_text())
    assert list(rows) == ["prenorm", "block", "mhar", "hc"]
    base = json.loads((comparison.parent / "prenorm" / "summary.json").read_text())["final_val_loss"]
    for design, cells in rows.items():
        run = comparison.parent / design
        summary = json.loads((run / "summary.json").read_text())
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        last_val = [m["val_loss"] for m in metrics if m["split"] == "val"][-1]
        assert summary["final_val_loss"] == last_val
        assert float(cells[1]) == pytest.approx(last_val, abs=5e-5)
        assert float(cells[2]) == pytest.approx(last_val / 0.6931471805599453, abs=5e-5)
        assert cells[3] == "baseline" if design == "prenorm" else float(cells[3]) == pytest.approx(last_val - base, abs=1e-4)
        assert int(cells[4].replace(",", "")) == summary["parameters"]
    results = json.loads((comparison.parent / "results.json").read_text())
    assert results["baseline"] == "prenorm" and list(results["designs"]) == ["prenorm", "block", "mhar", "hc"]
    for design, entry in results["designs"].items():
        loss = json.loads((comparison.parent / design / "summary.json").read_text())["final_val_loss"]
        assert entry["val_loss"] == {"0": loss}
        if design != "prenorm":  # one seed: a difference, no interval
            assert (entry["diff_mean"], entry["ci95"], entry["verdict"]) == (loss - base, None, "unresolved")


def test_report_figures_exist_and_are_pngs(comparison):
    text = comparison.read_text()
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert {"loss_curves.png", "hidden_rms.png", "grad_norms.png", "depth_weights_block.png",
            "depth_weights_mhar.png"} <= set(figures)
    for name in figures:
        assert (comparison.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "same 768 training tokens" in text  # 6 steps of 4 x 32
    assert "One seed: this comparison cannot tell a difference between designs from seed noise" in text
    command = re.search(r"^    (attnres compare .*)$", text, flags=re.M).group(1)
    assert command.endswith("--designs prenorm block mhar hc --set run.steps=6 --set run.progress=false --seeds 0 1 2")
    assert "Step times are not reported" in text


def test_analysis_has_depth_weights_per_site_and_head(comparison):
    a = json.loads((comparison.parent / "mhar" / "analysis.json").read_text())
    M = a["num_sublayers"]
    assert sorted(map(int, a["depth_weights"])) == list(range(M + 1))
    for site, w in a["depth_weights"].items():
        assert len(w[0]) == 2  # heads = n_kv_heads = 2
        assert sum(row[0] for row in w) == pytest.approx(1.0, abs=1e-5)
    assert len(a["read_rms"]) == M + 1
    assert a["width_probe"] is None  # multi-head: no single-head probe
    block = json.loads((comparison.parent / "block" / "analysis.json").read_text())
    assert set(block["width_probe"]) == {"trained", "random", "probe", "slices"}


def test_report_rebuilds_from_artifacts(comparison):
    before = comparison.read_text()
    comparison.unlink()
    proc = cli_in_process("report", comparison.parent)
    assert proc.returncode == 0, proc.stderr
    assert comparison.read_text() == before


def test_generate_from_a_run(comparison):
    proc = cli_in_process("generate", comparison.parent / "block", "--prompt", "import ", "--max-new-tokens", "12",
                          "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("import ") and len(proc.stdout.encode()) >= len("import ") + 1


def test_generate_with_its_defaults_fits_the_context(comparison):
    """The tiny preset's context is 64 tokens: the default request fills it instead of failing."""
    proc = cli_in_process("generate", comparison.parent / "block")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def ")
    too_long = cli_in_process("generate", comparison.parent / "block", "--max-new-tokens", "61")
    assert too_long.returncode == 2
    assert "prompt length 4 + max_new_tokens 61 exceeds max_seq_len=64" in too_long.stderr


def run_compare(tmp_path, *args):
    return cli_in_process("compare", "--preset", "tiny", "--out", tmp_path, "--set", "run.steps=2",
                          "--set", "run.eval_every=2", "--set", "run.progress=false", *args)


def test_residual_options_given_to_compare_apply_to_the_designs_that_take_them(tmp_path):
    proc = run_compare(tmp_path, "--designs", "prenorm", "block", "--set", "model.num_blocks=2",
                       "--set", "model.two_phase=false")
    assert proc.returncode == 0, proc.stderr
    report = Path(proc.stdout.strip().splitlines()[-1])
    block = json.loads((report.parent / "block" / "config.json").read_text())["model"]
    prenorm = json.loads((report.parent / "prenorm" / "config.json").read_text())["model"]
    assert (block["residual"], block["num_blocks"], block["two_phase"]) == ("block", 2, False)
    assert (prenorm["residual"], prenorm["num_blocks"], prenorm["two_phase"]) == ("prenorm", None, True)
    assert "| block | block | num_blocks=2, two_phase=False |" in report.read_text()


def test_uneven_block_sizes_apply_to_every_block_design(tmp_path):
    proc = run_compare(tmp_path, "--designs", "prenorm", "block", "mhar", "--set", "model.block_sizes=1,3")
    assert proc.returncode == 0, proc.stderr
    report = Path(proc.stdout.strip().splitlines()[-1])
    for design in ("block", "mhar"):
        model = json.loads((report.parent / design / "config.json").read_text())["model"]
        assert (model["block_sizes"], model["num_blocks"], model["block_size"]) == ([1, 3], None, None)
    assert "| block | block | block_sizes=1,3 |" in report.read_text()
    heat = json.loads((report.parent / "block" / "analysis.json").read_text())["depth_weights"]
    assert [len(heat[str(site)]) for site in range(5)] == [1, 2, 3, 3, 3]  # e; e, B0; e, B0, P; ...; e, B0, B1


def test_a_moe_comparison_reports_the_expert_load(tmp_path, capsys):
    """The command of the MoE issue on the tiny budget: every design is the same MoE model; the
    report shows the load per layer and expert, from the analysis of the validation batch."""
    from attnres.cli import main

    assert main(["compare", "--preset", "tiny", "--out", str(tmp_path), "--set", "run.steps=2",
                 "--set", "run.eval_every=2", "--set", "run.progress=false", "--designs", "prenorm", "block",
                 "--set", "model.moe_experts=4", "--set", "model.moe_top_k=2"]) in (0, None)
    report = Path(capsys.readouterr().out.strip().splitlines()[-1])
    text = report.read_text()
    assert "every MLP a mixture of 4 experts of width 96, top-2, balance loss x 0.01" in text
    assert "## Expert load" in text and (report.parent / "expert_load.png").read_bytes()[:4] == b"\x89PNG"
    for design in ("prenorm", "block"):
        load = json.loads((report.parent / design / "analysis.json").read_text())["expert_load"]
        assert len(load) == 2 and all(len(row) == 4 and abs(sum(row) - 1) < 1e-6 for row in load)
        imbalance = sum(max(row) * 4 for row in load) / 2
        assert re.search(rf"^\| {design} \| {imbalance:.3f} \|", text, flags=re.M)
        rows = [json.loads(line) for line in (report.parent / design / "metrics.jsonl").read_text().splitlines()]
        assert all("expert_load" in r for r in rows if r["split"] == "train")


@pytest.mark.parametrize("args,message", [
    (["--designs", "prenorm", "mhc", "--set", "model.num_blocks=2"],
     r"model.num_blocks=2 applies to none of the designs \['prenorm', 'mhc'\]; it is an option of \['block', 'delta'\]"),
    (["--designs", "prenorm", "block", "--set", "model.residual=block"],
     r"the designs choose the residual kind, and \['prenorm'\] are not 'block'"),
    (["--designs", "block", "--set", "model.block_size=99"], r"block_size=99 must be an integer in \[1, 4\]"),
    (["--designs", "block", "--set", "model.block_size=2", "--set", "model.num_blocks=2"],
     r"give block_size=2 or num_blocks=2, not both"),
    (["--designs", "prenorm", "block", "--baseline", "gr"], r"baseline 'gr' is not among the designs \['prenorm', 'block'\]"),
    (["--designs", "block", "--seeds", "0", "0"], r"seeds \[0, 0\] must be given, each once"),
    (["--designs", "block", "--seeds", "-1"], r"seeds \[-1\] must be integers >= 0"),
])
def test_compare_refuses_options_that_apply_to_no_design(tmp_path, args, message):
    proc = run_compare(tmp_path, *args)
    assert proc.returncode == 2 and re.search(message, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []  # refused before any work


def test_variants_of_one_design_stand_side_by_side_with_their_paired_interval(tmp_path):
    """`attnres compare --preset tiny --designs full full:norm_eps=1e-6 --seeds 0 1 2` on a short budget: two
    labels of one design, each with its own folder, options and row, and the paired interval between them in
    results.json."""
    proc = run_compare(tmp_path, "--designs", "full", "full:norm_eps=1e-6", "--seeds", "0", "1", "2",
                       "--set", "run.steps=1", "--set", "run.eval_every=1")
    assert proc.returncode == 0, proc.stderr
    report = Path(proc.stdout.strip().splitlines()[-1])
    root = report.parent
    results = json.loads((root / "results.json").read_text())
    assert results["baseline"] == "full" and set(results["designs"]) == {"full", "full:norm_eps=1e-6"}
    variant = results["designs"]["full:norm_eps=1e-6"]
    diffs = [variant["val_loss"][s] - results["designs"]["full"]["val_loss"][s] for s in "012"]
    assert variant["diff_mean"] == pytest.approx(sum(diffs) / 3, abs=1e-12) and len(variant["ci95"]) == 2
    for seed in range(3):
        model = json.loads((root / f"full+norm_eps=1e-6-seed{seed}" / "config.json").read_text())["model"]
        assert (model["residual"], model["norm_eps"]) == ("full", 1e-6)
        # the design without one runs at its kind's default, Full's 1e-12
        assert json.loads((root / f"full-seed{seed}" / "config.json").read_text())["model"]["norm_eps"] == 1e-12
    text = report.read_text()
    assert "| full:norm_eps=1e-6 | full | norm_eps=1e-06 |" in text
    assert (root / "depth_weights_full+norm_eps=1e-6.png").read_bytes()[:4] == b"\x89PNG"
    record = json.loads((root / "compare.json").read_text())
    assert {(e["design"], e["dir"]) for e in record["runs"] if e["seed"] == 0} == {
        ("full", "full-seed0"), ("full:norm_eps=1e-6", "full+norm_eps=1e-6-seed0")}
    assert record["kind_norm_eps"]["full"] == 1e-12 and record["kind_norm_eps"]["prenorm"] == 1e-6


def test_a_variants_own_options_win_over_set_and_apply_to_its_design_alone(tmp_path):
    from attnres.experiments.designs import design_config, design_options, parse_design
    from attnres.train.config import preset

    base = preset("demo").model
    assert parse_design("block:block_sizes=4,4,6,2") == ("block", {"block_sizes": (4, 4, 6, 2)})
    assert parse_design("full:score=sigmoid:key_norm=false") == ("full", {"score": "sigmoid", "key_norm": False})
    set_ = {"num_blocks": 2, "heads": 2}
    assert design_options(base, "block:block_size=4", set_) == dict(residual="block", block_size=4, heads=2)
    assert design_options(base, "mhar:heads=1", set_) == dict(residual="block", num_blocks=2, heads=1)
    assert design_options(base, "block", set_) == dict(residual="block", num_blocks=2, heads=2)
    config = design_config(base, "block:block_sizes=4,4,6,2")
    assert (config.block_sizes, config.num_blocks, config.norm_eps) == ((4, 4, 6, 2), None, 1e-12)


@pytest.mark.parametrize("design,message", [
    ("fulll", r"design 'fulll': unknown design 'fulll'; expected one of \['block', .*\], optionally with options"),
    ("full:norm_eps", r"design 'full:norm_eps': 'norm_eps' is not field=value"),
    ("full:", r"design 'full:': '' is not field=value"),
    ("full:norm_eps=x", r"design 'full:norm_eps=x': norm_eps='x': expected a value of type float"),
    ("prenorm:heads=2", r"design 'prenorm:heads=2': 'heads' is not an option of 'prenorm' \(a prenorm design\); "
                        r"it takes \['norm_eps', 'norm_eps_scale', 'lr'\]"),
    ("full:dim=64", r"'dim' is not an option of 'full'"),
    ("full:heads=2:heads=4", r"design 'full:heads=2:heads=4': 'heads' is given twice"),
    ("block:block_sizes=4,x", r"block_sizes='4,x': expected a comma list of int"),
    ("full:score=cosine", r"design 'full:score=cosine': score='cosine' is not one of \('softmax', 'sigmoid'\)"),
    ("block:block_sizes=1,1", r"design 'block:block_sizes=1,1': block_sizes=\(1, 1\) must be positive integers "
                              r"summing to 4"),
    ("full/x", r"design 'full/x': the characters \['/'\] are not accepted"),
])
def test_malformed_variants_are_refused_naming_them(tmp_path, design, message):
    proc = run_compare(tmp_path, "--designs", "prenorm", design)
    assert proc.returncode == 2 and re.search(message, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []  # refused before any work


@pytest.mark.parametrize("pair", [
    ("full:key_norm=false", "full:key_norm=False"),
    ("full:norm_eps=1e-12", "full:norm_eps=1E-12"),
    ("full:heads=2:score=sigmoid", "full:score=sigmoid:heads=2"),
])
def test_one_variant_written_twice_is_refused(pair):
    from attnres.experiments.designs import check_labels

    check_labels([pair[0], "full"])
    with pytest.raises(ValueError, match=re.escape(f"designs {pair[0]!r} and {pair[1]!r} are the same variant")):
        check_labels(["prenorm", *pair])


@pytest.mark.parametrize("args,message", [
    (["--temperature", "nan"], r"temperature=nan must be a finite number >= 0"),
    (["--temperature", "-1"], r"temperature=-1.0 must be a finite number >= 0"),
    (["--prompt="], r"--prompt is empty: give at least one character to continue"),
    (["--top-k", "0"], r"top_k=0 must be in \[1, 256\]"),
    (["--max-new-tokens", "-1"], r"max_new_tokens=-1 must be >= 0"),
])
def test_generate_refuses_bad_arguments_in_one_line(comparison, capsys, args, message):
    from attnres.cli import main

    assert main(["generate", str(comparison.parent / "block"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"attnres generate: error: {message}", err), err


def test_a_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    from attnres.cli import main

    (tmp_path / "file").write_text("not a folder")
    assert main(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "file" / "run")]) == 1
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"attnres train: error: \[Errno 20\] Not a directory: .*", err), err


# known final losses for seeds 0-2, and the 95% intervals of their paired differences to prenorm,
# written out: mean(d) -+ t * sd(d) / sqrt(3), t = 4.302652729911275 (Student's t, 0.975, 2 dof)
KNOWN = {
    "prenorm": [3.00, 3.10, 2.90],
    "block": [2.95, 3.04, 2.87],  # d = -0.05, -0.06, -0.03
    "mhar": [3.02, 3.125, 2.93],  # d = +0.02, +0.025, +0.03
    "hc": [3.02, 3.07, 2.91],     # d = +0.02, -0.03, +0.01
}


def written_out_interval(design):
    import statistics

    d = [a - b for a, b in zip(KNOWN[design], KNOWN["prenorm"])]
    half = 4.302652729911275 * statistics.stdev(d) / 3 ** 0.5
    return statistics.fmean(d), [statistics.fmean(d) - half, statistics.fmean(d) + half]


def test_paired_intervals_and_verdicts_match_a_written_out_computation(comparison, tmp_path):
    """A three-seed comparison folder made from the saved runs with known final losses."""
    import shutil

    runs = []
    for design, losses in KNOWN.items():
        for seed, loss in enumerate(losses):
            name = f"{design}-seed{seed}"
            shutil.copytree(comparison.parent / design, tmp_path / name)
            summary = json.loads((tmp_path / name / "summary.json").read_text())
            (tmp_path / name / "summary.json").write_text(json.dumps({**summary, "final_val_loss": loss}))
            runs.append({"design": design, "seed": seed, "dir": name})
    (tmp_path / "compare.json").write_text(json.dumps({"designs": list(KNOWN), "seeds": [0, 1, 2], "runs": runs}))
    from attnres.analysis.report import write_report

    text = write_report(tmp_path).read_text()
    results = json.loads((tmp_path / "results.json").read_text())
    summary = json.loads((tmp_path / "prenorm-seed0" / "summary.json").read_text())
    assert results["baseline"] == "prenorm" and results["designs"]["prenorm"] == {
        "val_loss": {"0": 3.0, "1": 3.1, "2": 2.9}, "val_loss_mean": pytest.approx(3.0), "val_loss_sd": pytest.approx(0.1),
        "tokens_per_parameter": summary["tokens"] / summary["parameters"]}
    assert results["data_sha256"] == summary["data_sha256"]
    rows = table_rows(text, columns=8)
    for design, verdict, words in [("block", "better", "better"), ("mhar", "worse", "worse"),
                                   ("hc", "unresolved", "not resolved")]:
        entry = results["designs"][design]
        mean, interval = written_out_interval(design)
        assert entry["val_loss"] == {str(s): v for s, v in enumerate(KNOWN[design])}
        assert entry["diff_mean"] == pytest.approx(mean, abs=1e-12)
        assert entry["ci95"] == pytest.approx(interval, abs=1e-9)
        assert entry["verdict"] == verdict
        assert rows[design][3] == f"{mean:+.4f}" and rows[design][5] == words
        assert rows[design][4] == f"[{interval[0]:+.4f}, {interval[1]:+.4f}]"
    per_seed = table_rows(text, columns=4)
    assert per_seed["block"] == ["block", "2.9500", "3.0400", "2.8700"]
    # another baseline, chosen when the report is rebuilt
    write_report(tmp_path, baseline="block")
    again = json.loads((tmp_path / "results.json").read_text())
    assert again["baseline"] == "block" and again["designs"]["prenorm"]["verdict"] == "worse"
    with pytest.raises(ValueError, match=r"baseline 'gr' is not among the designs \['prenorm', 'block', 'mhar', 'hc'\]"):
        write_report(tmp_path, baseline="gr")


def test_the_study_summary_pairs_the_labels_of_one_variant(comparison, tmp_path):
    """``studies/study_summary.py --variant OPTIONS`` takes the designs written with those options
    as its baselines: its final differences are the written-out paired intervals of the known
    losses, and a variant no design is written with is refused naming it."""
    import shutil

    runs = []
    for design in ("prenorm", "block"):
        label = f"{design}:norm_eps=1e-12"
        for seed, loss in enumerate(KNOWN[design]):
            name = f"{design}+norm_eps=1e-12-seed{seed}"
            shutil.copytree(comparison.parent / design, tmp_path / name)
            summary = json.loads((tmp_path / name / "summary.json").read_text())
            (tmp_path / name / "summary.json").write_text(json.dumps({**summary, "final_val_loss": loss}))
            runs.append({"design": label, "seed": seed, "dir": name})
    (tmp_path / "compare.json").write_text(json.dumps(
        {"designs": ["prenorm:norm_eps=1e-12", "block:norm_eps=1e-12"], "seeds": [0, 1, 2], "runs": runs}))
    script = Path(__file__).parents[1] / "studies" / "study_summary.py"

    def summary(*args):
        return subprocess.run([sys.executable, script, tmp_path, *args], capture_output=True, text=True, timeout=120)

    proc = summary("--variant", "norm_eps=1e-12")
    assert proc.returncode == 0, proc.stderr
    mean, (low, high) = written_out_interval("block")
    assert f"final, against prenorm:norm_eps=1e-12:\n  block:norm_eps=1e-12 {mean:+.4f} [{low:+.4f}, {high:+.4f}] better" \
        in proc.stdout
    assert "  block:norm_eps=1e-12 - prenorm:norm_eps=1e-12: " in proc.stdout
    refused = summary("--variant", "norm_eps=1e-9")
    assert refused.returncode == 1
    assert (f"--variant norm_eps=1e-9: no design of {tmp_path} is written with it; its designs are "
            "['prenorm:norm_eps=1e-12', 'block:norm_eps=1e-12']") in refused.stderr


def test_two_identical_comparisons_log_identical_losses(tmp_path):
    """The same command twice on one machine: the same losses, bit for bit, in every run's log and
    in results.json."""
    reports = []
    for name in ("a", "b"):
        proc = run_compare(tmp_path / name, "--designs", "prenorm", "block", "--set", "run.steps=4",
                           "--set", "run.log_every=1")
        assert proc.returncode == 0, proc.stderr
        reports.append(Path(proc.stdout.strip().splitlines()[-1]).parent)
    a, b = reports
    for design in ("prenorm", "block"):
        rows = [[{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"}
                 for line in (root / design / "metrics.jsonl").read_text().splitlines()] for root in (a, b)]
        assert rows[0] == rows[1] and len(rows[0]) == 6
    results = [json.loads((root / "results.json").read_text()) for root in (a, b)]
    assert results[0] == results[1]


def test_the_report_says_when_its_runs_come_from_several_machines(comparison, tmp_path):
    """Each run's summary records its machine; one machine says nothing, and a run whose
    summary names another machine (a comparison continued elsewhere) is listed with it."""
    import shutil

    from attnres.train.machine import machine

    root = tmp_path / "copy"
    shutil.copytree(comparison.parent, root)
    summaries = sorted(root.glob("*/summary.json"))
    here = json.loads(summaries[0].read_text())["machine"]
    mine = machine()  # this process's: the same CPU and PyTorch (its threads are the test worker's)
    assert (here["cpu"], here["torch"]) == (mine["cpu"], mine["torch"]) and len(here["id"]) == 16
    assert "machines" not in (root / "report.md").read_text()
    moved = json.loads(summaries[0].read_text())
    moved["machine"] = {**here, "id": "0123456789abcdef", "cpu": "another CPU"}
    summaries[0].write_text(json.dumps(moved))
    assert cli_in_process("report", root).returncode == 0
    text = (root / "report.md").read_text()
    assert "**The runs come from 2 machines**" in text and "0123456789abcdef (another CPU" in text
    assert "different corpora" not in text


def test_each_run_records_the_tokens_it_read_and_the_report_says_when_they_differ(comparison, tmp_path):
    """summary.json's data_sha256 is the digest of the tokens the run read (Corpus.digest): one
    for every run of a comparison, changed by one token; a run that read other data is listed."""
    import shutil

    import numpy as np

    from attnres.train.data import Corpus

    root = tmp_path / "copy"
    shutil.copytree(comparison.parent, root)
    summaries = sorted(root.glob("*/summary.json"))
    digests = {json.loads(p.read_text())["data_sha256"] for p in summaries}
    assert len(summaries) > 1 and len(digests) == 1 and len(digests.pop()) == 16
    tokens = np.arange(100, dtype=np.uint16)
    one = Corpus(tokens, tokens[:10], 256, "x").digest()
    changed = tokens.copy()
    changed[50] += 1
    assert one == Corpus(tokens.copy(), tokens[:10].copy(), 256, "y").digest()
    assert one != Corpus(changed, tokens[:10], 256, "x").digest()
    # the same tokens split elsewhere between train and validation
    assert Corpus(tokens[:50], tokens[50:], 256, "x").digest() != Corpus(tokens[:60], tokens[60:], 256, "x").digest()
    assert one != Corpus(tokens.astype(np.int64), tokens[:10], 256, "x").digest()
    other = json.loads(summaries[0].read_text())
    other["data_sha256"] = "fedcba9876543210"
    summaries[0].write_text(json.dumps(other))
    assert cli_in_process("report", root).returncode == 0
    text = (root / "report.md").read_text()
    assert "**The runs read 2 different corpora**" in text and "fedcba9876543210: " in text


def test_each_run_records_its_packages_and_the_report_says_when_they_differ(comparison, tmp_path):
    """summary.json's machine holds the lock's digest and the distributions that differ from it
    (train/machine.py): alike for every run of a comparison, so the report says nothing; a run
    with another version of numpy is listed, and a run recorded without the fields is left out."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(comparison.parent, root)
    summaries = sorted(root.glob("*/summary.json"))
    recorded = [json.loads(p.read_text())["machine"] for p in summaries]
    assert len({(m["lock_sha256"], json.dumps(m["unlocked"])) for m in recorded}) == 1
    assert len(recorded[0]["lock_sha256"]) == 64
    assert "sets of packages" not in (root / "report.md").read_text()
    moved = json.loads(summaries[0].read_text())
    moved["machine"]["unlocked"] = {"numpy": {"installed": "2.0.0", "locked": "2.4.6"},
                                    "rich": {"installed": "15.0.0", "locked": None}}
    summaries[0].write_text(json.dumps(moved))
    older = json.loads(summaries[1].read_text())
    del older["machine"]["lock_sha256"], older["machine"]["unlocked"]  # a run from before the fields
    summaries[1].write_text(json.dumps(older))
    for path in summaries[2:]:  # as an environment built by `make setup` records them
        alike = json.loads(path.read_text())
        alike["machine"]["unlocked"] = {}
        path.write_text(json.dumps(alike))
    assert cli_in_process("report", root).returncode == 0
    text = (root / "report.md").read_text()
    note = next(line for line in text.splitlines() if "sets of packages" in line)
    assert note.startswith("**The runs come from 2 sets of packages** (`lock_sha256`, `unlocked`): ")
    lock = recorded[0]["lock_sha256"][:16]
    assert (f"lock {lock}, unlocked numpy 2.0.0 (locked 2.4.6), rich 15.0.0 (not in the lock): "
            f"{summaries[0].parent.name} seed 0" in note), note
    assert f"lock {lock}, as locked: " in note and f"{summaries[1].parent.name} seed" not in note
    assert "machines" not in text and "different corpora" not in text


@pytest.mark.parametrize("value, text", [(0.0, "+0.0000"), (-0.01234, "-0.0123"), (5e-5, "+0.0001"),
                                         (-2.4e-5, "-2.40e-05"), (3e-7, "+3.00e-07")])
def test_differences_too_small_for_four_decimals_are_written_in_scientific_notation(value, text):
    from attnres.analysis.report import _signed

    assert _signed(value) == text
