"""A local lm-eval task of held-out text for models of the study's size: which of four spans of
bytes continues a passage (multiple choice, chance 25%).

Each item is a passage of ``--context`` bytes at a random place in the validation split (files
no model of the study trained on: the corpus, ``--data``, the study preset's by default, splits
by file), the true next ``--span`` bytes, and three spans of the same length from other random places of the split; a
model picks the span it gives the highest log-likelihood after the passage (lm-eval's ``acc``).
The continuation follows the passage with no delimiter: a byte-level model reads exactly the
bytes of the text. Items whose bytes are not UTF-8 text are drawn again.

    python studies/next_bytes_task.py OUT_DIR [--items 400] [--context 96] [--span 12] [--seed 0] [--data SOURCE]

writes ``OUT_DIR/next_bytes.yaml`` and ``OUT_DIR/next_bytes.jsonl``; evaluate with
``--tasks next_bytes --include-path OUT_DIR`` (``attnres eval``, ``attnres compare --from``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from attnres.train.config import DataConfig, study
from attnres.train.data import load_corpus

TASK = """task: next_bytes
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def text(data: np.ndarray, start: int, length: int) -> str | None:
    """The ``length`` bytes at ``start`` as text, or None when they are not UTF-8 (a character
    cut at either end)."""
    try:
        return bytes(data[start : start + length]).decode("utf-8")
    except UnicodeDecodeError:
        return None


def items(val: np.ndarray, n: int, context: int, span: int, seed: int) -> list[dict]:
    """``n`` items of the module's docstring, drawn with ``numpy``'s generator seeded ``seed``;
    the true span's place among the four choices drawn too."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        start = int(rng.integers(0, len(val) - context - span))
        passage, truth = text(val, start, context), text(val, start + context, span)
        others = [text(val, int(rng.integers(0, len(val) - span)), span) for _ in range(3)]
        if passage is None or truth is None or any(o is None or o == truth for o in others):
            continue
        label = int(rng.integers(0, 4))
        choices = [*others[:label], truth, *others[label:]]
        out.append({"context": passage, "choices": choices, "label": label})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--span", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", help="data.source whose validation split the items come from (default: the study "
                                       "preset's)")
    args = parser.parse_args(argv)
    data = study().data  # the study's validation split: the held-out files, its first 400,000 bytes
    if args.data:
        data.source = args.data
    corpus = load_corpus(DataConfig(**{**data.__dict__, "tokenizer": "byte"}), 256)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "next_bytes.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items(corpus.val, args.items, args.context,
                                                                      args.span, args.seed)))
    (args.out / "next_bytes.yaml").write_text(TASK.format(data=path.resolve()))
    print(args.out / "next_bytes.yaml")


if __name__ == "__main__":
    main()
