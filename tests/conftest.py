import os

# The Triton kernels run on CPU tensors through Triton's interpreter; the flag must be set before
# the kernels are defined (at import of attnres.ops.backends.triton).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from attnres import ModelConfig, Transformer  # noqa: E402

# Each pytest-xdist worker (``make test`` runs two) computes on one thread: two workers of two
# threads each on two cores would oversubscribe them. Processes the tests start keep the default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Every design, with the options that make it non-trivial at tiny size.
DESIGNS = {
    "prenorm": dict(residual="prenorm"),
    "full": dict(residual="full"),
    "block": dict(residual="block", block_size=3),
    "mhar": dict(residual="block", block_size=3, heads=4),
    "mhar-uneven": dict(residual="block", block_sizes="uneven", heads=2),  # sizes (1, M - 3, 2)
    "delta": dict(residual="delta", block_size=2, heads=2),
    "hc": dict(residual="hc", streams=3),
    "mhc": dict(residual="mhc", streams=3),
    "gr": dict(residual="gr", streams=3),
    "full-input-query": dict(residual="full", query="input"),
    "block-sigmoid-nokeynorm": dict(residual="block", num_blocks=2, score="sigmoid", key_norm=False),
    "full-learned": dict(residual="full", mixing="learned", heads=2),
    "full-window": dict(residual="full", window=2),
    "denseformer": dict(residual="denseformer"),
}
#: the designs a decode pass runs on a ``Decoder`` (streams/decode.py) where the backend decodes;
#: the others run it on the stream itself
DECODED = [d for d, o in DESIGNS.items() if o["residual"] in ("full", "block", "delta")
           and d not in ("full-input-query", "full-learned", "full-window")]
#: the designs without a routing backend to choose (``backend`` is not their option, or learned
#: mixing's plain PyTorch ops)
NO_BACKEND = ("prenorm", "denseformer", "full-learned")


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64)
    base.update(overrides)
    if base.get("block_sizes") == "uneven":  # a short first block, a long one, a last of two
        base["block_sizes"] = (1, 2 * base["n_layers"] - 3, 2)
    return ModelConfig(**base)


def tiny_model(design: str, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_config(**DESIGNS[design], **overrides))


def randomize_stream(model: Transformer, seed: int = 1, scale: float = 0.3) -> None:
    """Move every stream parameter away from its init so that invariants are tested off the
    trivial point (zero queries, unit gains, zero projections)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.stream.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)


@pytest.fixture(params=list(DESIGNS))
def design(request):
    return request.param


def cli_in_process(*args):
    """``attnres ARGS`` run in the test's process (a fresh interpreter spends seconds on its
    imports): its exit code and what it printed."""
    import contextlib
    import io
    import types

    from attnres.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exit_:  # argparse's refusals
            code = exit_.code
    return types.SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=err.getvalue())


def load_study(name: str):
    """The script ``studies/NAME.py`` as a module (the studies are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "studies" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log_rows(run_dir):
    """A run's logged rows (``metrics.jsonl``) without their timing field, which follows the
    machine's load."""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]
