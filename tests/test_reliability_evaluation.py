"""A comparison --from a folder evaluated on lm-eval tasks: Ctrl-C and SIGTERM stop its
evaluation as they stop its training, ``compare.json`` says what is pending and ``--resume``
finishes it; its task options, and ``attnres eval``'s, are checked before lm-eval loads."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from tests.conftest import cli_in_process  # noqa: E402
from tests.test_hf import DOCS, TASK  # noqa: E402
from tests.test_reliability_settings import eval_without_lm_eval  # noqa: E402
from tests.test_train_from import SMALL, TINY, save  # noqa: E402

FROM = ["--designs", "source", "convert:heads=2:block_layers=1", *TINY, "--set", "run.steps=4"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL, tie_word_embeddings=True))
    return save(model, tmp_path_factory.mktemp("llama") / "llama")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A local lm-eval task of three items (``attnres_tiny``) in its own folder."""
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "attnres_tiny.yaml").write_text(TASK.format(data=folder / "docs.jsonl"))
    return folder


def stop_at(patch, sig: int, where) -> None:
    """Patch the trainer's step to send ``sig`` after the step where ``where(run, step)``."""
    from attnres.train import trainer

    real = trainer.train_step

    def step(run, index, logging):
        result = real(run, index, logging)
        if where(run, index + 1):
            os.kill(os.getpid(), sig)
        return result

    patch.setattr(trainer, "train_step", step)


def test_a_signal_at_the_end_of_training_leaves_the_evaluation_pending(llama, tasks, tmp_path):
    """SIGTERM during the comparison's last step: every run trained, so ``complete`` stays true,
    but the evaluation did not run: ``downstream.complete`` is false beside ``stopped_by``, the
    command exits 143 and prints the resume command (was: exit 143, compare.json complete with
    nothing pending, no hint)."""
    with pytest.MonkeyPatch.context() as patch:
        stop_at(patch, signal.SIGTERM, lambda run, step: run.spec.residual_name(run.cfg).startswith("attnres_") and step == 4)
        out = cli_in_process("compare", "--from", llama, *FROM, "--tasks", "attnres_tiny", "--include-path", tasks,
                             "--out", tmp_path)
    root = next(tmp_path.glob("compare-*"))
    assert out.returncode == 143, out.stderr
    index = json.loads((root / "compare.json").read_text())
    assert index["complete"] is True and index["stopped_by"] == "SIGTERM"
    assert index["downstream"]["complete"] is False and index["downstream"]["tasks"] == ["attnres_tiny"]
    assert f"continue it with: attnres compare --resume {root}" in out.stdout + out.stderr
    assert not (root / "downstream.json").exists()
    assert "The evaluation on attnres_tiny is incomplete" in (root / "report.md").read_text()


@pytest.mark.slow
def test_ctrl_c_during_the_evaluation_stops_it_and_resume_finishes_it(llama, tasks, tmp_path):
    """Ctrl-C while the second run is evaluated (the first evaluated by lm-eval): the evaluation
    stops at once, exit 130, ``compare.json`` says it is pending (was: the signal ignored, or exit
    130 with compare.json complete and no resume hint); ``--resume`` evaluates the run left and
    the report pairs the answers; a second ``--resume`` is refused, nothing left to do."""
    from attnres.experiments import downstream

    real, calls = downstream.evaluate, []

    def evaluate(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(downstream, "evaluate", evaluate)
        out = cli_in_process("compare", "--from", llama, *FROM, "--tasks", "attnres_tiny", "--include-path", tasks,
                             "--out", tmp_path)
    root = next(tmp_path.glob("compare-*"))
    assert out.returncode == 130, out.stderr
    index = json.loads((root / "compare.json").read_text())
    assert index["complete"] is True and index["stopped_by"] == "SIGINT" and index["downstream"]["complete"] is False
    assert f"continue it with: attnres compare --resume {root}" in out.stdout + out.stderr
    assert list(json.loads((root / "downstream.json").read_text())["runs"]) == ["source"]
    resumed = cli_in_process("compare", "--resume", root)
    assert resumed.returncode == 0, resumed.stderr
    index = json.loads((root / "compare.json").read_text())
    assert index["downstream"]["complete"] is True and "stopped_by" not in index
    assert sorted(json.loads((root / "downstream.json").read_text())["runs"]) == ["convert+heads=2+block_layers=1",
                                                                                 "source"]
    assert "## Downstream, paired item by item" in (root / "report.md").read_text()
    again = cli_in_process("compare", "--resume", root)
    assert again.returncode == 2 and "its evaluation too: nothing to resume" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["--limit", "5"], "--limit applies to the evaluation on --tasks"),
    (["--include-path", "."], "--include-path applies to the evaluation on --tasks"),
    (["--tasks", "attnres_tiny", "--include-path", "missing"], "--include-path missing: no such folder"),
    (["--tasks", "attnres_tiny", "--include-path", "attnres_tiny.yaml"], "--include-path attnres_tiny.yaml is a file"),
    (["--tasks", "no_such_task_at_all"], "unknown lm-eval task(s) ['no_such_task_at_all']"),
])
def test_compare_from_checks_its_task_options_before_any_work(llama, tasks, tmp_path, args, message, monkeypatch):
    """``--limit`` or ``--include-path`` without ``--tasks`` (was: accepted and ignored), an
    include path that is missing or a file (was: read as no tasks, then "unknown task" after
    lm-eval indexed its own), an unknown task (was: refused once lm-eval had indexed its ~14,000
    task files): refused before any run, in one line, lm-eval's index never built."""
    from lm_eval import tasks as lm_eval_tasks

    monkeypatch.setattr(lm_eval_tasks, "TaskManager", lambda *a, **k: pytest.fail("lm-eval indexed its tasks"))
    monkeypatch.chdir(tasks)
    out = cli_in_process("compare", "--from", llama, *FROM, *args, "--out", tmp_path / "out")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["missing", "file", "unknown"])
def test_eval_checks_its_tasks_and_include_path_before_lm_eval_loads(llama, tasks, case):
    """``attnres eval --include-path`` naming a missing folder or a file, and an unknown task:
    refused at once, lm-eval and transformers never imported (was: lm-eval indexed its tasks for
    seconds, then an unknown task; a missing include path silently read as empty)."""
    args, message = {
        "missing": (["--tasks", "attnres_tiny", "--include-path", tasks / "nothing"], "no such folder"),
        "file": (["--tasks", "attnres_tiny", "--include-path", tasks / "attnres_tiny.yaml"], "is a file"),
        "unknown": (["--tasks", "no_such_task_at_all"], "unknown lm-eval task(s) ['no_such_task_at_all']"),
    }[case]
    proc = eval_without_lm_eval(llama, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout.strip() == "[]"


def test_a_known_task_passes_the_check(tasks):
    """The check refuses no task lm-eval or the include path holds (a name, or a pattern)."""
    from attnres.eval_tasks import check_tasks

    check_tasks(["hellaswag", "arc_easy", "mmlu_*"])
    check_tasks(["attnres_tiny"], str(tasks))
    assert Path(tasks).is_dir()
