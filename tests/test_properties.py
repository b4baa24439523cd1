"""Property-based tests (hypothesis): every routing backend and every design on random shapes
against an independent reference, values and gradients.

The default profile is derandomized (the same cases at every run, for CI); set
``ATTNRES_HYPOTHESIS=long`` to try many more. docs/RELIABILITY.md gives the counts.
"""

import json
import os
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attnres import build_stream, ops  # noqa: E402
from attnres.ops import BACKENDS, Request, depth_attention_naive  # noqa: E402

from .conftest import DESIGNS, tiny_model  # noqa: E402
from .backend_cases import assert_close_to_scale, stream_pair  # noqa: E402

PROFILES = {"ci": 50, "long": 1000}  # examples per test
for name, examples in PROFILES.items():
    settings.register_profile(name, max_examples=examples, derandomize=name == "ci", deadline=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("ATTNRES_HYPOTHESIS", "ci"))

TOL = {torch.float32: 2e-5, torch.float64: 1e-11}


def usable(backend, dtype, score, key_norm):
    return BACKENDS[backend].problem(Request("cpu", dtype, score, key_norm)) is None


@st.composite
def routing_cases(draw):
    backend = draw(st.sampled_from(list(BACKENDS)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    score = draw(st.sampled_from(["softmax", "sigmoid"]))
    key_norm = draw(st.booleans())
    heads = draw(st.integers(1, 4))
    dim = heads * draw(st.integers(2, 6))  # a width of 1 normalizes every key to +-1: fp32 noise only
    lead = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    return dict(backend=backend, dtype=dtype, score=score, key_norm=key_norm, heads=heads, dim=dim, lead=lead,
                sources=draw(st.integers(1, 6)), queries=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)))


@given(routing_cases())
def test_attend_and_merge_match_the_reference_on_random_shapes(case):
    """Phase 1 of several queries and the merge of a partial source equal the reference read
    over all the sources, forward and every gradient."""
    backend, dtype = case["backend"], case["dtype"]
    assume(usable(backend, dtype, case["score"], case["key_norm"]))
    fns = ops.backend(backend)
    g = torch.Generator().manual_seed(case["seed"])
    D, S, heads = case["dim"], case["queries"], case["heads"]
    sources = [(torch.randn(*case["lead"], D, generator=g, dtype=dtype) * (1 + j)).requires_grad_()
               for j in range(case["sources"] + 1)]  # the last one is the partial
    qs = (0.5 * torch.randn(S, D, generator=g, dtype=dtype)).requires_grad_()
    ks = (1 + 0.3 * torch.randn(S, D, generator=g, dtype=dtype)).requires_grad_() if case["key_norm"] else None
    kw = dict(heads=heads, score=case["score"], key_norm=case["key_norm"])
    outs, lse = fns.attend(qs, sources[:-1], ks, **kw)
    merged = [fns.merge(outs[s], lse[s], sources[-1], qs[s], None if ks is None else ks[s], **kw) for s in range(S)]
    refs = [depth_attention_naive(qs[s], sources, None if ks is None else ks[s], **kw) for s in range(S)]
    tol = TOL[dtype]
    for a, b in zip(merged, refs):
        assert_close_to_scale(a, b, tol)
    inputs = [qs, *sources] + ([ks] if ks is not None else [])
    cots = [torch.randn(r.shape, generator=g, dtype=dtype) for r in refs]
    fast = torch.autograd.grad(merged, inputs, cots, allow_unused=True)
    ref = torch.autograd.grad(refs, inputs, cots, allow_unused=True)
    for a, b in zip(fast, ref):
        assert_close_to_scale(a, b, 10 * tol)


@st.composite
def stream_cases(draw):
    kind = draw(st.sampled_from(["full", "block", "delta"]))
    backend = draw(st.sampled_from(list(BACKENDS)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    heads = draw(st.integers(1, 3))
    m = draw(st.integers(1, 7))
    options = dict(heads=heads, backend=backend)
    if kind != "full":
        if draw(st.booleans()):
            options["block_size"] = draw(st.integers(1, m))
        else:  # uneven blocks: a random composition of m
            cuts = sorted(draw(st.sets(st.integers(1, m - 1), max_size=m - 1))) if m > 1 else []
            options["block_sizes"] = tuple(b - a for a, b in zip([0, *cuts], [*cuts, m]))
        options["two_phase"] = draw(st.booleans())
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    return kind, options, m, dtype, heads * draw(st.integers(2, 4)), lead, draw(st.booleans())


@given(stream_cases())
def test_streams_match_the_per_sublayer_reference_on_random_shapes(case):
    """Every read and the output of Full, Block and Delta, on every backend, two-phase or not,
    with autograd on (values and gradients) or off (the inference path), equal the per-sublayer
    naive stream's."""
    kind, options, m, dtype, dim, lead, grad = case
    assume(usable(options["backend"], dtype, "softmax", True))
    fast, ref, weights, e = stream_pair(kind, options, m, dtype, seed=m, lead=lead, dim=dim)
    tol = TOL[dtype]
    results = []
    for stream in (fast, ref):
        e_ = e.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            state, reads = stream.init(e_), []
            for i, w in enumerate(weights):
                reads.append(stream.read(state, i))
                state = stream.write(state, i, torch.tanh(reads[-1] @ w))
            out = stream.output(state)
            grads = ()
            if grad:
                loss = sum((r * (k + 1)).sum() for k, r in enumerate(reads)) + (out**2).sum()
                grads = torch.autograd.grad(loss, [e_, *stream.parameters()])
        results.append((reads + [out], grads))
    for a, b in zip(results[0][0], results[1][0]):
        assert_close_to_scale(a.detach(), b.detach(), tol)
    for a, b in zip(results[0][1], results[1][1]):
        assert_close_to_scale(a, b, tol)


@given(design=st.sampled_from(list(DESIGNS)), batch=st.integers(1, 2), prompt=st.integers(1, 6),
       new=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_kv_cache_decoding_equals_the_full_forward_for_every_design(design, batch, prompt, new, seed):
    """Logits of a prompt and then one token at a time with the KV cache equal one forward over
    the whole sequence (the reference that needs no cache)."""
    model = tiny_model(design, seed=seed % 7).eval()
    x = torch.randint(0, 64, (batch, prompt + new), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(batch, prompt + new)
        steps = [model(x[:, :prompt], cache=cache, start_pos=0)]
        steps += [model(x[:, t:t + 1], cache=cache, start_pos=t) for t in range(prompt, prompt + new)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)


# -- the commands on generated settings and corrupted files (docs/RELIABILITY.md, "Run folders
# and files"): a one-line error or success, never a traceback, never a file changed that the
# command should not touch

SETTINGS = {  # field: values drawn (good ones and bad ones)
    "run.steps": ["1", "2", "0", "x"], "run.batch_size": ["2", "4", "3", "0"],
    "run.seq_len": ["8", "16", "65", "60000"], "run.grad_accum": ["1", "2", "3"],
    "model.dim": ["16", "32", "33", "48"], "model.n_heads": ["1", "2", "3"], "model.n_layers": ["1", "2", "0"],
    "model.residual": ["prenorm", "block", "full", "mhc", "bogus"], "model.block_size": ["1", "2", "99"],
    "model.vocab_size": ["256", "512"], "model.max_seq_len": ["16", "64", "60000"], "optim.lr": ["0.01", "nan", "-1"],
    "run.device": ["cpu", "meta", "cuda:3", "gpu"], "data.val_fraction": ["0.1", "0", "1.5"],
}
QUIET = ["--preset", "tiny", "--set", "run.steps=1", "--set", "run.progress=false",
         "--set", "run.tensorboard=false", "--set", "run.eval_batches=1", "--set", "run.eval_every=1"]


def _text_file(folder):
    path = Path(folder) / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(800)))
    return path


def _snapshot(folder):
    return {p: p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def _one_line_or_success(proc, command):
    if proc.returncode == 0:
        return True
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode in (1, 2) and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"attnres {command}: error"), proc.stderr
    return False


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(sorted(SETTINGS)), st.integers(0, 4), max_size=4))
def test_train_on_generated_settings_is_one_line_or_a_run(choice):
    """Any draw of settings: a run, or one line and no folder left behind."""
    import tempfile

    from .conftest import cli_in_process

    with tempfile.TemporaryDirectory() as tmp:
        data = _text_file(tmp)
        args = [a for key, k in sorted(choice.items())
                for a in ("--set", f"{key}={SETTINGS[key][k % len(SETTINGS[key])]}")]
        run = Path(tmp) / "run"
        proc = cli_in_process("train", *QUIET, "--data", data, *args, "--run-dir", run)
        if _one_line_or_success(proc, "train"):
            assert (run / "config.json").is_file() and (run / "summary.json").is_file()
        else:
            assert not run.exists(), sorted(p.name for p in run.iterdir())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tokenizer=st.sampled_from(["byte", "bpe"]), schedule=st.sampled_from(["cosine", "wsd", "constant"]),
       given=st.sets(st.sampled_from(["data.bpe_vocab_size=300", "optim.decay_fraction=0.5", "optim.min_lr_ratio=0.5"])),
       seed=st.sampled_from(["0", "top", "top+1", "100000000000000"]), steps=st.sampled_from([1, 1000]))
def test_settings_that_do_nothing_or_fail_later_are_refused_exactly(tokenizer, schedule, given, seed, steps):
    """Drawn combinations of a user's settings: refused, naming the setting, exactly when one
    acts only under a value it does not have or the seed's data seeds leave int64."""
    from attnres.train.config import apply_overrides, tiny
    from attnres.train.validate import check_given, check_run, max_seed

    top = max_seed(steps)
    seed_value = {"top": top, "top+1": top + 1}.get(seed, seed)
    assignments = [f"data.tokenizer={tokenizer}", f"optim.schedule={schedule}", f"run.seed={seed_value}",
                   f"run.steps={steps}", *sorted(given)]
    keys = {a.partition("=")[0] for a in given}
    expected = sorted(key for key, acts in (("data.bpe_vocab_size", tokenizer == "bpe"),
                                            ("optim.decay_fraction", schedule == "wsd"),
                                            ("optim.min_lr_ratio", schedule != "constant")) if key in keys and not acts)
    if int(seed_value) > top:
        expected = ["run.seed"]  # the checks of every value come before those of the given ones
    cfg = apply_overrides(tiny(), assignments)
    try:
        check_run(cfg)
        check_given(cfg, keys | {"data.tokenizer", "optim.schedule", "run.seed", "run.steps"})
    except ValueError as err:
        assert expected and any(key in str(err) for key in expected), (str(err), expected)
    else:
        assert not expected, expected


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from .conftest import cli_in_process

    folder = tmp_path_factory.mktemp("properties")
    run = folder / "run"
    proc = cli_in_process("train", *QUIET, "--data", _text_file(folder), "--set", "run.steps=2", "--run-dir", run)
    assert proc.returncode == 0, proc.stderr
    return run


RUN_FILES = ["config.json", "metrics.jsonl", "summary.json", "checkpoints/latest",
             "checkpoints/step-0000002/state.pt", "checkpoints/step-0000002/model.safetensors"]


def _corrupt(path, how, at, byte):
    data = path.read_bytes()
    cut = at % (len(data) + 1)
    if how == "truncate":
        path.write_bytes(data[:cut])
    elif how == "flip" and data:
        path.write_bytes(data[:cut % len(data)] + bytes([byte]) + data[cut % len(data) + 1:])
    elif how == "json":
        path.write_text(json.dumps([None, 1, "x", {}][at % 4]))
    else:
        path.unlink()


@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(file=st.sampled_from(RUN_FILES), how=st.sampled_from(["truncate", "flip", "json", "delete"]),
       at=st.integers(0, 2**20), byte=st.integers(0, 255), command=st.sampled_from(["generate", "resume"]))
def test_commands_on_corrupted_run_files_are_one_line_or_run(finished_run, file, how, at, byte, command):
    """A run's file truncated, with a byte changed, replaced by JSON of another type or deleted:
    ``generate`` and ``train --resume`` end in one line or succeed; a refusal changes no file."""
    import shutil
    import tempfile

    from .conftest import cli_in_process

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        shutil.copytree(finished_run, run)
        _corrupt(run / file, how, at, byte)
        before = _snapshot(run)
        if command == "generate":
            proc = cli_in_process("generate", run, "--max-new-tokens", "1")
            _one_line_or_success(proc, "generate")
            assert _snapshot(run) == before  # generate only reads
        else:
            proc = cli_in_process("train", "--run-dir", run, "--resume", "--set", "run.steps=3",
                                  "--set", "run.progress=false")
            if not _one_line_or_success(proc, "train"):
                assert _snapshot(run) == before
