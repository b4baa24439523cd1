"""The ``attnres`` command line: compare, sweep, train, generate, report, convert, export, eval,
serve, corpus, shards: the parser, start-up and ``main``; what each command does is in ``attnres/commands.py``.

It answers at once where it can: the parser, every help text and the refusal of a bad argument or
an unknown design or preset name need only ``attnres/names.py``, and PyTorch (seconds to load) is
imported only once a command runs. A Ctrl-C while it starts prints one line and exits 130
(``starting``); ``ATTNRES_PAUSE_AT`` (``pause_at``) lets a test stop start-up at a known point.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import re
import signal
import sys
import threading

from . import commands
from .architectures import titles
from .signals import pause_at
from .names import CONVERT_DEFAULTS, CORPUS_NAMES, DEFAULT_DESIGNS, DESIGNS, FOLDER_DESIGNS, PRESET_NAMES


def _block_layers(text: str):
    """``--block-layers``: one number (layers per block) or a comma list (layers in each block)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or a comma list of numbers") from None
    return values[0] if len(values) == 1 else values


def _preset_name(name: str) -> str:
    """``--preset``: one of ``PRESET_NAMES``, refused here as ``train/config.py``'s ``preset`` would."""
    if name not in PRESET_NAMES:
        raise argparse.ArgumentTypeError(f"unknown preset {name!r}; expected one of {sorted(PRESET_NAMES)}")
    return name


def _design_label(label: str) -> str:
    """``--designs`` and ``--baseline``: a design's label, ``name[:field=value:...]``. An unknown
    name is refused here, with the words of ``experiments/designs.py``'s ``parse_design``, which checks
    the rest (the options, and a name of characters no label may hold) once the command runs."""
    name = label.partition(":")[0]
    if re.fullmatch(r"\w+", name, re.ASCII) and name not in DESIGNS and name not in FOLDER_DESIGNS:
        raise argparse.ArgumentTypeError(f"design {label!r}: unknown design {name!r}; expected one of "
                                         f"{sorted(DESIGNS)}, optionally with options: name:field=value:... "
                                         f"(with --from MODEL_DIR: {' and '.join(FOLDER_DESIGNS)})")
    return label


def _add_config_args(p, default_preset, note=""):
    names = ", ".join(PRESET_NAMES[:-1]) + f" or {PRESET_NAMES[-1]}"
    p.add_argument("--preset", default=default_preset, type=_preset_name,
                   help=f"{names} (default: %(default)s{note})")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="override one config field, e.g. --set model.residual=block --set optim.lr=3e-4")
    p.add_argument("--data", help=f"a named corpus ({', '.join(CORPUS_NAMES)}), stdlib (this Python's standard "
                                  f"library), a text file or folder, a folder of token files (train.bin/val.bin), "
                                  f"or hf:NAME[:CONFIG] (default: {CORPUS_NAMES[0]})")


def _limit(text: str):
    """``--limit``: a number of examples per task (an integer) or a fraction of them in (0, 1),
    as lm-eval reads it; the integer's range is checked with the other arguments."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of examples per task (an integer >= 1) "
                                         f"nor a fraction of them in (0, 1)")
    return value


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="train several residual designs on the same data and write a report")
    _add_config_args(p, "demo", "; study: prenorm, block, mhar and full over seeds 0-5; ablations: the AttnRes "
                                "paper's ablation rows (docs/RESULTS.md) over seeds 0-2, at the study's size; regime: 20 "
                                "tokens per parameter at width 48, prenorm, block, mhar and full each at its own "
                                "learning rate, over seeds 4-15")
    p.add_argument("--designs", nargs="+", metavar="DESIGN", type=_design_label,
                   help=f"from {sorted(DESIGNS)}, each optionally with options of its own, name:field=value:..., "
                        f"e.g. full:norm_eps=1e-6 block:block_size=4 (default: the preset's, else "
                        f"{' '.join(DEFAULT_DESIGNS)})")
    p.add_argument("--seeds", nargs="+", type=int,
                   help="one run per design per seed; several give paired intervals (default: the preset's, else 0)")
    p.add_argument("--baseline", metavar="DESIGN", type=_design_label,
                   help="the design the others are compared with (default: prenorm when chosen, else the first)")
    p.add_argument("--out", default="runs", help="parent folder of the comparison (default: %(default)s)")
    _add_budgets(p)
    p.add_argument("--from", dest="init_from", metavar="MODEL_DIR",
                   help="compare a Hugging Face folder's model trained on as it is (the design 'source', the control) "
                        "with its Delta AttnRes conversions (convert, convert:heads=H:block_layers=L; default "
                        "designs: source convert)")
    p.add_argument("--shock-steps", type=int, default=100, metavar="K",
                   help="with --from: every one of the first K steps is logged and each conversion's loss compared "
                        "with the control's (default: %(default)s, or all steps when fewer)")
    p.add_argument("--tasks", nargs="+", metavar="TASK",
                   help="with --from: evaluate every run on these lm-eval tasks and pair each conversion's answers "
                        "with the control's, item by item (exact McNemar test per seed)")
    p.add_argument("--include-path", help="with --tasks: a folder of lm-eval task YAML files")
    p.add_argument("--limit", type=float, help="with --tasks: items per task (a count, or a fraction in (0, 1))")
    p.add_argument("--resume", metavar="COMPARISON_DIR",
                   help="continue a comparison that was stopped, where it stopped, with its own "
                        "settings (given alone: its finished runs are kept, the others continue "
                        "from their checkpoints)")
    _add_source(p, "--resume COMPARISON_DIR: the new place of the folder a comparison --from started from")
    _add_allow_mixed_data(p, "comparison")
    p.set_defaults(fn=commands.cmd_compare, loads=("attnres.experiments.comparison_run",))


def _add_source(p, what: str) -> None:
    p.add_argument("--source", metavar="DIR",
                   help=f"with {what} (moved since: its files must be the ones recorded, init_from_digest)")


def _add_allow_mixed_data(p, what: str) -> None:
    p.add_argument("--allow-mixed-data", action="store_true",
                   help=f"with --resume: continue a {what} whose runs read another corpus (data_sha256) than this "
                        f"machine reads now (refused without it: their paired differences would hold the data's)")


def _add_budgets(p) -> None:
    p.add_argument("--budgets", nargs="+", type=float, metavar="MULTIPLE",
                   help="the baseline also trains at these multiples of run.steps (1 first, ascending, e.g. 1 1.5 "
                        "2 3); the report gives each design's compute-equivalent multiplier")


def _add_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="one comparison per point of a ladder (e.g. depth 4, 8, 16, 32), summarized")
    p.add_argument("--over", action="append", metavar="SECTION.FIELD=V1,V2,...",
                   help="a field and its values, one point each; several --over are zipped by position "
                        "(--over model.dim=48,96 --over model.n_heads=2,4 is two points)")
    _add_config_args(p, "demo")
    p.add_argument("--designs", nargs="+", metavar="DESIGN", type=_design_label,
                   help=f"as compare's (default: the preset's, else {' '.join(DEFAULT_DESIGNS)})")
    p.add_argument("--seeds", nargs="+", type=int, help="as compare's (default: the preset's, else 0)")
    p.add_argument("--baseline", metavar="DESIGN", type=_design_label, help="as compare's")
    p.add_argument("--out", default="runs", help="parent folder of the sweep (default: %(default)s)")
    _add_budgets(p)
    p.add_argument("--resume", metavar="SWEEP_DIR",
                   help="continue a sweep that was stopped, with its own settings")
    _add_allow_mixed_data(p, "sweep")
    p.set_defaults(fn=commands.cmd_sweep, loads=("attnres.experiments.sweep",))


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train one model")
    _add_config_args(p, "small", "; regime: a prenorm, block, mhar or full model at the rate compare --preset "
                                 "regime gives it (8e-3, 5e-3, 3e-3, 2e-3), any other at 3e-3; --set optim.lr wins")
    p.add_argument("--run-dir", help="folder of the run (default: runs/<residual>-<timestamp>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start over in a --run-dir that holds a run (its files go)")
    p.add_argument("--from", dest="init_from", metavar="MODEL_DIR",
                   help="continue training the model of a Hugging Face folder (attnres convert or export, or a "
                        f"{titles()} folder); the preset gives optim, run and data")
    _add_source(p, "--resume: the new place of the folder the run started from (--from)")
    p.set_defaults(fn=commands.cmd_train, loads=("attnres.train.trainer",))


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample from a trained run with the KV cache")
    p.add_argument("run_dir")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to add (default: 200, or what the model's context has room for)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=commands.cmd_generate, loads=("attnres.train.checkpoint", "attnres.train.run_files"))


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="rebuild a comparison report from its saved artifacts")
    p.add_argument("run_dir")
    p.add_argument("--baseline", metavar="DESIGN", type=_design_label,
                   help="compare with this design (default: the comparison's)")
    p.set_defaults(fn=commands.cmd_report, loads=("attnres.analysis.report",))


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help=f"convert a local {titles()} model to Delta AttnRes",
                       description=f"Convert a local Hugging Face model folder of a source architecture "
                                   f"({titles()}) to Delta AttnRes, computing what the source computed.")
    p.add_argument("src", help="folder of the Hugging Face model")
    p.add_argument("dst", help="folder to write the converted model to")
    p.add_argument("--heads", type=int, default=CONVERT_DEFAULTS["heads"], help="depth-attention heads (default: %(default)s)")
    p.add_argument("--block-layers", type=_block_layers, default=CONVERT_DEFAULTS["block_layers"], metavar="N|N,N,...",
                   help="transformer layers per block, or a comma list of layers in each block "
                        "(uneven blocks, e.g. 2,2,3,1) (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace a destination folder that is not empty")
    p.set_defaults(fn=commands.cmd_convert, loads=("attnres.hf",))


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="write a training run's latest checkpoint as a Hugging Face folder")
    p.add_argument("run_dir", help="the run's folder (one process's checkpoints or a sharded run's)")
    p.add_argument("out", help="folder to write the model and its byte tokenizer to")
    p.add_argument("--overwrite", action="store_true", help="replace an output folder that is not empty")
    p.add_argument("--format", choices=("attnres", "llama"), default="attnres",
                   help="attnres's own classes (default), or a PreNorm run as a plain LlamaForCausalLM folder")
    _add_source(p, "a run trained --from a folder: the new place of that folder")
    p.set_defaults(fn=commands.cmd_export, loads=("attnres.hf.export",))


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a saved model with lm-evaluation-harness")
    p.add_argument("model_dir")
    p.add_argument("--tasks", nargs="+", required=True)
    p.add_argument("--include-path", help="folder of extra task YAML files")
    p.add_argument("--limit", type=_limit, default=None,
                   help="examples per task: a number, or a fraction in (0, 1) of each task's (default: all)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=1)
    # lm-eval and transformers load once the arguments and the folder are checked (cmd_eval)
    p.set_defaults(fn=commands.cmd_eval, loads=("attnres.files",))


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a model folder with vLLM's OpenAI-compatible server")
    p.add_argument("model_dir", help="an attnres export or attnres convert folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="memory for vLLM's KV cache (GiB)")
    p.set_defaults(fn=commands.cmd_serve, loads=("attnres.serving.server",))


def _add_corpus(sub) -> None:
    p = sub.add_parser("corpus", help="download (with pip, hashes required) and build a named corpus on this machine")
    p.add_argument("name", nargs="?", default=CORPUS_NAMES[0], choices=CORPUS_NAMES,
                   help="the corpus (default: %(default)s, the default data.source)")
    p.set_defaults(fn=commands.cmd_corpus, loads=("attnres.train.frozen_corpus",))


def _add_shards(sub) -> None:
    p = sub.add_parser("shards", help="stream an hf:NAME[:CONFIG] dataset into the token shards that `attnres train` "
                                      "with these settings reads; print their folder; train nothing")
    _add_config_args(p, "small")
    p.set_defaults(fn=commands.cmd_shards, loads=("attnres.train.hf_shards", "attnres.train.validate"))


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand. Each sets ``fn``, the function that runs it, and ``loads``,
    the modules it runs on, which ``main`` imports while the command line starts (``starting``)."""
    parser = argparse.ArgumentParser(prog="attnres", description="Attention Residuals: train, compare, report.")
    sub = parser.add_subparsers(dest="command")
    for add in (_add_compare, _add_sweep, _add_train, _add_generate, _add_report, _add_convert, _add_export, _add_eval,
                _add_serve, _add_corpus, _add_shards):
        add(sub)
    return parser


#: the points of start-up where ``ATTNRES_PAUSE_AT`` stops it, in order: before the parser, after
#: parsing, after the command's modules (PyTorch among them) loaded, as the command starts to run
PAUSE_POINTS = ("start", "parsed", "loaded", "running")


def _end_at_once(signum, frame) -> None:
    """SIGINT while the command line starts: one line, exit status 130, at once (``starting``)."""
    os.write(2, b"attnres: interrupted\n")
    os._exit(130)


@contextlib.contextmanager
def starting():
    """While the command line starts (its parser, then the modules of its command), SIGINT ends
    the process at once: one line, exit status 130. Nothing has been written yet that would need
    undoing, and a ``KeyboardInterrupt`` raised inside an extension's import (PyTorch's) can end
    in a traceback of dozens of lines or an abort (status 134) instead. The previous handler comes
    back afterwards: the command runs with Python's (``KeyboardInterrupt``, caught in ``main``),
    and a training's steps with the trainer's (a checkpoint, then 130). A SIGINT the process
    ignores (started in the background) stays ignored, and only the main thread can set handlers."""
    own = (threading.current_thread() is threading.main_thread()
           and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    previous = signal.signal(signal.SIGINT, _end_at_once) if own else None
    try:
        yield
    finally:
        if own:
            signal.signal(signal.SIGINT, previous)


def main(argv=None) -> int:
    command = "attnres"
    if threading.current_thread() is threading.main_thread():
        # A process started while its parent held SIGINT and SIGTERM blocked inherits that mask,
        # and then no Ctrl-C would ever arrive: the command line's promises need them unblocked.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        with starting():
            pause_at("start")
            parser = build_parser()
            args = parser.parse_args(argv)  # --help and refusals exit here, before PyTorch loads
            args.argv = list(sys.argv[1:] if argv is None else argv)
            if not getattr(args, "fn", None):
                parser.print_help()
                return 2
            command = f"attnres {args.command}"
            pause_at("parsed")
            for module in args.loads:  # the command's modules (PyTorch among them), ahead of fn
                importlib.import_module(module)
            pause_at("loaded")
        pause_at("running")
        return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C once started, outside a training's steps (those save and stop)
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:  # bad input: a clear message, not a traceback
        # every torchrun rank checks the same input and fails alike: rank 0 speaks for them
        if commands.rank() == 0:
            print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, MemoryError) as exc:
        from .train.checkpoint import CheckpointError
        from .train.trainer import TrainingDiverged

        known = (CheckpointError, TrainingDiverged, MemoryError)
        if isinstance(exc, RuntimeError) and not isinstance(exc, known) and not _out_of_memory(exc):
            raise  # a defect, not the user's input or the machine: keep its traceback
        where = f" (rank {commands.rank()})" if commands.rank() else ""  # a fault may hit one rank only
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"{command}: error{where}: {text}", file=sys.stderr)
        return 1


def _out_of_memory(exc: BaseException) -> bool:
    """A RuntimeError that says the memory ran out (torch's on CUDA or the CPU allocator)."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)




if __name__ == "__main__":
    sys.exit(main())
