"""What a new user reads when a setting does nothing or a folder is the wrong kind: a window
that holds every source, the default ``--block-layers`` that does not fit, a Hugging Face folder
given where a run is read (and a run where a model folder is served), a tokenizer whose ids do
not fit a model, and a context too long for the machine, each named as the cause."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import cli_in_process

QUIET = ["--set", "run.progress=false", "--set", "run.tensorboard=false"]
TINY = ["--preset", "tiny", *QUIET]


def one_line(proc, code=2) -> str:
    """The one error line of a refused command (no traceback; transformers' progress bars aside)."""
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith(("Loading weights", "\r"))]
    assert proc.returncode == code and len(lines) == 1 and "error" in lines[0], proc.stderr
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["train", "--set", "model.residual=full", "--set", "model.window=4"],
     "--set model.window: window=4 does nothing with 4 sublayers (model.n_layers=2, two each)"),
    (["train", "--set", "model.residual=full", "--set", "model.window=3", "--set", "model.window_output=all"],
     "window=3 does nothing with 4 sublayers"),
    (["compare", "--designs", "prenorm", "full:window=4"], "design 'full:window=4': window=4 does nothing"),
    (["compare", "--designs", "prenorm", "full", "--set", "model.window=9"], "design 'full': window=9 does nothing"),
])
def test_a_window_that_holds_every_source_is_refused(tmp_path, args, message):
    """A Full window of at least the sublayers (at least one fewer when the output reads every
    source) reads what Full reads (was: run as a "window" that does nothing): refused naming
    the sublayers and what would act; a window below them runs."""
    line = one_line(cli_in_process(*args, *TINY, "--run-dir" if args[0] == "train" else "--out", tmp_path / "out"))
    assert message in line and "give a window below" in line, line
    assert not (tmp_path / "out").exists()
    from attnres.train.config import apply_overrides, tiny
    from attnres.train.validate import window_problem

    assert window_problem(apply_overrides(tiny(), ["model.residual=full", "model.window=3"]).model) is None


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """Two tiny Llamas of 128 tokens: one without a tokenizer, one saved with the 256-token byte
    tokenizer; and a text of non-ASCII letters (bytes past 127)."""
    import torch
    import transformers

    from attnres.hf import byte_tokenizer

    root = tmp_path_factory.mktemp("vocab")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "bare")
    model.save_pretrained(root / "bytes")
    byte_tokenizer().save_pretrained(root / "bytes")
    (root / "text.txt").write_text("héllo wörld, ça va? " * 3000)
    return root


@pytest.mark.parametrize("folder, extra, message", [
    ("bare", [], "the data's bytes (data.tokenizer='byte') reach id 195, and the model in {f} embeds 128 tokens, "
                 "fewer than the 256 bytes; the folder holds no tokenizer of its own"),
    ("bytes", [], "the folder's own tokenizer (data.tokenizer='model', 256 tokens) gives ids up to 195, and the model "
                  "in {f} embeds 128 tokens: the tokenizer saved in the folder is not its model's"),
    ("bytes", ["--set", "data.tokenizer=byte"], "the folder's own tokenizer (256 tokens) does not fit it either"),
])
def test_a_tokenizer_whose_ids_pass_the_models_vocabulary_is_named(small_vocab, tmp_path, folder, extra, message):
    """The data's ids pass a folder model's 128-token embedding (was: "use the folder's own
    tokenizer (data.tokenizer='model')" for a folder that has none, or whose tokenizer is the one
    that gave them): the message names the tokenizer that made them and what would fit."""
    source = small_vocab / folder
    line = one_line(cli_in_process("train", "--from", source, *TINY, *extra, "--data", small_vocab / "text.txt",
                                   "--run-dir", tmp_path / "run"))
    assert message.format(f=source.resolve()) in line, line
    assert not (tmp_path / "run").exists()


def test_generate_names_the_token_files_a_run_read(tmp_path):
    """``generate`` of a run on token files of 1000 ids (was: ``bytes must be in range(0,
    256)``): refused naming the vocabulary and where its ids came from."""
    data = tmp_path / "tokens"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name, size in (("train.bin", 50_000), ("val.bin", 5_000)):
        rng.integers(0, 1000, size).astype(np.uint16).tofile(data / name)
    run = tmp_path / "run"
    done = cli_in_process("train", *TINY, "--set", "run.steps=2", "--set", "model.vocab_size=1000", "--data", data,
                          "--run-dir", run)
    assert done.returncode == 0, done.stderr
    line = one_line(cli_in_process("generate", run, "--max-new-tokens", "4"))
    assert f"this run read token ids of a 1000-token vocabulary from {data}" in line, line


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama of 2 layers and width 36 (two heads of 18), saved with the byte tokenizer."""
    import torch
    import transformers

    from attnres.hf import byte_tokenizer

    folder = tmp_path_factory.mktemp("llama") / "llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=36, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("args, message", [
    (["--heads", "2"], "block_layers=4 must be an integer in [1, 2] (the number of layers) or a list of layers per "
                       "block (block_layers=4 is the default, and this model has 2 layers: give a number of layers per "
                       "block in [1, 2]"),
    (["--block-layers", "1"], "heads=8 must be a positive integer dividing hidden_size=36 (heads=8 is the default; "
                              "this model takes 1, 2, 3, 4, 6, 9, 12, 18, 36)"),
    (["--heads", "2", "--block-layers", "3"], "block_layers=3 must be an integer in [1, 2] (the number of layers) or a "
                                              "list of layers per block"),
])
def test_a_default_routing_option_that_does_not_fit_says_it_is_the_default(llama, tmp_path, args, message):
    """``convert`` without ``--block-layers`` (or ``--heads``) on a model its default does not
    fit (was: ``block_layers=4 must be ...``, an option the user never gave): says it is the
    default and what fits; a value given is refused as before, without the note."""
    line = one_line(cli_in_process("convert", llama, tmp_path / "out", *args))
    assert message in line and (("the default" in line) == (len(args) == 2)), line
    assert not (tmp_path / "out").exists()


def test_compare_from_says_when_its_default_conversion_does_not_fit(llama, tmp_path):
    """``compare --from`` with its default designs (``source convert``) on a model of 2 layers:
    the conversion's default block_layers is named as the default."""
    line = one_line(cli_in_process("compare", "--from", llama, *TINY, "--out", tmp_path / "out"))
    assert "design 'convert': heads=8 must be a positive integer dividing hidden_size=36 (heads=8 is the default" in line


@pytest.mark.parametrize("command", ["generate", "export", "resume"])
def test_a_hugging_face_folder_given_for_a_run_is_named_so(llama, tmp_path, command):
    """``generate``, ``export`` and ``train --resume`` of a Hugging Face model folder (was:
    ``config.json: not a valid attnres training config: expected an object with the sections
    model, data, optim and run``): named a Hugging Face model folder, with what takes it."""
    args = {"generate": ["generate", llama], "export": ["export", llama, tmp_path / "out"],
            "resume": ["train", "--resume", "--run-dir", llama]}[command]
    line = one_line(cli_in_process(*args))
    assert f"{llama} is a Hugging Face model folder (model_type='llama'), not a training run: `attnres train --from" \
        in line, line
    assert not (tmp_path / "out").exists()


def test_serving_a_run_folder_says_export_it_first(tmp_path):
    """``attnres serve`` of a training run's folder (was: "config.json declares
    architectures=None; one of [...] is served"): export it first."""
    run = tmp_path / "run"
    assert cli_in_process("train", *TINY, "--set", "run.steps=1", "--run-dir", run).returncode == 0
    line = one_line(cli_in_process("serve", run))
    assert f"{run} is a training run's folder: export it first (`attnres export {run} OUT`" in line, line


def test_a_context_too_long_for_the_machine_names_its_rotary_tables(tmp_path):
    """``--set model.max_seq_len=10000000000`` (was: "the model (43,168 parameters, ...) needs
    about 1.2e+03 GiB ...: choose smaller sizes", blaming the weights; at 1e8 a build of several
    times the tables that the kernel killed): named as the rotary tables' size, with the
    sequence the run reads."""
    line = one_line(cli_in_process("train", *TINY, "--set", "model.max_seq_len=10000000000", "--run-dir",
                                   tmp_path / "run"))
    assert "model.max_seq_len=10000000000: the model's buffers (its rotary tables, one row per position)" in line
    assert "lower model.max_seq_len (the run reads run.seq_len=32 tokens at a time)" in line, line
    assert not (tmp_path / "run").exists()


def test_the_rotary_tables_are_built_a_block_at_a_time_to_the_same_values():
    """The tables built in blocks of positions equal those built at once, bit for bit, across a
    block's edge; on the meta device nothing is computed."""
    import torch

    from attnres.model import ROPE_BLOCK, rope_tables

    length = ROPE_BLOCK + 7
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = rope_tables(16, length, 10000.0)
    assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())
    with torch.device("meta"):
        assert rope_tables(16, 10**12, 10000.0)[0].is_meta
    assert cos.shape == (length, 16)
