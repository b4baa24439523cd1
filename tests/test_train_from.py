"""`attnres train --from MODEL_DIR`: a Hugging Face folder's model (a source, its conversion, an
attnres export) continues training through the trainer's own loop, and goes back to a folder of
its architecture with `attnres export`."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnres.hf  # noqa: E402  (registers the Auto classes)
from attnres.hf import byte_tokenizer, convert  # noqa: E402
from attnres.train.data import batch_at, load_corpus  # noqa: E402
from attnres.train.config import DataConfig  # noqa: E402

from .conftest import cli_in_process  # noqa: E402
from .test_interrupt import signal_after_first_step  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)
QUIET = ["--set", "run.progress=false", "--set", "run.tensorboard=false", "--set", "run.log_every=1"]
TINY = ["--preset", "tiny", "--set", "run.steps=3", *QUIET]


def save(model, folder: Path) -> Path:
    model.save_pretrained(str(folder))
    byte_tokenizer().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama with tied embeddings (non-trivial norm gains), its Delta conversion, a
    tiny Mixtral and its conversion, each saved with the byte tokenizer (the Mixtral without)."""
    root = tmp_path_factory.mktemp("folders")
    torch.manual_seed(0)
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL, tie_word_embeddings=True))
    with torch.no_grad():
        for name, p in llama.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    mixtral = transformers.AutoModelForCausalLM.from_config(
        transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2))
    folders = dict(llama=save(llama, root / "llama"), conv=save(convert(llama, heads=2, block_layers=1), root / "conv"))
    mixtral.save_pretrained(str(root / "mixtral"))
    convert(mixtral, heads=2, block_layers=1).save_pretrained(str(root / "mixtral-conv"))
    folders.update(mixtral=root / "mixtral", mixtral_conv=root / "mixtral-conv")
    return folders


def rows(run_dir: Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def train_from(folder: Path, run_dir: Path, *extra):
    result = cli_in_process("train", "--from", folder, *TINY, *extra, "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    return rows(run_dir)


@pytest.fixture(scope="module")
def trained(folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {name: (root / name, train_from(folders[name], root / name)) for name in ("llama", "conv")}


def test_the_first_step_is_the_folder_models_own_loss_and_the_conversion_matches_its_source(folders, trained):
    """Step 1's loss is the loss, before any update, of the folder's model on the trainer's
    first batch, computed here by `transformers` itself; the conversion, exact, gives the same
    loss to the last bit."""
    run_dir, llama_rows = trained["llama"]
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["model"] is None and cfg["init_from"] == str(folders["llama"].resolve())
    assert cfg["data"]["tokenizer"] == "model"  # the folder's tokenizer, unless data.tokenizer is given
    data = DataConfig(**cfg["data"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folders["llama"]))
    corpus = load_corpus(data, 256, tokenizer=tokenizer)
    r = cfg["run"]
    x, y = batch_at(corpus.train, r["batch_size"], r["seq_len"], r["seed"], 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folders["llama"]), dtype=torch.float32)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
    assert abs(llama_rows[0]["loss"] - float(expected)) < 1e-5
    conv_rows = trained["conv"][1]
    assert conv_rows[0]["loss"] == llama_rows[0]["loss"]
    assert [row["step"] for row in conv_rows] == [1, 2, 3] and conv_rows[-1]["loss"] < conv_rows[0]["loss"]
    summary = json.loads((trained["conv"][0] / "summary.json").read_text())
    assert summary["residual"] == "attnres_llama" and summary["init_from"]["architecture"] == "attnres_llama"
    assert summary["parameters"] == sum(p.numel() for p in convert(model, heads=2, block_layers=1).parameters())


def test_export_writes_the_run_back_as_its_folders_architecture(folders, trained, tmp_path):
    """The exported folder loads with `from_pretrained` as the source's architecture, with the
    source's tokenizer, and computes what the trained checkpoint computes; its weights moved."""
    from safetensors.torch import load_file

    run_dir = trained["conv"][0]
    result = cli_in_process("export", run_dir, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert exported.config.model_type == "attnres_llama"
    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    weights = {k.removeprefix("lm."): v for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    original = transformers.AutoModelForCausalLM.from_pretrained(str(folders["conv"]), dtype=torch.float32)
    original.load_state_dict(weights)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(exported(input_ids=x).logits, original(input_ids=x).logits)
    gates = exported.state_dict()["routing.gates"]
    assert gates.abs().max() > 0  # the conversion's gates start at zero and trained
    refused = cli_in_process("export", run_dir, tmp_path / "llama", "--format", "llama")
    assert refused.returncode != 0 and "--format 'llama' applies to attnres's own runs" in refused.stderr
    refused = cli_in_process("generate", run_dir)
    assert refused.returncode != 0 and "reads attnres's own runs; `attnres export" in refused.stderr


def test_a_mixture_of_experts_keeps_its_balance_loss_and_its_conversion_starts_equal(folders, tmp_path):
    """A Mixtral (no tokenizer in its folder: the bytes) trains with its routers' balance loss,
    logged before its weight; its conversion's first step is equal to the last bit."""
    source = train_from(folders["mixtral"], tmp_path / "source")
    converted = train_from(folders["mixtral_conv"], tmp_path / "conv")
    assert json.loads((tmp_path / "source" / "config.json").read_text())["data"]["tokenizer"] == "byte"
    assert converted[0]["loss"] == source[0]["loss"] and converted[0]["moe_aux_loss"] == source[0]["moe_aux_loss"]
    # step 1's balance loss (before any update) is transformers' own on the first batch
    cfg = json.loads((tmp_path / "source" / "config.json").read_text())
    corpus = load_corpus(DataConfig(**cfg["data"]), 256)
    x, _ = batch_at(corpus.train, cfg["run"]["batch_size"], cfg["run"]["seq_len"], cfg["run"]["seed"], 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folders["mixtral"]), dtype=torch.float32)
    with torch.no_grad():
        expected = model(input_ids=x, output_router_logits=True).aux_loss
    assert source[0]["moe_aux_loss"] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--set", "model.dim=64"], "--set model.dim: the run trains the model of"),
    (["--set", "run.pp_size=2"], "run.pp_size=2: a run that continues a folder's model (--from) is not pipelined"),
    (["--set", "data.tokenizer=bpe"], "data.tokenizer='bpe' trains a new tokenizer"),
    (["--set", "run.seq_len=128"], r"run.seq_len=128 exceeds the context of the model in"),
    (["--set", "optim.query_lr_scale=0.1"], "optim.query_lr_scale=0.1 scales the input-dependent queries"),
    (["--resume"], "--from starts a run from a model folder and --resume continues a run"),
])
def test_refusals_name_the_setting_and_leave_no_folder(folders, tmp_path, args, message):
    result = cli_in_process("train", "--from", folders["conv"], *TINY, *args, "--run-dir", tmp_path / "run")
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_run_whose_source_folder_moved_names_its_saved_init_from(trained, tmp_path):
    """Resuming or exporting a run whose source folder is gone names the run's saved init_from,
    not an option the command was not given."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained["conv"][0], run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    config["init_from"] = str(tmp_path / "moved")
    (run_dir / "config.json").write_text(json.dumps(config))
    for args in (("export", run_dir, tmp_path / "out"), ("train", "--resume", "--run-dir", run_dir)):
        result = cli_in_process(*args)
        assert result.returncode != 0 and f"--from {tmp_path / 'moved'}" not in result.stderr, result.stderr
        assert f"the run's init_from ({run_dir / 'config.json'}) {tmp_path / 'moved'}: not a model folder" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_run_folder_or_a_folder_without_a_model_is_refused(trained, tmp_path):
    result = cli_in_process("train", "--from", trained["conv"][0], *TINY, "--run-dir", tmp_path / "run")
    assert result.returncode != 0 and "is a training run's folder: continue it with attnres train --resume" in result.stderr
    result = cli_in_process("train", "--from", tmp_path, *TINY, "--run-dir", tmp_path / "run")
    assert result.returncode != 0 and "not a model folder (no config.json)" in result.stderr


@pytest.mark.slow
def test_ctrl_c_then_resume_continues_as_an_uninterrupted_run(folders, tmp_path):
    """SIGINT saves a checkpoint; `--resume` continues with no log row repeated or missing, and
    its losses are those of a run never interrupted (constant schedule: the length of the run
    does not change the learning rate). The interrupted run computes on as many threads as the
    resumed and the uninterrupted runs here: a step's reductions split over another number of threads round
    otherwise, which AdamW's first, nearly sign-like updates hide until a later step."""
    constant = ["--set", "optim.schedule=constant", "--set", "optim.warmup_steps=0"]
    command = [sys.executable, "-m", "attnres", "train", "--from", str(folders["conv"]), *TINY, *constant]
    proc = subprocess.Popen([*command, "--set", "run.steps=100000", "--run-dir", str(tmp_path / "a")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    _, err = signal_after_first_step(proc, lambda: tmp_path / "a" / "metrics.jsonl", signal.SIGINT)
    assert proc.returncode == 128 + signal.SIGINT, err
    stopped = json.loads((tmp_path / "a" / "summary.json").read_text())["steps"]
    total = stopped + 2
    resumed = cli_in_process("train", "--resume", "--run-dir", tmp_path / "a", "--set", f"run.steps={total}")
    assert resumed.returncode == 0, resumed.stderr
    whole = train_from(folders["conv"], tmp_path / "b", *constant, "--set", f"run.steps={total}")
    got = rows(tmp_path / "a")
    assert [row["step"] for row in got] == list(range(1, total + 1))
    assert np.array_equal([row["loss"] for row in got], [row["loss"] for row in whole])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_under_torchrun_log_one_process_losses(folders, trained, tmp_path, parallel):
    """DDP and FSDP2 over two gloo ranks log the losses of one process on the same batches
    (1e-5); the sharded checkpoint exports back as the folder's architecture."""
    import os

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           "-m", "attnres", "train", "--from", str(folders["conv"]), *TINY,
                           "--set", f"run.parallel={parallel}", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = [row["loss"] for row in trained["conv"][1]]
    losses = [row["loss"] for row in rows(run_dir)]
    assert len(losses) == len(single) == 3
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, single)), (losses, single)
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    result = cli_in_process("export", run_dir, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "out")).model_type == "attnres_llama"


# -- attnres compare --from ------------------------------------------------------------------

def compare_from(folder: Path, out: Path, *extra):
    result = cli_in_process("compare", "--from", folder, "--preset", "tiny", "--set", "run.progress=false",
                            "--set", "run.tensorboard=false", "--out", out, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return Path(result.stdout.strip().splitlines()[-1]).parent


def test_compare_from_pairs_a_conversion_with_its_control_and_measures_the_shock(folders, tmp_path):
    """`compare --from` trains the source as it is and its conversion on the same batches: the
    paired interval as every comparison, and the shock over every one of the first steps, the
    first step's difference exactly 0 (the conversion is exact); the conversion is written once
    into the comparison's folder and the report says what the seeds vary."""
    root = compare_from(folders["llama"], tmp_path, "--designs", "source", "convert:heads=2:block_layers=1",
                        "--seeds", "0", "1", "--shock-steps", "5")
    results = json.loads((root / "results.json").read_text())
    conv = results["designs"]["convert:heads=2:block_layers=1"]
    assert results["baseline"] == "source" and conv["ci95"] is not None and len(conv["val_loss"]) == 2
    assert conv["shock"]["steps"] == 5 and conv["shock"]["step0_diff"] == 0.0
    # the shock's figures, recomputed here from the two runs' logs
    diffs, noise = [], []
    for seed in (0, 1):
        control = {r["step"]: r["loss"] for r in rows(root / f"source-seed{seed}") if r["step"] <= 5}
        converted = {r["step"]: r["loss"] for r in rows(root / f"convert+heads=2+block_layers=1-seed{seed}")
                     if r["step"] <= 5}
        assert sorted(control) == sorted(converted) == [1, 2, 3, 4, 5]  # log_every=2, yet every step
        diffs.append(max(abs(converted[t] - control[t]) for t in control))
        noise.append(float(np.std(np.diff([control[t] for t in sorted(control)]), ddof=1)))
    assert conv["shock"]["max_abs_diff"] == pytest.approx(max(diffs), abs=1e-12)
    assert conv["shock"]["control_noise"] == pytest.approx(max(noise), rel=1e-9)
    converted_folder = root / "models" / "convert+heads=2+block_layers=1"
    assert transformers.AutoConfig.from_pretrained(str(converted_folder)).delta_heads == 2
    config = json.loads((root / "convert+heads=2+block_layers=1-seed0" / "config.json").read_text())
    assert config["init_from"] == str(converted_folder.resolve()) and config["run"]["log_first"] == 5
    report = (root / "report.md").read_text()
    assert "## Optimization shock" in report and "the intervals leave out the source's own variance" in report


@pytest.mark.parametrize("args, message", [
    (["--designs", "source", "full"], "design 'full': under --from the designs are 'source[:lr=X]'"),
    (["--designs", "convert"], "include the design 'source'"),
    (["--designs", "source", "convert:heads=3"], "design 'convert:heads=3': heads=3 must be a positive integer dividing"),
    (["--designs", "source", "convert:depth=2"], "'depth=2' is not an option"),
    (["--budgets", "1", "2"], "--budgets trains the baseline at larger budgets"),
    (["--set", "model.n_layers=4"], "--set model.n_layers: the run trains the model of"),
    (["--set", "run.seq_len=128"], "run.seq_len=128 exceeds the context of the model in"),
])
def test_compare_from_refuses_before_any_work(folders, tmp_path, args, message):
    result = cli_in_process("compare", "--from", folders["llama"], "--preset", "tiny", "--out", tmp_path / "out", *args)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_the_conversion_options_are_refused_without_from(tmp_path):
    result = cli_in_process("compare", "--preset", "tiny", "--tasks", "hellaswag", "--out", tmp_path)
    assert result.returncode != 0 and "--tasks applies to a comparison --from a model folder" in result.stderr


def test_shock_against_curves_worked_by_hand():
    from attnres.analysis.conversion_stats import shock

    control = {1: 5.0, 2: 4.0, 3: 3.5, 4: 3.0}  # changes -1, -0.5, -0.5: sd 0.288675...
    converted = {1: 5.0, 2: 4.25, 3: 3.5, 4: 2.9}
    out = shock(control, converted)
    assert out == {"steps": 4, "step0_diff": 0.0, "max_abs_diff": 0.25, "control_noise": pytest.approx(3 ** -0.5 / 2)}
    with pytest.raises(ValueError, match="incomplete"):
        shock({1: 5.0, 3: 4.0}, {1: 5.0, 3: 4.0})


@pytest.mark.slow
def test_compare_from_with_a_local_task_pairs_the_answers_item_by_item(folders, tmp_path):
    """With --tasks each run is exported and evaluated with lm-eval; the McNemar counts and p
    of each seed are those of the runs' own logged answers, recomputed here."""
    from .test_hf import DOCS, TASK

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tasks / "attnres_tiny.yaml").write_text(TASK.format(data=tasks / "docs.jsonl"))
    root = compare_from(folders["llama"], tmp_path / "out", "--designs", "source", "convert:heads=2:block_layers=1",
                        "--seeds", "0", "1", "--tasks", "attnres_tiny", "--include-path", tasks)
    results = json.loads((root / "results.json").read_text())
    answers = json.loads((root / "downstream.json").read_text())["runs"]
    for seed in ("0", "1"):
        test = results["downstream"]["by_task"]["attnres_tiny"]["convert:heads=2:block_layers=1"][seed]
        control = answers[f"source-seed{seed}"]["attnres_tiny"]
        treated = answers[f"convert+heads=2+block_layers=1-seed{seed}"]["attnres_tiny"]
        assert test["items"] == len(DOCS) == len(control) == len(treated)
        assert test["n01"] == sum(control[i] and not treated[i] for i in control)
        assert test["n10"] == sum(treated[i] and not control[i] for i in control)
        from scipy.stats import binomtest

        discordant = test["n01"] + test["n10"]
        expected = binomtest(min(test["n01"], test["n10"]), discordant, 0.5).pvalue if discordant else 1.0
        assert test["p"] == pytest.approx(expected)
    assert "## Downstream, paired item by item" in (root / "report.md").read_text()


def test_a_stopped_compare_from_resumes_with_its_folders(folders, tmp_path):
    """SIGTERM at the conversion's step 3 stops the comparison (exit 143, its checkpoint
    saved); `compare --resume` reads the source folder from compare.json and finishes it: every
    step logged once, the shock measured over all of them, the first difference 0."""
    import os

    from attnres.train import trainer

    real = trainer.train_step

    def step(run, index, logging):
        result = real(run, index, logging)
        if run.spec.residual_name(run.cfg).startswith("attnres_") and index + 1 == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "train_step", step)
        stopped = cli_in_process("compare", "--from", folders["llama"], "--preset", "tiny", "--set", "run.progress=false",
                                 "--designs", "source", "convert:heads=2:block_layers=2", "--out", tmp_path)
    assert stopped.returncode == 143, stopped.stderr
    root = next(tmp_path.glob("compare-*"))
    assert json.loads((root / "compare.json").read_text())["complete"] is False
    resumed = cli_in_process("compare", "--resume", root)
    assert resumed.returncode == 0, resumed.stderr
    steps = [r["step"] for r in rows(root / "convert+heads=2+block_layers=2")]
    assert steps == list(range(1, 9))  # tiny: 8 steps, each of the first 8 logged (shock steps: all)
    shock = json.loads((root / "results.json").read_text())["designs"]["convert:heads=2:block_layers=2"]["shock"]
    assert shock["steps"] == 8 and shock["step0_diff"] == 0.0


def test_finetune_runs_the_trainer_and_a_signal_reaches_its_caller(folders):
    """`hf.finetune` trains a model object through the trainer (the first loss is the model's own
    on the trainer's first batch); SIGINT stops it after the step with KeyboardInterrupt, the
    model keeping the steps it took."""
    import os

    from attnres.hf.finetune import finetune

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folders["conv"]), dtype=torch.float32)
    tokens = np.frombuffer(bytes(range(32, 127)) * 200, dtype=np.uint8).astype(np.int64)
    x, y = batch_at(tokens, 2, 16, 0, 0)
    with torch.no_grad():
        expected = float(torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()))
    losses = finetune(model, tokens, steps=2, batch_size=2, seq_len=16)
    assert len(losses) == 2 and losses[0] == pytest.approx(expected, abs=1e-5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(KeyboardInterrupt, match="after step 1"):
        finetune(model, tokens, steps=50, batch_size=2, seq_len=16,
                 on_step=lambda step, _model: os.kill(os.getpid(), signal.SIGINT))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_routing_learning_rate_reaches_a_conversion_and_the_control_is_not_refused(folders, tmp_path):
    """``optim.routing_lr_scale`` scales a converted folder's ``routing.*`` and is refused for a
    source that has none; in ``compare --from`` a conversion carries it as an option of its own
    and the control, the source as it is, trains at 1."""
    plain = cli_in_process("train", "--from", folders["llama"], "--preset", "tiny", "--set", "optim.routing_lr_scale=10",
                           "--run-dir", tmp_path / "plain")
    assert plain.returncode == 2 and "has none: convert it first" in plain.stderr and not (tmp_path / "plain").exists()
    run = tmp_path / "conv"
    train_from(folders["conv"], run, "--set", "optim.routing_lr_scale=10", "--set", "run.steps=1")
    assert json.loads((run / "config.json").read_text())["optim"]["routing_lr_scale"] == 10.0
    label = "convert:heads=2:block_layers=1:routing_lr_scale=100"
    root = compare_from(folders["llama"], tmp_path / "cmp", "--designs", "source", label, "--set", "run.steps=2",
                        "--shock-steps", "2")
    scales = {name: json.loads((root / name / "config.json").read_text())["optim"]["routing_lr_scale"]
              for name in ("source", "convert+heads=2+block_layers=1+routing_lr_scale=100")}
    assert scales == {"source": 1.0, "convert+heads=2+block_layers=1+routing_lr_scale=100": 100.0}
    results = json.loads((root / "results.json").read_text())
    # the conversion's routing movement, recomputed here from its folder and the run's last checkpoint
    from safetensors.torch import load_file

    start = load_file(str(root / "models" / "convert+heads=2+block_layers=1+routing_lr_scale=100" / "model.safetensors"))
    run_dir = root / "convert+heads=2+block_layers=1+routing_lr_scale=100"
    end = load_file(str(sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))
    changes = torch.cat([(end.get(n, end.get(f"lm.{n}")).double() - t.double()).abs().flatten()
                         for n, t in start.items() if n.startswith("routing.")])
    movement = results["designs"][label]["routing_movement"]
    assert movement["max_abs"] == pytest.approx(float(changes.max()), rel=1e-12) and movement["max_abs"] > 0
    assert movement["mean_abs"] == pytest.approx(float(changes.mean()), rel=1e-12)
    assert "routing_movement" not in results["designs"]["source"]  # the control has no routing
    summary = json.loads((run_dir / "summary.json").read_text())
    assert results["data_sha256"] == summary["data_sha256"]
    assert results["designs"][label]["tokens_per_parameter"] == summary["tokens"] / summary["parameters"]


def test_a_runs_settings_are_checked_once_and_its_plan_built_once(folders, tmp_path, monkeypatch):
    """`attnres train` of attnres's own model and of a folder's: one parallel plan per run,
    the one its settings' check built and the trainer runs on."""
    from attnres.train import parallel_plan, validate

    built = []

    def counted(*args, **kwargs):
        built.append(args)
        return plan_parallel(*args, **kwargs)

    plan_parallel, check_fields = parallel_plan.plan_parallel, validate.check_fields
    checked = []
    monkeypatch.setattr(parallel_plan, "plan_parallel", counted)
    # check_run's first check, which nothing else calls: one call a check of the settings
    monkeypatch.setattr(validate, "check_fields", lambda cfg: checked.append(cfg) or check_fields(cfg))
    for source in ([], ["--from", folders["llama"]]):
        built.clear()
        checked.clear()
        run_dir = tmp_path / ("from" if source else "own")
        result = cli_in_process("train", *source, *TINY, "--run-dir", run_dir)
        assert result.returncode == 0, result.stderr[-2000:]
        assert len(built) == 1 and len(checked) == 1, (source, built, checked)
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
