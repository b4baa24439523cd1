"""The Hugging Face commands' refusals and file safety: ``attnres convert`` never harms its
source nor overwrites unasked; ``attnres serve`` checks the folder before starting vLLM.
(``attnres eval``'s refusals stay beside the lm-eval tests, which share one task index.)"""

import json
import re

import pytest

pytest.importorskip("transformers")

from tests.hf_cases import run_convert, saved_source  # noqa: E402


def test_convert_never_harms_its_source(tmp_path):
    """The source as destination, a folder inside it, a folder holding it: refused with a one-line
    error before any work, the source's files byte for byte as they were."""
    src, files = saved_source(tmp_path)
    for dst, message in [(src, "is the source model's folder or inside it"),
                         (src / "converted", "is the source model's folder or inside it"),
                         (tmp_path, "holds the source model")]:
        for extra in ([], ["--overwrite"]):
            proc = run_convert(src, dst, *extra)
            assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
            assert {p.name: p.read_bytes() for p in src.iterdir()} == files


def test_convert_refuses_a_folder_that_holds_files_unless_told(tmp_path):
    """A model folder is refused unless ``--overwrite``, which replaces it whole (no mix of two
    folders' files); a folder holding a file of somebody's is refused even with it."""
    src, _ = saved_source(tmp_path)
    dst = tmp_path / "dst"
    assert run_convert(src, dst).returncode == 0
    (dst / "model.safetensors").write_bytes(b"an older conversion")
    proc = run_convert(src, dst)
    assert proc.returncode == 2 and "exists and is not empty (a model folder); pass --overwrite" in proc.stderr
    proc = run_convert(src, dst, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert (dst / "model.safetensors").read_bytes() != b"an older conversion" and (dst / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
    (dst / "notes.txt").write_text("somebody's file")
    proc = run_convert(src, dst, "--overwrite")
    assert proc.returncode == 2 and "holds files export and convert do not write (notes.txt)" in proc.stderr
    assert (dst / "notes.txt").read_text() == "somebody's file"


def test_an_interrupted_conversion_leaves_the_destination_as_it_was(tmp_path, monkeypatch):
    import importlib

    convert_module = importlib.import_module("attnres.hf.convert")  # the module; attnres.hf.convert is the function

    src, _ = saved_source(tmp_path)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps({"model_type": "llama", "note": "the previous model"}))

    def failing_copy(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(convert_module.shutil, "copy2", failing_copy)  # fails after the weights are written
    with pytest.raises(OSError, match="disk full"):
        convert_module.convert_checkpoint(src, dst, heads=4, block_layers=2, overwrite=True)
    assert [p.name for p in dst.iterdir()] == ["config.json"]  # the lock file it held is gone too
    assert json.loads((dst / "config.json").read_text())["note"] == "the previous model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no half-written folder beside it


@pytest.mark.parametrize("args,message", [
    (["--heads", "0"], r"heads=0 must be a positive integer dividing hidden_size=64"),
    (["--heads", "3"], r"heads=3 must be a positive integer dividing hidden_size=64"),
    (["--block-layers", "0"], r"block_layers=0 must be an integer in \[1, 4\] \(the number of layers\) or a list "
                              r"of layers per block"),
    (["--block-layers", "1,2"], r"block_layers=\[1, 2\] must be positive layer counts summing to 4 \(the number of layers\)"),
    (["--block-layers", "4,0"], r"block_layers=\[4, 0\] must be positive layer counts summing to 4 \(the number of layers\)"),
])
def test_convert_refuses_bad_routing_options_before_loading_the_weights(tmp_path, capsys, monkeypatch, args, message):
    from attnres.cli import main

    src, _ = saved_source(tmp_path)
    capsys.readouterr()
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("the weights were loaded before the options were checked"))
    assert main(["convert", str(src), str(tmp_path / "dst"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"attnres convert: error: {message}", err), err
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("config,message", [
    (None, r"is not a model folder: .*config.json does not exist"),
    ({"architectures": ["GPT2LMHeadModel"]}, r"declares architecture 'GPT2LMHeadModel', which attnres does not serve"),
    ({"architectures": ["AttnResForCausalLM"]}, r"vLLM is not installed in this environment: `make serve-setup`"),
])
def test_serve_checks_the_folder_before_starting_vllm(tmp_path, capsys, config, message):
    """``attnres serve`` in the main environment (no vLLM): a folder it cannot serve is refused
    naming why; a served one is refused naming the serving environment."""
    from attnres.cli import main

    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["serve", str(tmp_path)]) == 2
    assert re.search(message, capsys.readouterr().err)
