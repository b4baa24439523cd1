"""What a new user breaks with settings that pass the checks and fail later, or do nothing: each
refused in one line before any folder is written, or said in one line where it runs."""

import os
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import cli_in_process

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(1500))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    for name in ("train.bin", "val.bin"):
        np.arange(4000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(folder / name)
    return folder


def common(data, *extra, steps=2):
    return ["--preset", "tiny", "--data", str(data), "--set", "run.progress=false", "--set", "run.tensorboard=false",
            "--set", f"run.steps={steps}", "--set", "run.eval_batches=1", *extra]


def one_line_error(proc, code=2):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture
def no_triton_on_cpu(monkeypatch):
    """This machine as a user's: Triton's kernels run on CUDA only (the suite's conftest lets
    them run on the CPU through Triton's interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


#: --set values that pass the field checks and fail at the first step or do nothing -> what
#: the one line must say
LATER = {
    "triton-on-cpu": (["model.residual=block", "model.backend=triton"], "model.backend='triton' cannot run on cpu"),
    "seed-past-int64": (["run.seed=100000000000000"], "run.seed=100000000000000 must be an integer in [0, "),
    "bpe-size-with-bytes": (["data.bpe_vocab_size=300"], "data.bpe_vocab_size=300 does nothing with data.tokenizer='byte'"),
    "decay-with-cosine": (["optim.decay_fraction=0.5"], "optim.decay_fraction=0.5 does nothing with optim.schedule='cosine'"),
    "floor-with-constant": (["optim.schedule=constant", "optim.min_lr_ratio=0.5"],
                            "optim.min_lr_ratio=0.5 does nothing with optim.schedule='constant'"),
}


@pytest.mark.parametrize("case", list(LATER))
def test_train_refuses_what_would_fail_later_before_any_folder(case, tmp_path, data, no_triton_on_cpu):
    """Each was accepted, then failed at step 1 with a traceback (leaving config.json, an empty
    metrics.jsonl and tensorboard/) or ran ignoring the setting: now one line naming it, and the
    default folder's parent never made."""
    assignments, words = LATER[case]
    sets = [w for a in assignments for w in ("--set", a)]
    proc = cli_in_process("train", *common(data, *sets, "--set", f"run.out_dir={tmp_path / 'runs'}"))
    assert words in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


def test_a_defaulted_or_acting_setting_is_accepted(tmp_path, data):
    """Only what the user set and does nothing is refused: the same fields act under the value
    that uses them."""
    from attnres.train.config import apply_overrides, tiny
    from attnres.train.validate import check_given

    cfg = apply_overrides(tiny(), ["optim.schedule=wsd", "optim.decay_fraction=0.5"])
    check_given(cfg, {"optim.schedule", "optim.decay_fraction"})
    check_given(tiny(), set())  # the defaults: bpe_vocab_size, decay_fraction are not the user's


def test_val_fraction_for_token_files_is_refused(tmp_path, tokens):
    """A folder of token files brings its own val.bin: ``data.val_fraction`` does nothing."""
    proc = cli_in_process("train", *common(tokens, "--set", "data.val_fraction=0.2"), "--run-dir", tmp_path / "r")
    assert "data.val_fraction=0.2 does nothing for a folder of token files" in one_line_error(proc)
    assert not (tmp_path / "r").exists()


def test_val_fraction_for_a_named_corpus_is_refused(tmp_path):
    """The default corpus's validation split is part of it: ``data.val_fraction`` does nothing."""
    proc = cli_in_process("train", "--preset", "tiny", "--set", "data.val_fraction=0.2", "--run-dir", tmp_path / "r")
    assert one_line_error(proc) == ("attnres train: error: --set data.val_fraction=0.2 does nothing for the corpus "
                                    "sdists-v1: its validation split is fixed (3% of its files, the same for every "
                                    "run); leave it out")
    assert not (tmp_path / "r").exists()
    stdlib = cli_in_process("train", "--preset", "tiny", "--set", "data.source=stdlib", "--set", "data.val_fraction=0.2",
                            "--set", "run.steps=1", "--run-dir", tmp_path / "s", "--set", "run.progress=false")
    assert stdlib.returncode == 0, stdlib.stderr


#: compare arguments refused before its first design trains -> what the one line says
COMPARE_REFUSED = {
    "triton-design": (["--designs", "prenorm", "block:backend=triton"],
                      "design 'block:backend=triton': model.backend='triton' cannot run on cpu"),
    "set-seed": (["--set", "run.seed=5"], "a comparison's seeds are chosen with --seeds"),
    "seed-past-int64": (["--seeds", "100000000000000"], "must be integers in [0, "),
}


@pytest.mark.parametrize("case", list(COMPARE_REFUSED))
def test_compare_refuses_before_its_first_design(case, tmp_path, data, no_triton_on_cpu):
    """``compare --designs prenorm block:backend=triton`` trained PreNorm, then a traceback
    (and ``--resume`` could not finish); ``--set run.seed=5`` ran seed 0: refused before any
    training, no folder made."""
    extra, words = COMPARE_REFUSED[case]
    proc = cli_in_process("compare", *common(data, *extra), "--out", tmp_path / "out")
    assert words in one_line_error(proc)
    assert not (tmp_path / "out").exists()


def test_train_resume_refuses_a_preset(tmp_path):
    """``train --resume --preset demo`` ignored the preset: refused, as compare refuses it."""
    proc = cli_in_process("train", "--resume", "--run-dir", tmp_path / "r", "--preset", "demo")
    assert "leave out --preset" in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


def test_a_repeated_variant_runs_and_says_which_it_repeats(tmp_path, data):
    """``full full:key_norm=true`` (key_norm's default is true) is an A/A control: it runs, and
    one line names the design it repeats."""
    proc = cli_in_process("compare", *common(data, "--designs", "full", "full:key_norm=true", steps=1),
                          "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stdout.splitlines() if "repeats" in line]
    assert said == ["design 'full:key_norm=true' has the settings of 'full': it repeats that design (an A/A control)"]


@pytest.fixture(scope="module")
def triton_run(tmp_path_factory, data):
    """A finished Block run with ``backend=triton``, as a GPU run's (trained here on the CPU
    through Triton's interpreter, which the suite's conftest turns on)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    run = tmp_path_factory.mktemp("gpu") / "run"
    proc = cli_in_process("train", *common(data, "--set", "model.residual=block", "--set", "model.backend=triton",
                                           steps=1), "--run-dir", run)
    assert proc.returncode == 0, proc.stderr
    return run


def test_generate_from_a_gpu_backend_run_on_the_cpu(triton_run, no_triton_on_cpu):
    """``generate`` of a run trained with ``backend=triton`` on a CPU: one line saying it uses
    ``auto``, then the text (was: a traceback at the first token)."""
    before = {p: p.read_bytes() for p in triton_run.rglob("*") if p.is_file()}
    proc = cli_in_process("generate", triton_run, "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "attnres generate: the run's model.backend='triton' cannot run on cpu (it runs on CUDA tensors (or on the "
        "CPU under TRITON_INTERPRET=1), got cpu tensors); using backend=auto"]
    assert {p: p.read_bytes() for p in triton_run.rglob("*") if p.is_file()} == before


# -- default folders -------------------------------------------------------------------------

def test_default_folders_never_collide(tmp_path):
    """Two commands started in the same second took the same default folder (``compare-...``
    exists; a run folder "in use by process ..."): each now gets its own, made atomically."""
    from attnres.files import new_folder

    first, second, third = (new_folder(tmp_path / "runs", "compare-20261204-220544") for _ in range(3))
    assert [p.name for p in (first, second, third)] == [
        "compare-20261204-220544", "compare-20261204-220544-2", "compare-20261204-220544-3"]
    assert all(p.is_dir() for p in (first, second, third))


def test_two_default_runs_in_one_second_each_get_a_folder(tmp_path, data):
    """``attnres train`` twice with the default folder in the same second (the same run.name
    and timestamp): two runs, two folders."""
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    taken = tmp_path / "runs" / f"prenorm-{stamp}"
    taken.mkdir(parents=True)
    (taken / "config.json").write_text("{}")  # a run already there
    proc = cli_in_process("train", *common(data, "--set", f"run.out_dir={tmp_path / 'runs'}", steps=1))
    assert proc.returncode == 0, proc.stderr
    made = Path(proc.stdout.strip().splitlines()[-1])
    assert made.parent == tmp_path / "runs" and made != taken and (made / "summary.json").is_file()
    assert (taken / "config.json").read_text() == "{}"


# -- errors that name their input --------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["compare", "--designs", "gr:rank=2"],
    ["train", "--set", "model.residual=gr", "--set", "model.rank=2"],
])
def test_grs_rank_points_to_gr_rank(command, tmp_path, data):
    """GR's option is ``gr_rank`` in the config (``rank`` is the stream's own name): ``rank``
    points to it."""
    proc = cli_in_process(*command, *common(data), *(["--out", tmp_path] if command[0] == "compare" else
                                                      ["--run-dir", tmp_path / "r"]))
    assert "gr_rank=2" in one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


# -- eval: fast and clear ------------------------------------------------------------------------

def eval_without_lm_eval(*args):
    """``attnres eval ARGS`` in a fresh interpreter that reports whether lm-eval or transformers
    were imported (a refusal must come before either: they take 18-35 s to load)."""
    import subprocess
    import sys

    code = ("import sys\nfrom attnres.cli import main\nrc = main(sys.argv[1:])\n"
            "print(sorted(m for m in ('lm_eval', 'transformers') if m in sys.modules))\nsys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, "eval", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("case", ["missing", "run-folder"])
def test_eval_refuses_its_folder_and_limit_before_lm_eval_loads(case, tmp_path, triton_run):
    """A missing folder and a training run's folder (was: "config.json holds no vocab_size"):
    one line at once, lm-eval and transformers never imported; a run folder is
    pointed to ``attnres export``."""
    folder, limit, words = {
        "missing": (tmp_path / "nothing", "0.5", "is not a folder"),
        "run-folder": (triton_run, "10", "is a training run's folder; `attnres export"),
    }[case]
    proc = eval_without_lm_eval(folder, "--tasks", "hellaswag", "--limit", limit)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stdout.strip() == "[]"


def test_eval_takes_the_fraction_its_help_advertises():
    """``--limit 0.5``: the fraction of each task that the help offers (was refused as not an int)."""
    from attnres.cli import build_parser

    args = build_parser().parse_args(["eval", "m", "--tasks", "t", "--limit", "0.5"])
    assert args.limit == 0.5
    assert build_parser().parse_args(["eval", "m", "--tasks", "t", "--limit", "20"]).limit == 20
    proc = cli_in_process("eval", "m", "--tasks", "t", "--limit", "1.5")
    assert proc.returncode == 2 and "argument --limit: '1.5' is neither a number" in proc.stderr


def test_export_and_eval_of_a_gpu_backend_run_on_the_cpu(triton_run, tmp_path, no_triton_on_cpu, capsys):
    """A run trained with ``backend=triton`` exports on a CPU, and eval's model loads there with
    ``backend=auto``, said in one line (was: a traceback at the first forward pass)."""
    import torch

    proc = cli_in_process("export", triton_run, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoModelForCausalLM

    from attnres.hf.evaluate import runnable_config

    capsys.readouterr()
    options = runnable_config(tmp_path / "hf", "cpu")
    assert capsys.readouterr().err.strip().splitlines() == [
        "attnres eval: the run's model.backend='triton' cannot run on cpu (it runs on CUDA tensors (or on the "
        "CPU under TRITON_INTERPRET=1), got cpu tensors); using backend=auto"]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), **options).eval()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


# -- the report says what it saw ---------------------------------------------------------------

def test_the_report_says_when_paired_designs_saw_other_tokens(tmp_path, data):
    """One design of a comparison resumed by hand to more steps: the report said every design
    saw the same tokens and showed its gain. Now it names the runs' tokens and compares no
    pair of unequal budgets."""
    proc = cli_in_process("compare", *common(data, "--designs", "prenorm", "block", steps=2), "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    root = next(tmp_path.glob("compare-*"))
    block = next(p for p in root.iterdir() if p.is_dir() and p.name.startswith("block"))
    proc = cli_in_process("train", "--run-dir", block, "--resume", "--set", "run.steps=4")
    assert proc.returncode == 0, proc.stderr
    proc = cli_in_process("report", root)
    assert proc.returncode == 0, proc.stderr
    report = (root / "report.md").read_text()
    assert "Every design saw the same" not in report
    assert "**The designs did not all see the same training tokens**: prenorm, seed 0: 256 (2 steps); " \
           "block, seed 0: 512 (4 steps)" in report, report
    assert "| block | " in report and "not compared: other tokens" in report
    import json

    results = json.loads((root / "results.json").read_text())
    assert results["designs"]["block"]["diff_mean"] is None
    assert results["designs"]["block"]["unequal_tokens"] == {"0": [256, 512]}


# -- serve: a model vLLM's CPU attention cannot run is refused before the server starts ------------

def test_serve_refuses_a_head_size_vllms_cpu_attention_does_not_run(tmp_path, triton_run):
    """An exported ``--preset tiny`` model (head size 16) started, then its first completion was
    an HTTP 500 and the server exited: refused before the server starts, naming both sizes
    (the supported list given here as vLLM's CPU backend declares it; serving_tests/ reads it
    from vLLM itself)."""
    from attnres.serving.server import check_head_size, head_size

    proc = cli_in_process("export", triton_run, tmp_path / "tiny")
    assert proc.returncode == 0, proc.stderr
    assert head_size(tmp_path / "tiny") == 16
    supported = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]
    with pytest.raises(ValueError, match=r"head size is 16 \(dim / n_heads\), which vLLM's CPU attention does "
                                         r"not run; it runs head sizes \[32, 64, 80"):
        check_head_size(tmp_path / "tiny", supported)
    check_head_size(tmp_path / "tiny", [16, 32])  # a size it runs passes
