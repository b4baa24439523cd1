"""`attnres compare` end to end on the tiny preset: the report's numbers are the saved ones."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest


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


def table_rows(text):
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 8 and cells[0] not in ("design", "---"):
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
        assert float(cells[3]) == pytest.approx(last_val - base, abs=1e-4)
        assert int(cells[4].replace(",", "")) == summary["parameters"]


def test_report_figures_exist_and_are_pngs(comparison):
    text = comparison.read_text()
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert {"loss_curves.png", "hidden_rms.png", "grad_norms.png", "depth_weights_block.png",
            "depth_weights_mhar.png"} <= set(figures)
    for name in figures:
        assert (comparison.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "same 768 training tokens" in text  # 6 steps of 4 x 32
    assert "seed-to-seed noise" in text


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
    proc = subprocess.run([sys.executable, "-m", "attnres", "report", str(comparison.parent)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert comparison.read_text() == before


def test_generate_from_a_run(comparison):
    proc = subprocess.run([sys.executable, "-m", "attnres", "generate", str(comparison.parent / "block"),
                           "--prompt", "import ", "--max-new-tokens", "12", "--temperature", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("import ") and len(proc.stdout.encode()) >= len("import ") + 1


def test_generate_with_its_defaults_fits_the_context(comparison):
    """The tiny preset's context is 64 tokens: the default request fills it instead of failing."""
    proc = subprocess.run([sys.executable, "-m", "attnres", "generate", str(comparison.parent / "block")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def ")
    too_long = subprocess.run([sys.executable, "-m", "attnres", "generate", str(comparison.parent / "block"),
                               "--max-new-tokens", "61"], capture_output=True, text=True)
    assert too_long.returncode == 2
    assert "prompt length 4 + max_new_tokens 61 exceeds max_seq_len=64" in too_long.stderr


def run_compare(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "attnres", "compare", "--preset", "tiny", "--out", str(tmp_path),
         "--set", "run.steps=2", "--set", "run.eval_every=2", "--set", "run.progress=false", *args],
        capture_output=True, text=True, timeout=600,
    )


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


@pytest.mark.parametrize("args,message", [
    (["--designs", "prenorm", "mhc", "--set", "model.num_blocks=2"],
     r"model.num_blocks=2 applies to none of the designs \['prenorm', 'mhc'\]; it is an option of \['block', 'delta'\]"),
    (["--designs", "prenorm", "block", "--set", "model.residual=block"],
     r"the designs choose the residual kind, and \['prenorm'\] are not 'block'"),
    (["--designs", "block", "--set", "model.block_size=99"], r"block_size=99 must be an integer in \[1, 4\]"),
    (["--designs", "block", "--set", "model.block_size=2", "--set", "model.num_blocks=2"],
     r"give block_size=2 or num_blocks=2, not both"),
])
def test_compare_refuses_options_that_apply_to_no_design(tmp_path, args, message):
    proc = run_compare(tmp_path, *args)
    assert proc.returncode == 2 and re.search(message, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []  # refused before any work
