"""The ``attnres`` command line: compare, train, generate, report, convert, export, eval, serve.

It answers at once where it can: the parser, every help text and the refusal of a bad argument or
an unknown design or preset name need only ``attnres/names.py``, and PyTorch (seconds to load) is
imported only once a command runs. A Ctrl-C while it starts prints one line and exits 130
(``starting``); ``ATTNRES_PAUSE_AT`` (``pause_at``) lets a test stop start-up at a known point.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import re
import signal
import sys
import threading
from pathlib import Path

from .names import DEFAULT_DESIGNS, DESIGNS, PRESET_NAMES


def _config_from_args(args, assignments=None, base=None):
    """The preset (or ``base``, a resumed run's config) with ``--data`` and the ``--set``
    assignments (or ``assignments``) applied together: checked as one whole, so their order
    never matters, and a setting that would not be applied is refused."""
    from .train.config import apply_overrides, preset
    from .train.validate import check_given, check_run

    cfg = base or preset(args.preset)
    if assignments is None:
        assignments = args.set or []
    given = ([f"data.source={args.data}"] if args.data else []) + list(assignments)
    cfg = apply_overrides(cfg, given)
    keys = {a.partition("=")[0].strip() for a in given}
    source = Path(cfg.data.source).expanduser()
    token_files = (source / "train.bin").is_file()
    if "model.vocab_size" in keys and not token_files:
        raise ValueError(f"--set model.vocab_size={cfg.model.vocab_size}: the model's vocabulary is the "
                         f"tokenizer's (256 byte tokens, or data.bpe_vocab_size with data.tokenizer=bpe); "
                         f"model.vocab_size is set only for a folder of token files (train.bin, val.bin)")
    check_run(cfg)
    check_given(cfg, keys, token_files)  # what the user set must act; a default or a saved value need not
    return cfg


def _run_name(cfg) -> str:
    """The run's folder name: ``run.name`` (or the residual kind) taken literally, then a
    timestamp; a name that is not one folder name is refused."""
    import time

    name = cfg.run.name or cfg.model.residual
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or name.startswith("-"):
        raise ValueError(f"run.name={name!r} must be one folder name: no '/', not '.' or '..', not starting "
                         f"with '-'")
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


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
    name is refused here, with the words of ``train/compare.py``'s ``parse_design``, which checks
    the rest (the options, and a name of characters no label may hold) once the command runs."""
    name = label.partition(":")[0]
    if re.fullmatch(r"\w+", name, re.ASCII) and name not in DESIGNS:
        raise argparse.ArgumentTypeError(f"design {label!r}: unknown design {name!r}; expected one of "
                                         f"{sorted(DESIGNS)}, optionally with options: name:field=value:...")
    return label


def _add_config_args(p, default_preset, note=""):
    names = ", ".join(PRESET_NAMES[:-1]) + f" or {PRESET_NAMES[-1]}"
    p.add_argument("--preset", default=default_preset, type=_preset_name,
                   help=f"{names} (default: %(default)s{note})")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="override one config field, e.g. --set model.residual=block --set optim.lr=3e-4")
    p.add_argument("--data", help="text file or folder, folder with train.bin/val.bin, or hf:NAME[:CONFIG] "
                                  "(default: the Python standard library's sources)")


#: what sets a comparison up: with --resume the comparison's own settings are used instead
COMPARE_SETTINGS = ("--preset", "--set", "--data", "--designs", "--seeds", "--baseline", "--out")


def _given_settings(argv, options=COMPARE_SETTINGS) -> list[str]:
    """The ``options`` (default: ``COMPARE_SETTINGS``) on a command line (as argparse reads them:
    a long option or a prefix of one, alone or with ``=VALUE``)."""
    given = set()
    for word in argv:
        name = word.partition("=")[0]
        if name.startswith("--") and len(name) > 2:
            given.update(option for option in options if option.startswith(name))
    return [option for option in options if option in given]


def cmd_compare(args) -> int:
    from .train.compare import (comparison_choice, resume_comparison, run_comparison,
                                split_residual_overrides)

    if args.resume:
        given = _given_settings(args.argv[1:])
        if given:
            raise ValueError("--resume continues the comparison with the settings it was started "
                             f"with; leave out {' '.join(given)}")
        outcome = resume_comparison(Path(args.resume))
    else:
        seeds = [a for a in args.set or [] if a.partition("=")[0].strip() == "run.seed"]
        if seeds:
            raise ValueError(f"--set {seeds[0]}: a comparison's seeds are chosen with --seeds "
                             f"(e.g. --seeds {seeds[0].partition('=')[2].strip() or '0'}); leave out --set run.seed")
        # residual options go to the designs
        shared, overrides = split_residual_overrides(args.set or [])
        cfg = _config_from_args(args, shared)
        designs, seeds = comparison_choice(args.preset, args.designs, args.seeds)
        outcome = run_comparison(cfg, designs=designs, seeds=seeds, out_dir=args.out,
                                 overrides=overrides, baseline=args.baseline,
                                 command=["attnres", *args.argv])
    print(outcome.report)
    return outcome.exit_code  # 130 after SIGINT, 143 after SIGTERM


def _resumed_layout(saved, assignments):
    """A resumed run's saved config with its pipeline settings dropped (back to their defaults)
    when ``--set run.pp_size=N`` gives it another pipeline size: the ``run.pp_*`` settings that
    apply are then those given with it. The saved size given again changes nothing."""
    import dataclasses

    from .train.config import RunConfig, apply_overrides

    given = {a.partition("=")[0].strip() for a in assignments}
    sizes = [a for a in assignments if a.partition("=")[0].strip() == "run.pp_size"]
    if not sizes or apply_overrides(saved, sizes).run.pp_size == saved.run.pp_size:
        return saved
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)
                if f.name.startswith("pp_") and f"run.{f.name}" not in given}
    return dataclasses.replace(saved, run=dataclasses.replace(saved.run, **defaults))


def cmd_train(args) -> int:
    from .train.trainer import train

    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --run-dir and --overwrite starts it over: give one")
    if args.resume:
        if not args.run_dir:
            raise ValueError("--resume continues the run in --run-dir: give its folder")
        if _given_settings(args.argv[1:], ("--preset",)):
            raise ValueError("--resume continues the run with the settings it was started with; leave out "
                             "--preset (--set changes one of them, e.g. --set run.steps=2000)")
        from .train.run_dir import load_run_config

        run_dir = Path(args.run_dir)
        # the saved settings, with --set (e.g. run.steps=2000 to train further, or another
        # layout) and --data (refused by train unless it is the run's own) applied
        cfg = _config_from_args(args, base=_resumed_layout(load_run_config(run_dir), args.set or []))
    else:
        cfg = _config_from_args(args)
        run_dir = Path(args.run_dir) if args.run_dir else None
    made = None
    if run_dir is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # under torchrun every rank names the folder alike: --run-dir avoids a shared second
        run_dir = Path(cfg.run.out_dir) / _run_name(cfg)
    elif run_dir is None:  # a default name, made here so that no other command takes it too
        from .train.compare import new_folder

        parent = Path(cfg.run.out_dir)
        made = [p for p in (parent, *parent.parents) if not p.exists()]  # rmdir'ed in this order
        run_dir = new_folder(parent, _run_name(cfg))
        made.insert(0, run_dir)
    try:
        result = train(cfg, run_dir, resume=args.resume, overwrite=args.overwrite)
    except BaseException:
        # refused before its first step: the folders made for it go too (rmdir: only when empty)
        with contextlib.suppress(OSError):
            for folder in made or ():
                folder.rmdir()
        raise
    from .train import distributed

    distributed.teardown()
    if _rank() == 0:  # under torchrun, one line for the job
        s = result.summary
        status = "interrupted, checkpoint saved" if result.interrupted else "done"
        print(f"{status}: step {s['steps']}, validation loss {s['final_val_loss']}, {s['tokens_per_s']:.0f} tokens/s")
        print(run_dir)
    return result.exit_code  # 130 after SIGINT, 143 after SIGTERM: `train && next` stops


def load_run(run_dir: Path, command: str = "attnres generate"):
    """The model of a training run folder, with its latest checkpoint's weights (every file
    checked: the config, ``latest``, the checkpoint's files against the config's model), on the
    CPU: a backend the run chose that cannot run there gives way to ``auto``, in one line."""
    import torch

    from .model import Transformer
    from .train.checkpoint import latest_checkpoint, load_checkpoint
    from .train.run_dir import load_run_config
    from .train.validate import runnable_model

    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise ValueError(f"{run_dir} has no checkpoint")
    weights, _ = load_checkpoint(ckpt, cfg.model)
    model_config, note = runnable_model(cfg.model, torch.device("cpu"))
    if note:
        print(f"{command}: {note}", file=sys.stderr)
    model = Transformer(model_config)
    model.load_state_dict(weights)
    return model.eval(), cfg


def cmd_generate(args) -> int:
    import torch

    if not args.prompt:
        raise ValueError("--prompt is empty: give at least one character to continue")
    model, cfg = load_run(Path(args.run_dir))
    if cfg.data.tokenizer != "byte":
        raise ValueError("generate reads byte-level runs; this run used a BPE tokenizer")
    prompt = torch.tensor([list(args.prompt.encode())], dtype=torch.long)
    g = torch.Generator().manual_seed(args.seed)
    out = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, generator=g)
    sys.stdout.write(bytes(out[0].tolist()).decode("utf-8", errors="replace") + "\n")
    return 0


def cmd_report(args) -> int:
    from .analysis.report import write_report

    print(write_report(Path(args.run_dir), baseline=args.baseline))
    return 0


def cmd_convert(args) -> int:
    from .hf import convert_checkpoint

    info = convert_checkpoint(args.src, args.dst, heads=args.heads, block_layers=args.block_layers,
                              overwrite=args.overwrite)
    share = 100 * info["added_parameters"] / info["base_parameters"]
    print(f"converted to {info['model_type']}: added {info['added_parameters']:,} routing parameters "
          f"({share:.4f}% of {info['base_parameters']:,}); saved to {args.dst}")
    return 0


def cmd_export(args) -> int:
    from .hf.export import export_run

    info = export_run(args.run_dir, args.out, overwrite=args.overwrite)
    print(f"exported step {info['step']} ({info['parameters']:,} parameters) of {args.run_dir} to {args.out}")
    return 0


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


def check_eval_folder(model_dir) -> None:
    """``attnres eval``'s folder, read before lm-eval and transformers load (seconds): a folder
    with a ``config.json`` of a saved model; a training run's folder is pointed to ``attnres
    export``, which writes the folder eval reads."""
    from .files import read_json

    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder: give a saved model's folder (attnres export or attnres convert)")
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path} is not a saved model folder (config.json missing)")
    value = read_json(config)
    if isinstance(value, dict) and {"model", "data", "optim", "run"} <= set(value):
        raise ValueError(f"{path} is a training run's folder; `attnres export {path} OUT` writes its latest "
                         f"checkpoint as the model folder that eval reads")


def cmd_eval(args) -> int:
    if args.limit is not None and not args.limit > 0:
        raise ValueError(f"limit={args.limit} must be a positive number of examples per task, a fraction in (0, 1) "
                         f"of them, or None for all")
    if args.batch_size < 1:
        raise ValueError(f"batch_size={args.batch_size} must be >= 1")
    check_eval_folder(args.model_dir)  # all before lm-eval and transformers load
    from .hf.evaluate import evaluate

    results = evaluate(args.model_dir, args.tasks, include_path=args.include_path, limit=args.limit,
                       device=args.device, batch_size=args.batch_size)
    print(json.dumps(results["results"], indent=2, default=str))
    return 0


def cmd_serve(args) -> int:
    from .serving.server import serve

    serve(Path(args.model_dir), args.host, args.port, args.kv_cache_gib)
    return 0  # not reached: vLLM's server replaces this process


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="train several residual designs on the same data and write a report")
    _add_config_args(p, "demo", "; study: prenorm, block, mhar and full over seeds 0-5; ablations: the AttnRes "
                                "paper's ablation rows (docs/RESULTS.md) over seeds 0-2, at the study's size")
    p.add_argument("--designs", nargs="+", metavar="DESIGN", type=_design_label,
                   help=f"from {sorted(DESIGNS)}, each optionally with options of its own, name:field=value:..., "
                        f"e.g. full:norm_eps=1e-12 block:block_size=4 (default: the preset's, else "
                        f"{' '.join(DEFAULT_DESIGNS)})")
    p.add_argument("--seeds", nargs="+", type=int,
                   help="one run per design per seed; several give paired intervals (default: the preset's, else 0)")
    p.add_argument("--baseline", metavar="DESIGN", type=_design_label,
                   help="the design the others are compared with (default: prenorm when chosen, else the first)")
    p.add_argument("--out", default="runs", help="parent folder of the comparison (default: %(default)s)")
    p.add_argument("--resume", metavar="COMPARISON_DIR",
                   help="continue a comparison that was stopped, where it stopped, with its own "
                        "settings (given alone: its finished runs are kept, the others continue "
                        "from their checkpoints)")
    p.set_defaults(fn=cmd_compare, loads=("attnres.train.compare",))


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train one model")
    _add_config_args(p, "small")
    p.add_argument("--run-dir", help="folder of the run (default: runs/<residual>-<timestamp>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start over in a --run-dir that holds a run (its files go)")
    p.set_defaults(fn=cmd_train, loads=("attnres.train.trainer",))


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample from a trained run with the KV cache")
    p.add_argument("run_dir")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to add (default: 200, or what the model's context has room for)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_generate, loads=("attnres.train.checkpoint", "attnres.train.run_dir"))


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="rebuild a comparison report from its saved artifacts")
    p.add_argument("run_dir")
    p.add_argument("--baseline", metavar="DESIGN", type=_design_label,
                   help="compare with this design (default: the comparison's)")
    p.set_defaults(fn=cmd_report, loads=("attnres.analysis.report",))


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a local Llama/Mistral/Qwen2/Qwen3 model to Delta AttnRes")
    p.add_argument("src", help="folder of the Hugging Face model")
    p.add_argument("dst", help="folder to write the converted model to")
    p.add_argument("--heads", type=int, default=8, help="depth-attention heads (default: %(default)s)")
    p.add_argument("--block-layers", type=_block_layers, default=4, metavar="N|N,N,...",
                   help="transformer layers per block, or a comma list of layers in each block "
                        "(uneven blocks, e.g. 2,2,3,1) (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace a destination folder that is not empty")
    p.set_defaults(fn=cmd_convert, loads=("attnres.hf",))


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="write a training run's latest checkpoint as a Hugging Face folder")
    p.add_argument("run_dir", help="the run's folder (one process's checkpoints or a sharded run's)")
    p.add_argument("out", help="folder to write the model and its byte tokenizer to")
    p.add_argument("--overwrite", action="store_true", help="replace an output folder that is not empty")
    p.set_defaults(fn=cmd_export, loads=("attnres.hf.export",))


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
    p.set_defaults(fn=cmd_eval, loads=("attnres.files",))


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a model folder with vLLM's OpenAI-compatible server")
    p.add_argument("model_dir", help="an attnres export or attnres convert folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="memory for vLLM's KV cache (GiB)")
    p.set_defaults(fn=cmd_serve, loads=("attnres.serving.server",))


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand. Each sets ``fn``, the function that runs it, and ``loads``,
    the modules it runs on, which ``main`` imports while the command line starts (``starting``)."""
    parser = argparse.ArgumentParser(prog="attnres", description="Attention Residuals: train, compare, report.")
    sub = parser.add_subparsers(dest="command")
    for add in (_add_compare, _add_train, _add_generate, _add_report, _add_convert, _add_export, _add_eval,
                _add_serve):
        add(sub)
    return parser


#: the points of start-up where ``ATTNRES_PAUSE_AT`` stops it, in order: before the parser, after
#: parsing, after the command's modules (PyTorch among them) loaded, as the command starts to run
PAUSE_POINTS = ("start", "parsed", "loaded", "running")


def pause_at(point: str) -> None:
    """With ``ATTNRES_PAUSE_AT=POINT`` (one of ``PAUSE_POINTS``), stop there: ``attnres: paused at
    POINT`` on stderr, then wait for a signal. A test sends its Ctrl-C at a known point of
    start-up this way, not after a guessed delay."""
    if os.environ.get("ATTNRES_PAUSE_AT") == point:
        print(f"attnres: paused at {point}", file=sys.stderr, flush=True)
        while True:
            signal.pause()  # a handler that returns (none here does) would wait again


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
        if _rank() == 0:
            print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, MemoryError) as exc:
        from .train.checkpoint import CheckpointError
        from .train.trainer import TrainingDiverged

        known = (CheckpointError, TrainingDiverged, MemoryError)
        if isinstance(exc, RuntimeError) and not isinstance(exc, known) and not _out_of_memory(exc):
            raise  # a defect, not the user's input or the machine: keep its traceback
        where = f" (rank {_rank()})" if _rank() else ""  # a fault may hit one rank only
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"{command}: error{where}: {text}", file=sys.stderr)
        return 1


def _out_of_memory(exc: BaseException) -> bool:
    """A RuntimeError that says the memory ran out (torch's on CUDA or the CPU allocator)."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def _rank() -> int:
    """This process's rank under torchrun (0 outside it)."""
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    sys.exit(main())
