"""benchmarks/results/ holds the results files the docs cite, and the docs cite no file it lacks.

A citation, in README.md or docs/*.md, is the name of a results file written in backticks, bare
(`train_step.csv`, as the "Results file" column of docs/BENCHMARKS.md writes it) or under its
folder (`benchmarks/results/train_step.csv`, `results/train_step.csv`), or a
benchmarks/results/NAME.csv path written without backticks. A results file's name is lowercase:
letters, digits and `_ @ . + -` (a design, a revision, a size), so `NAME_against.csv` and
`_against.csv` are patterns, not citations. A script run with `--revisions` writes
`NAME_against.csv` beside `NAME.csv`; that twin of a cited file counts as cited.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

_NAME = r"[a-z0-9][a-z0-9_@.+-]*\.csv"
_BACKTICKED = re.compile(rf"`(?:benchmarks/results/|results/)?({_NAME})`")
_PATH = re.compile(rf"benchmarks/results/({_NAME})")


def cited_in(text: str) -> set[str]:
    """The results files a document's text cites, by file name."""
    return set(_BACKTICKED.findall(text)) | set(_PATH.findall(text))


def citing_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def citations() -> dict[str, list[str]]:
    """Each cited file name, with the documents that cite it."""
    where: dict[str, list[str]] = {}
    for doc in citing_docs():
        for name in cited_in(doc.read_text(encoding="utf-8")):
            where.setdefault(name, []).append(str(doc.relative_to(ROOT)))
    return where


def covered(name: str, cited: set[str]) -> bool:
    """Whether a file in the results folder is cited, or is the `_against.csv` twin of one."""
    if name in cited:
        return True
    return name.endswith("_against.csv") and name.removesuffix("_against.csv") + ".csv" in cited


def test_the_citation_rule():
    text = (
        "| Measurement | `train_step_head_logit@8a26037.csv` | T1 |\n"
        "(`results/demo_step.csv` and `benchmarks/results/stream_ops@b9de021.csv`), "
        "see benchmarks/results/serving.csv; writes `NAME_against.csv`, its `_against.csv` twin, "
        "`runs/demo/metrics.csv`, `python benchmarks/train_step.py --csv train_step`"
    )
    assert cited_in(text) == {
        "train_step_head_logit@8a26037.csv",
        "demo_step.csv",
        "stream_ops@b9de021.csv",
        "serving.csv",
    }
    assert covered("demo_step_against.csv", {"demo_step.csv"})
    assert covered("x@abc_paired_against.csv", {"x@abc_paired.csv"})
    assert not covered("demo_step_against.csv", {"other.csv"})
    assert not covered("demo_step.csv", {"demo_step_against.csv"})


def test_the_docs_cite_results_files():
    # a rule that matched nothing would pass both tests below
    assert len(citations()) >= 10


def test_every_cited_results_file_exists():
    missing = {name: docs for name, docs in citations().items() if not (RESULTS / name).is_file()}
    assert not missing, f"cited but not in benchmarks/results/: {missing}"


def test_every_results_file_is_cited():
    cited = set(citations())
    stray = sorted(
        p.name for p in RESULTS.iterdir() if p.is_file() and not covered(p.name, cited)
    )
    assert not stray, (
        "in benchmarks/results/ but cited in neither README.md nor docs/*.md "
        f"(cite them, or git rm them): {stray}"
    )
