"""A run trained ``--from`` a folder remembers that folder by its digest: a source replaced,
edited or of another shape is refused by name wherever the run is continued or written out
(``train --resume``, ``export``, ``compare --resume``), saying what changed and how to go on; a
source that moved is given its new place with ``--source``."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from attnres.hf import convert  # noqa: E402
from tests.conftest import cli_in_process  # noqa: E402
from tests.test_train_from import SMALL, TINY, rows, save, train_from  # noqa: E402


def one_line(proc, code=2) -> str:
    """The one error line of a refused command: no traceback, nothing cut off (transformers'
    progress bars aside)."""
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith(("Loading weights", "\r"))]
    assert proc.returncode == code and len(lines) == 1 and "error" in lines[0], proc.stderr
    assert not lines[0].rstrip(")").endswith(":") and "Traceback" not in proc.stderr, lines[0]
    return lines[0]


def llama(**sizes):
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SMALL, **sizes}, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama, its conversion (heads 2, one layer per block) and a run of 3 steps trained
    from the conversion."""
    root = tmp_path_factory.mktemp("sources")
    model = llama()
    save(model, root / "llama")
    save(convert(model, heads=2, block_layers=1), root / "conv")
    train_from(root / "conv", root / "run")
    return root


def own_copy(trained, tmp_path) -> tuple[Path, Path, Path]:
    """The Llama, the conversion and the run, copied (moved, as far as the run knows: its
    ``init_from`` follows) into ``tmp_path``, for a test to change."""
    for name in ("llama", "conv", "run"):
        shutil.copytree(trained / name, tmp_path / name)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    config["init_from"] = str(tmp_path / "conv")
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    return tmp_path / "llama", tmp_path / "conv", tmp_path / "run"


def test_train_from_records_the_sources_digest(trained):
    """The run's config and summary record the folder's digest: its config's fields, and each of
    its config, weight and tokenizer files by SHA-256."""
    from attnres.train.source_digest import folder_digest

    config = json.loads((trained / "run" / "config.json").read_text())
    recorded = config["init_from_digest"]
    assert recorded == folder_digest(trained / "conv")
    assert sorted(recorded["files"]) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert recorded["config"]["delta_heads"] == 2 and "transformers_version" not in recorded["config"]
    summary = json.loads((trained / "run" / "summary.json").read_text())
    assert summary["init_from"]["sha256"] == recorded["sha256"]


def test_a_source_replaced_by_another_conversion_is_refused_naming_what_changed(trained, tmp_path):
    """``convert ... SOURCE --overwrite`` with other settings, then ``train --resume`` and
    ``export`` (was: the run continued on the new architecture without a word, and export wrote
    the new config): refused naming the fields that changed and the ways on."""
    source, conv, run = own_copy(trained, tmp_path)
    done = cli_in_process("convert", source, conv, "--heads", "1", "--block-layers", "2", "--overwrite")
    assert done.returncode == 0, done.stderr
    for args in (("train", "--resume", "--run-dir", run, "--set", "run.steps=5"), ("export", run, tmp_path / "out")):
        line = one_line(cli_in_process(*args))
        assert f"the run's init_from ({run / 'config.json'}) {conv} changed since it was recorded" in line
        assert "delta_block_layers 1 -> 2, delta_heads 2 -> 1" in line and "--source DIR" in line, line
    assert not (tmp_path / "out").exists() and len(rows(run)) == 3


@pytest.mark.parametrize("field, value", [("rms_norm_eps", 1e-5), ("rope_parameters", 500000.0), ("hidden_act", "gelu")])
def test_an_edited_source_config_is_refused_naming_the_field(trained, tmp_path, field, value):
    """A field of the source's config.json edited by hand (was: read as the run's model from then
    on): ``train --resume`` and ``export`` refuse, naming the field and both values (RoPE's theta
    is a field of ``rope_parameters``)."""
    _, conv, run = own_copy(trained, tmp_path)
    config = json.loads((conv / "config.json").read_text())
    before = dict(config[field]) if field == "rope_parameters" else config[field]
    if field == "rope_parameters":
        config[field]["rope_theta"] = value
    else:
        config[field] = value
    (conv / "config.json").write_text(json.dumps(config, indent=2))
    for args in (("train", "--resume", "--run-dir", run, "--set", "run.steps=5"), ("export", run, tmp_path / "out")):
        line = one_line(cli_in_process(*args))
        assert f"config.json: {field} {before!r} -> {config[field]!r}" in line, line
    assert not (tmp_path / "out").exists()


def test_a_source_of_another_shape_is_refused_in_one_line(trained, tmp_path):
    """The source replaced by a model of another width (was: a traceback in export, ``size
    mismatch for model.embed_tokens.weight``, and a message cut off at ``FolderLM:`` in train
    --resume): one line each, naming the changed size."""
    _, conv, run = own_copy(trained, tmp_path)
    shutil.rmtree(conv)
    save(convert(llama(hidden_size=64), heads=2, block_layers=1), conv)
    for args in (("train", "--resume", "--run-dir", run, "--set", "run.steps=5"), ("export", run, tmp_path / "out")):
        line = one_line(cli_in_process(*args))
        assert "hidden_size 32 -> 64" in line and "model.safetensors changed" in line, line


def test_a_run_saved_before_the_digest_is_refused_in_one_line_when_its_source_changed(trained, tmp_path):
    """A run saved before the digest existed is not checked against its folder, but a folder of
    another shape is still refused in one line naming the first weight that does not fit (was:
    export's traceback, resume's message cut off at ``Error(s) in loading state_dict for
    FolderLM:``)."""
    import torch

    _, conv, run = own_copy(trained, tmp_path)
    config = json.loads((run / "config.json").read_text())
    config.pop("init_from_digest", None)
    (run / "config.json").write_text(json.dumps(config))
    state_path = next((run / "checkpoints").glob("step-*")) / "state.pt"
    state = torch.load(state_path, weights_only=True)
    state["config"].pop("init_from_digest", None)
    state["config"]["init_from"] = str(conv)
    torch.save(state, state_path)
    shutil.rmtree(conv)
    save(convert(llama(hidden_size=64), heads=2, block_layers=1), conv)
    line = one_line(cli_in_process("train", "--resume", "--run-dir", run, "--set", "run.steps=5"), code=1)
    assert "its weights are not the model's (size mismatch for lm." in line and "was that folder replaced?" in line
    line = one_line(cli_in_process("export", run, tmp_path / "out"))
    assert "its weights do not fit the model of" in line and "size mismatch for" in line, line


def test_a_moved_source_is_given_its_new_place_with_source(trained, tmp_path):
    """The source folder moved: ``train --resume`` and ``export`` name the run's saved init_from
    and ``--source``; ``--source`` to a folder of another model is refused naming what differs;
    ``--source`` to the moved folder continues the run (every step logged once) and exports it,
    and the run records its new place."""
    source, conv, run = own_copy(trained, tmp_path)
    moved = tmp_path / "elsewhere"
    conv.rename(moved)
    for args in (("train", "--resume", "--run-dir", run, "--set", "run.steps=5"), ("export", run, tmp_path / "out")):
        line = one_line(cli_in_process(*args))
        assert f"the run's init_from ({run / 'config.json'}) {conv}: not a model folder" in line
        assert "If it moved, give its new place:" in line and "--source DIR" in line, line
    line = one_line(cli_in_process("train", "--resume", "--run-dir", run, "--source", source, "--set", "run.steps=5"))
    assert f"--source {source} does not hold the model" in line and "delta_heads 2 -> (none)" in line, line
    resumed = cli_in_process("train", "--resume", "--run-dir", run, "--source", moved, "--set", "run.steps=5")
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4, 5]
    assert json.loads((run / "config.json").read_text())["init_from"] == str(moved.resolve())
    exported = cli_in_process("export", run, tmp_path / "out")
    assert exported.returncode == 0, exported.stderr
    line = one_line(cli_in_process("train", "--run-dir", tmp_path / "new", "--source", moved, *TINY))
    assert "--source gives the new place of the folder a run started from, to continue it with --resume" in line


def compare_stopped(source: Path, out: Path) -> Path:
    """A comparison --from ``source`` of the control and one conversion, 4 steps each, stopped by
    SIGTERM at the conversion's step 2 (its checkpoint saved)."""
    from attnres.train import trainer

    real = trainer.train_step

    def step(run, index, logging):
        result = real(run, index, logging)
        if run.spec.residual_name(run.cfg).startswith("attnres_") and index + 1 == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "train_step", step)
        stopped = cli_in_process("compare", "--from", source, *TINY, "--set", "run.steps=4", "--designs", "source",
                                 "convert:heads=2:block_layers=1", "--out", out)
    assert stopped.returncode == 143, stopped.stderr
    return next(out.glob("compare-*"))


def test_compare_resume_names_the_comparisons_saved_source_and_the_way_on(trained, tmp_path):
    """A stopped comparison --from a folder, its source moved (was: refused naming ``--from
    DIR``, which the command was not given, and ``--from`` refused with ``--resume``): the
    comparison's saved source is named, with ``--source``; given the moved folder it finishes,
    and compare.json records the new place. Its source changed instead: refused naming what."""
    source = tmp_path / "llama"
    shutil.copytree(trained / "llama", source)
    root = compare_stopped(source, tmp_path / "out")
    moved = tmp_path / "moved"
    source.rename(moved)
    line = one_line(cli_in_process("compare", "--resume", root))
    assert f"the comparison's source (init_from in {root / 'compare.json'}) {source}: not a model folder" in line
    assert f"attnres compare --resume {root} --source DIR" in line and "--from " + str(source) not in line, line
    config = json.loads((moved / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (moved / "config.json").write_text(json.dumps(config))
    line = one_line(cli_in_process("compare", "--resume", root, "--source", moved))
    assert f"--source {moved} does not hold the model" in line and "rms_norm_eps 1e-06 -> 0.001" in line, line
    config["rms_norm_eps"] = 1e-6
    (moved / "config.json").write_text(json.dumps(config))
    resumed = cli_in_process("compare", "--resume", root, "--source", moved)
    assert resumed.returncode == 0, resumed.stderr
    index = json.loads((root / "compare.json").read_text())
    assert index["complete"] and index["init_from"] == index["config"]["init_from"] == str(moved)
    assert [r["step"] for r in rows(root / "convert+heads=2+block_layers=1")] == [1, 2, 3, 4]
