"""Token shards: a Hugging Face dataset streamed and tokenized into the cache; token folders read back.

``data.source=hf:NAME[:CONFIG]`` (NAME a dataset on the Hub, or a local folder of data files as
``datasets.load_dataset`` reads one) is streamed, never loaded whole, and tokenized with the
run's tokenizer up to ``data.max_train_tokens`` into a folder of the cache::

    cache_dir()/shards/<NAME--CONFIG>-<key>/
        train.bin       token ids, uint16 (uint32 for a vocabulary past 65,536 ids)
        val.bin
        shards.json     what they are (``SHARDS_JSON``): dataset, revision, tokenizer, counts, digest
        bpe-*.json      with data.tokenizer=bpe: the tokenizer, trained on the first 20 MB streamed

The key hashes what decides the tokens: the dataset (a local folder's by its path and its files'
names, sizes and modification times), its config, the tokenizer, the token caps and
``data.val_fraction``; a Hub dataset's leaves out its revision, so that shards once made are read
again offline (the JSON records the commit; delete the folder to make them from a newer one). A
second run with the same settings tokenizes nothing. The folder is built in a temporary folder
renamed into place, under a lock: a second process waits for the first's shards. Each document
is followed by a newline. Validation is the dataset's ``validation`` split, else the documents
whose text hashes below ``data.val_fraction`` (``is_validation``: the same on every machine), up
to ``data.max_val_tokens`` (by default the ``val_fraction`` share of all tokens).

``--data FOLDER`` reads such a folder in the vocabulary and tokenizer its JSON names (the default
``data.tokenizer=byte`` takes the folder's; ``bpe`` or ``model`` must be it); a folder without the
JSON is read as nanoGPT writes one (uint16 ids, the model's vocabulary, bytes).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

import numpy as np

from ..cache import cache_dir
from .corpus import Corpus, kind_of, train_bpe
from .frozen_corpus import is_validation

SHARDS_JSON = "shards.json"
FORMAT = 1  # shards.json's layout; a change of it changes every key
BPE_SAMPLE_BYTES = 20_000_000  # the training text a BPE is trained on (as data.train_bpe reads it)
_BATCH = 256  # documents tokenized together (a BPE encodes a batch on all cores)
_TOKENIZERS = ("byte", "bpe", "model")


# -- token files -----------------------------------------------------------------------------

def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest of uint16 and uint32 that holds every id below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def token_file_corpus(folder: Path, vocab_size: int, dtype=np.uint16, check_ids: bool = True):
    """``train.bin`` and ``val.bin`` of ``folder``: token ids of ``dtype`` (nanoGPT's uint16 by
    default), memory-mapped; with ``check_ids``, every id checked to lie below ``vocab_size``
    (a folder with ``shards.json`` was checked as it was written)."""
    dtype = np.dtype(dtype)
    kind = f"{dtype.name} token ids, {dtype.itemsize} bytes each"
    out = []
    for name in ("train.bin", "val.bin"):
        path = folder / name
        if not path.exists():
            raise ValueError(f"token folder {folder} lacks {name}")
        if not path.is_file():
            raise ValueError(f"{path} is {'a folder' if path.is_dir() else kind_of(path)}, not a file of "
                             f"{dtype.name} tokens")
        size = path.stat().st_size
        if size == 0:
            raise ValueError(f"{path} is empty: a token file holds {kind}")
        if size % dtype.itemsize:
            odd = "an odd number" if dtype.itemsize == 2 else f"not a multiple of {dtype.itemsize}"
            raise ValueError(f"{path} holds {size} bytes, {odd}: a token file holds {kind}; was it cut short?")
        tokens = np.memmap(path, dtype=dtype, mode="r")
        if check_ids and len(tokens) and int(tokens.max()) >= vocab_size:
            raise ValueError(
                f"{path} holds token id {int(tokens.max())}, outside the model's vocabulary [0, {vocab_size})"
            )
        out.append(tokens)
    return out[0], out[1]


def read_shards_json(folder: Path) -> dict | None:
    """``folder``'s ``shards.json`` (None without one), its fields checked: what the folder's
    tokens are is read from it, so a damaged one is refused rather than guessed around."""
    path = folder / SHARDS_JSON
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not readable JSON ({err}); remove the folder to make its shards anew") from None
    fields = dict(tokenizer=str, vocab_size=int, dtype=str, tokens=dict, digest=str)
    bad = [k for k, t in fields.items() if not isinstance(meta, dict) or not isinstance(meta.get(k), t)]
    if bad or meta["dtype"] not in ("uint16", "uint32") or meta["tokenizer"] not in _TOKENIZERS:
        raise ValueError(f"{path} is not a token shards' description: it lacks or mis-states "
                         f"{', '.join(bad) or 'dtype or tokenizer'}; remove the folder to make its shards anew")
    return meta


def describe(meta: dict, folder: Path) -> str:
    """The corpus's description (``summary.json``'s ``data``) from the folder's JSON."""
    tok = {"byte": "byte tokens", "bpe": f"byte-level BPE ({meta['vocab_size']} tokens)",
           "model": f"the model's tokenizer ({meta.get('tokenizer_name') or meta['vocab_size']})"}[meta["tokenizer"]]
    name = meta.get("dataset", "?") + (f":{meta['config']}" if meta.get("config") else "")
    return f"Hugging Face dataset {name} at {meta.get('revision', '?')}, {tok}, token shards in {folder}"


def check_shards_vocabulary(folder: Path, vocab_size: int) -> None:
    """Refuse a model vocabulary other than the one ``folder``'s ``shards.json`` names (a folder
    without one is read in the model's vocabulary, so any size goes)."""
    meta = read_shards_json(folder)
    if meta is not None and meta["vocab_size"] != vocab_size:
        raise ValueError(f"--set model.vocab_size={vocab_size}: {folder} holds ids of a {meta['vocab_size']}-token "
                         f"vocabulary ({folder / SHARDS_JSON}), which the model takes as it is: leave "
                         f"model.vocab_size out, or give {meta['vocab_size']}")


def shard_folder_corpus(folder: Path, cfg, model_vocab_size: int) -> Corpus:
    """A folder of token files (``train.bin``, ``val.bin``) as a ``Corpus``: with a
    ``shards.json``, in its dtype, vocabulary and tokenizer (``data.tokenizer`` left at
    ``byte`` takes the folder's; ``bpe`` or ``model`` must be the folder's); without one,
    nanoGPT's uint16 ids in the model's vocabulary, read as bytes."""
    meta = read_shards_json(folder)
    if meta is None:
        if cfg.tokenizer != "byte":
            raise ValueError(f"{folder} holds pre-tokenized files; data.tokenizer={cfg.tokenizer!r} must stay 'byte'")
        train, val = token_file_corpus(folder, model_vocab_size)
        return Corpus(train[: cfg.max_train_tokens], val[: cfg.max_val_tokens], model_vocab_size,
                      f"token files in {folder}")
    if cfg.tokenizer not in ("byte", meta["tokenizer"]):
        raise ValueError(f"data.tokenizer={cfg.tokenizer!r} but the token shards in {folder} were made with "
                         f"data.tokenizer={meta['tokenizer']!r} ({folder / SHARDS_JSON}): leave data.tokenizer "
                         f"out to read them as they are, or make shards with {cfg.tokenizer!r}")
    train, val = token_file_corpus(folder, meta["vocab_size"], meta["dtype"], check_ids=False)
    for split, tokens in (("train", train), ("val", val)):
        if len(tokens) != meta["tokens"].get(split):
            raise ValueError(f"{folder / (split + '.bin')} holds {len(tokens)} tokens, {SHARDS_JSON} says "
                             f"{meta['tokens'].get(split)}: was it cut short? Remove the folder to make it anew")
    if meta["tokenizer"] == "bpe" and not (folder / str(meta.get("tokenizer_file"))).is_file():
        raise ValueError(f"{folder} was tokenized by a BPE it should hold as {meta.get('tokenizer_file')}, which it "
                         f"lacks")
    return Corpus(train[: cfg.max_train_tokens], val[: cfg.max_val_tokens], meta["vocab_size"],
                  describe(meta, folder))


# -- the dataset -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """``hf:NAME[:CONFIG]`` read: ``name`` (a local folder's absolute path), ``config`` (None:
    the dataset's default), ``local`` (whether NAME is a folder here)."""

    spec: str
    name: str
    config: str | None
    local: bool


def parse_source(spec: str) -> Source:
    """``spec`` (``hf:NAME[:CONFIG]``) as a ``Source``; a NAME that is a folder here is local."""
    name, _, config = spec[len("hf:"):].partition(":")
    if not name:
        raise ValueError(f"data.source={spec!r} names no dataset: expected hf:NAME[:CONFIG], e.g. "
                         f"hf:HuggingFaceFW/fineweb-edu:sample-10BT or hf:/path/to/folder/of/jsonl")
    path = Path(name).expanduser()
    local = path.is_dir()
    return Source(spec, str(path.resolve()) if local else name, config or None, local)


def folder_revision(folder: Path) -> str:
    """``files:`` and 16 hex digits of a hash of the data files of ``folder`` (hidden ones left
    out, as ``datasets`` leaves them): their names, sizes and modification times, so that a
    changed, added or removed file makes other shards."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith((".", "__")) for part in rel.parts):
            st = p.stat()
            h.update(f"{rel.as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return "files:" + h.hexdigest()[:16]


def no_network(source: Source, folder: Path, why: str) -> ValueError:
    """The refusal of a Hub dataset this machine cannot reach: where the shards would be, and
    how to make them elsewhere and bring them."""
    return ValueError(
        f"data.source={source.spec!r} streams {source.name} from the Hugging Face Hub, which this machine cannot "
        f"reach ({why}). Make its token shards on a machine with a network (`attnres shards` with this command's "
        f"--preset, --data and --set makes them there and prints their folder), then copy "
        f"that folder here to {folder}, or pass it as --data SHARDS_FOLDER")


def hub_revision(source: Source, folder: Path) -> str:
    """The Hub commit of ``source`` now (its shards record it, and the stream reads that
    commit); ``ValueError`` without a network (``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE`` read
    now: ``datasets`` reads them once, at its import) or for a name the Hub does not know."""
    flags = (os.environ.get(k, "") for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if any(v.strip().upper() in ("1", "ON", "YES", "TRUE") for v in flags):
        raise no_network(source, folder, "HF_DATASETS_OFFLINE or HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return HfApi().dataset_info(source.name).sha
    except GatedRepoError:
        raise ValueError(f"data.source={source.spec!r}: {source.name} is gated on the Hugging Face Hub: accept its "
                         f"terms on huggingface.co and log in (hf auth login, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"data.source={source.spec!r}: no dataset {source.name} on the Hugging Face Hub, and no "
                         f"folder {source.name} here (hf:NAME takes a Hub dataset or a local folder of data "
                         f"files)") from None
    except Exception as err:  # the HTTP client's own errors (no DNS, no route, a timeout, a 5xx)
        raise no_network(source, folder, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}") from None


def tokenizer_identity(cfg, tokenizer, model_vocab_size: int) -> dict:
    """What tells the run's tokenizer apart, for the key and the JSON: its kind, and for a model
    folder's tokenizer its name and a hash of its definition (a ``tokenizers`` JSON, else its vocabulary)."""
    if cfg.tokenizer not in _TOKENIZERS:
        raise ValueError(f"data.tokenizer={cfg.tokenizer!r} must be one of {_TOKENIZERS}")
    if cfg.tokenizer == "byte":
        return dict(tokenizer="byte")
    if cfg.tokenizer == "bpe":
        return dict(tokenizer="bpe", bpe_vocab_size=cfg.bpe_vocab_size)
    if tokenizer is None:
        raise ValueError("data.tokenizer='model' reads the tokenizer of the folder a run continues "
                         "(attnres train --from MODEL_DIR); none was given")
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's whole definition
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return dict(tokenizer="model", tokenizer_name=str(getattr(tokenizer, "name_or_path", "") or ""),
                tokenizer_sha256=hashlib.sha256(text.encode()).hexdigest()[:16], vocab_size=model_vocab_size)


def val_cap(cfg) -> int:
    """``data.max_val_tokens``, else the ``data.val_fraction`` share of all tokens."""
    share = max(1, round(cfg.max_train_tokens * cfg.val_fraction / (1 - cfg.val_fraction)))
    return share if cfg.max_val_tokens is None else cfg.max_val_tokens


def shards_folder(source: Source, cfg, identity: dict) -> Path:
    """Where the shards of ``source`` under ``cfg`` and the tokenizer ``identity`` live:
    ``cache_dir()/shards/<readable name>-<key>``."""
    what = dict(format=FORMAT, dataset=source.name, config=source.config, max_train_tokens=cfg.max_train_tokens,
                max_val_tokens=val_cap(cfg), val_fraction=cfg.val_fraction, **identity)
    if source.local:
        what["revision"] = folder_revision(Path(source.name))
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", (Path(source.name).name if source.local else source.name)
                      .replace("/", "--") + (f"--{source.config}" if source.config else "")).strip("-.")
    return cache_dir() / "shards" / f"{readable[:80]}-{key}"


def text_column(split) -> str:
    """The column of ``split`` that holds the text: ``text``, else its first string column."""
    features = split.features or {}
    if not features or "text" in features:  # unknown columns: the rows say (``documents``)
        return "text"
    strings = [k for k, v in features.items() if getattr(v, "dtype", None) in ("string", "large_string")]
    if not strings:
        raise ValueError(f"the dataset has no text column: its columns are {sorted(features)}; hf: sources read "
                         f"the column 'text', else the first column of strings")
    return strings[0]


def documents(split, column: str):
    """The text of each row of the streamed ``split``, in its order (empty rows left out)."""
    if split.features:
        split = split.select_columns([column])  # a Parquet stream then reads that column alone
    for row in split:
        text = row.get(column)
        if not isinstance(text, str) and (text is not None or column not in row):
            raise ValueError(f"the dataset's column {column!r} holds {type(text).__name__}, not text (its columns: "
                             f"{sorted(row)}; hf: sources read 'text', else the first column of strings)")
        if text:
            yield text


# -- tokenizing ------------------------------------------------------------------------------

class TokenFile:
    """A ``.bin`` being written: ids appended up to ``cap``, checked against the vocabulary."""

    def __init__(self, path: Path, cap: int, vocab_size: int, dtype: np.dtype, bar):
        self.file, self.cap, self.vocab_size, self.dtype, self.bar = open(path, "wb"), cap, vocab_size, dtype, bar
        self.count = self.documents = 0

    @property
    def full(self) -> bool:
        return self.count >= self.cap

    def add(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.int64)[: self.cap - self.count]
        if len(ids) and not 0 <= ids.min() <= ids.max() < self.vocab_size:  # a cast would wrap it silently
            raise ValueError(f"the tokenizer gave token ids in [{ids.min()}, {ids.max()}], outside its vocabulary "
                             f"[0, {self.vocab_size})")
        self.file.write(ids.astype(self.dtype).tobytes())
        self.count += len(ids)
        self.documents += 1
        self.bar.update(len(ids))


def encoder(kind: str, tok):
    """A function from a list of documents to their token ids (each document and a newline)."""
    if kind == "byte":
        return lambda docs: [np.frombuffer((d + "\n").encode(), np.uint8) for d in docs]
    if kind == "bpe":
        return lambda docs: [e.ids for e in tok.encode_batch([d + "\n" for d in docs])]
    return lambda docs: [tok.encode(d + "\n", add_special_tokens=False) for d in docs]


def fill(docs, encode, train: TokenFile, val: TokenFile | None, val_fraction: float) -> None:
    """Tokenize ``docs`` into ``train`` until it is full; with ``val`` (no validation split), a
    document hashed to validation (``is_validation``) goes there instead, while it has room."""
    while not train.full:
        batch = list(islice(docs, _BATCH))
        if not batch:
            return
        pairs = [(d, val if val is not None and is_validation(d, val_fraction) else train) for d in batch]
        pairs = [(d, out) for d, out in pairs if not out.full]  # a full file's documents are not tokenized
        for (_, out), ids in zip(pairs, encode([d for d, _ in pairs])):
            if not out.full:
                out.add(ids)


def bpe_sample(docs, val_split: bool, val_fraction: float) -> tuple[list[str], bytes]:
    """The first documents streamed, until the training ones hold ``BPE_SAMPLE_BYTES`` of text,
    and that text (joined as the shards join it) for the BPE to be trained on."""
    head, sample, size = [], [], 0
    for d in docs:
        head.append(d)
        if val_split or not is_validation(d, val_fraction):
            sample.append(d)
            size += len(d.encode()) + 1
            if size >= BPE_SAMPLE_BYTES:
                break
    return head, "".join(d + "\n" for d in sample).encode()[:BPE_SAMPLE_BYTES]


def run_tokenizer(kind: str, train_docs, val_split: bool, cfg, key: str, tmp: Path, tokenizer, model_vocab_size: int):
    """``(tokenizer, vocabulary, its file, train_docs)``: for ``bpe``, one trained on the first
    training text streamed and saved in ``tmp`` (``train_docs`` then starts again with the
    documents read for it); else the bytes (256), or the model's tokenizer and vocabulary."""
    if kind == "byte":
        return None, 256, None, train_docs
    if kind == "model":
        return tokenizer, model_vocab_size, None, train_docs
    head, sample = bpe_sample(train_docs, val_split, cfg.val_fraction)
    tok, path = train_bpe(np.frombuffer(sample, np.uint8), cfg.bpe_vocab_size, key, tmp)
    return tok, tok.get_vocab_size(), path.name, chain(head, train_docs)


def tokenize_into(tmp: Path, key: str, source: Source, revision: str, cfg, identity: dict, tokenizer,
                  model_vocab_size: int) -> dict:
    """Stream ``source`` at ``revision`` and write its shards into ``tmp`` (a BPE named by the
    shards' ``key``); returns their JSON, written last: its presence says the folder is whole."""
    import datasets
    from tqdm.auto import tqdm

    streams = datasets.load_dataset(source.name, source.config, streaming=True,
                                    revision=None if source.local else revision)
    if "train" not in streams:
        raise ValueError(f"data.source={source.spec!r} has no 'train' split: its splits are {sorted(streams)}")
    column, val_split = text_column(streams["train"]), "validation" in streams
    tok, vocab, tok_file, train_docs = run_tokenizer(identity["tokenizer"], documents(streams["train"], column),
                                                     val_split, cfg, key, tmp, tokenizer, model_vocab_size)
    dtype, encode, started = token_dtype(vocab), encoder(identity["tokenizer"], tok), time.perf_counter()
    with tqdm(total=cfg.max_train_tokens + val_cap(cfg), unit="tok", unit_scale=True, disable=None,
              desc=f"tokenizing {source.spec}", dynamic_ncols=True, leave=False) as bar:
        train = TokenFile(tmp / "train.bin", cfg.max_train_tokens, vocab, dtype, bar)
        val = TokenFile(tmp / "val.bin", val_cap(cfg), vocab, dtype, bar)
        with train.file, val.file:
            fill(train_docs, encode, train, None if val_split else val, cfg.val_fraction)
            if val_split:
                fill(documents(streams["validation"], column), encode, val, None, cfg.val_fraction)
    seconds = time.perf_counter() - started
    check_counts(source, cfg, train, val, val_split)
    say(f"data: tokenized {train.count:,} training and {val.count:,} validation tokens of {source.spec} in "
        f"{seconds:.1f} s ({(train.count + val.count) / max(seconds, 1e-9):,.0f} tokens/s)"
        + ("" if train.full else f"; the dataset ended before data.max_train_tokens={cfg.max_train_tokens:,}"))
    meta = dict(format=FORMAT, source=source.spec, dataset=source.name, config=source.config, revision=revision,
                column=column, validation="the validation split" if val_split else
                f"documents hashed below data.val_fraction={cfg.val_fraction}", **identity)
    meta.update(vocab_size=vocab, dtype=dtype.name, tokenizer_file=tok_file,
                tokens=dict(train=train.count, val=val.count), documents=dict(train=train.documents, val=val.documents),
                max_train_tokens=cfg.max_train_tokens, max_val_tokens=val_cap(cfg), val_fraction=cfg.val_fraction,
                datasets_version=datasets.__version__)
    read_back = Corpus(*token_file_corpus(tmp, vocab, dtype, check_ids=False), vocab, "")
    meta["digest"] = read_back.digest()  # what a run that reads these shards records as data_sha256
    (tmp / SHARDS_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def check_counts(source: Source, cfg, train: TokenFile, val: TokenFile, val_split: bool) -> None:
    """Both splits hold tokens: an empty one would be refused each time the shards are read."""
    if not train.count:
        raise ValueError(f"data.source={source.spec!r} streamed no text for training (its 'train' split is empty)")
    if not val.count:
        why = "its validation split holds no text" if val_split else (
            f"none of its {train.documents} documents read hashed below data.val_fraction={cfg.val_fraction}")
        raise ValueError(f"data.source={source.spec!r} gave no validation tokens ({why}): raise data.val_fraction, "
                         f"or give the dataset a validation split with text")


def say(line: str) -> None:
    """One line on stderr, from the job's first process only."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def build_once(folder: Path, build) -> bool:
    """``build(tmp)`` into a temporary folder renamed to ``folder``, unless ``folder`` is there;
    under a lock, so that a second process waits for the first's shards instead of making its
    own. Returns whether this process built it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"data: waiting for another process making the same token shards ({folder})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / SHARDS_JSON).is_file():
            return False
        if folder.exists():
            raise ValueError(f"{folder} exists without its {SHARDS_JSON}: remove it to make the shards anew")
        for stale in folder.parent.glob(f"{folder.name}.tmp-*"):  # a killed build's; the lock says none runs
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp-", dir=folder.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp's is 0o700: the cache's other users read the shards too
            try:
                os.rename(tmp, folder)
            except OSError:  # a process the lock does not bind (on a network filesystem) was first
                if not (folder / SHARDS_JSON).is_file():
                    raise
                return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def hf_shards(cfg, model_vocab_size: int, tokenizer=None) -> Path:
    """The folder of the token shards ``cfg`` (a ``DataConfig`` with ``source=hf:...``) names,
    made by streaming the dataset unless the cache holds it."""
    from .validate import check_hf_source

    check_hf_source(cfg)
    try:
        import datasets  # noqa: F401
    except ImportError:  # the training extra's; a plain install lacks it
        raise ValueError(f"data.source={cfg.source!r} needs the 'datasets' package: pip install datasets") from None
    source = parse_source(cfg.source)
    identity = tokenizer_identity(cfg, tokenizer, model_vocab_size)
    folder = shards_folder(source, cfg, identity)
    if (folder / SHARDS_JSON).is_file():
        say(f"data: reading the token shards of {source.spec} from {folder} (made before; nothing to tokenize)")
        return folder
    revision = folder_revision(Path(source.name)) if source.local else hub_revision(source, folder)

    def build(tmp: Path) -> None:
        say(f"data: tokenizing {source.spec} at {revision} into {folder}")
        tokenize_into(tmp, folder.name.rpartition("-")[2], source, revision, cfg, identity, tokenizer, model_vocab_size)

    if not build_once(folder, build):
        say(f"data: reading the token shards of {source.spec} from {folder} (made by another process)")
    return folder


def hf_corpus(cfg, model_vocab_size: int, tokenizer=None, bpe_dir: Path | None = None) -> Corpus:
    """``data.source=hf:NAME[:CONFIG]`` as a ``Corpus`` read from its token shards
    (``hf_shards``), so that the run that made them and every later one read the same arrays
    and record the same digest. ``bpe_dir`` is unused: a BPE lives with its shards."""
    return shard_folder_corpus(hf_shards(cfg, model_vocab_size, tokenizer), cfg, model_vocab_size)
