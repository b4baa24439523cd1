"""What each design's forward keeps for backward, against PreNorm: the bytes of the distinct
tensors autograd saves in one training forward (``torch.autograd.graph.saved_tensors_hooks``,
each storage counted once, parameters excluded), on the train-step model and batch.

The training step's measured peak growth (``train_step.py``) less this is what backward adds
on top of the saved activations at its peak, at the start of backward: on the CPU kernels, the
output routing's upstream gradient (each source's gradient is formed at its own backward,
``ops/source_ledger.py``); with gradients accumulated per read, one running sum per completed
source.

``--by-node``: the same storages (of 1 MiB or more) by the kind of autograd node that keeps
them, found by walking the graph back from the loss; a storage two nodes keep is counted once,
for the first node the walk reaches. Deterministic: no timing involved.

    python benchmarks/saved_for_backward.py
    python benchmarks/saved_for_backward.py --by-node --designs prenorm block delta
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_csv  # noqa: E402
from train_step import SIZES, VARIANTS  # noqa: E402

from attnres import ModelConfig, Transformer  # noqa: E402
from attnres.model import lm_loss  # noqa: E402

BATCH, SEQ = 8, 256
DESIGNS = ("prenorm", "block", "mhar", "full", "delta")


def training_forward(design: str) -> tuple[Transformer, torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SIZES, **VARIANTS[design]))
    x = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return model, x


def saved_mib(design: str) -> float:
    model, x = training_forward(design)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(x), x.roll(-1, 1))
    return sum(saved.values()) / 2**20


def _saved_by(node) -> list[torch.Tensor]:
    """The tensors ``node`` keeps: ATen nodes' ``_saved_*`` attributes, custom Functions'
    ``saved_tensors``."""
    found = []
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed, or not a tensor attribute
                continue
            found += [value] if isinstance(value, torch.Tensor) else [
                t for t in value if isinstance(t, torch.Tensor)] if isinstance(value, (tuple, list)) else []
    try:
        found += [t for t in node.saved_tensors if t is not None]
    except (AttributeError, RuntimeError):
        pass
    return found


def saved_by_node(design: str) -> dict[str, tuple[int, float]]:
    """Node kind -> (storages, MiB) of the storages of 1 MiB or more it keeps."""
    model, x = training_forward(design)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    loss = lm_loss(model(x), x.roll(-1, 1))
    owner: dict[int, tuple[int, str]] = {}
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for t in _saved_by(node):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params and storage.nbytes() >= 2**20:
                owner.setdefault(storage.data_ptr(), (storage.nbytes(), type(node).__name__))
        stack += [parent for parent, _ in node.next_functions]
    counts, mib = collections.Counter(), collections.Counter()
    for nbytes, kind in owner.values():
        counts[kind] += 1
        mib[kind] += nbytes / 2**20
    return {kind: (counts[kind], mib[kind]) for kind in counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=sorted(VARIANTS))
    parser.add_argument("--by-node", action="store_true", help="the saved storages by the autograd node keeping them")
    args = parser.parse_args()
    if args.by_node:
        found = {design: saved_by_node(design) for design in args.designs}
        kinds = sorted(set().union(*found.values()))
        rows = [dict(node=kind, **{design: "{}: {:.0f} MiB".format(*found[design].get(kind, (0, 0.0)))
                                   for design in args.designs}) for kind in kinds]
        print_table(rows, list(rows[0]))
        write_csv("saved_by_node", rows)
        return
    base = saved_mib("prenorm")
    rows = []
    for design in args.designs:
        mib = saved_mib(design)
        rows.append(dict(design=design, saved_mib=mib, over_prenorm_mib=mib - base))
    print_table(rows, list(rows[0]))
    write_csv("saved_for_backward", rows)


if __name__ == "__main__":
    main()
