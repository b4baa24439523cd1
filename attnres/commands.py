"""What each ``attnres`` subcommand does, given its parsed arguments (``cli.build_parser``):
``cmd_compare``, ``cmd_sweep``, ``cmd_train``, ``cmd_generate``, ``cmd_report``, ``cmd_convert``,
``cmd_export``, ``cmd_eval``, ``cmd_serve``, ``cmd_corpus``, ``cmd_shards``. Each imports what it runs on (PyTorch among it)
inside itself: the command line loads them only once a command runs (``cli.main``), so that
its help and its refusals of bad arguments answer at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path


def rank() -> int:
    """This process's rank under torchrun (0 outside it)."""
    return int(os.environ.get("RANK", "0"))


def config_from_args(args, assignments=None, base=None, init_from: Path | None = None, comparison: bool = False):
    """``checked_config``'s config alone."""
    return checked_config(args, assignments, base, init_from, comparison)[0]


def checked_config(args, assignments=None, base=None, init_from: Path | None = None, comparison: bool = False,
                   processes: int | None = None):
    """``(config, plan)``: the preset (or ``base``, a resumed run's config) with ``--data`` and the ``--set``
    assignments (or ``assignments``) applied together: checked as one whole, so their order
    never matters, and a setting that would not be applied is refused. With ``init_from`` (a
    model folder, ``train --from``) the run trains that folder's model: it has no model section
    (a ``--set model.*`` is refused by name) and reads the folder's tokenizer unless
    ``data.tokenizer`` is given (the bytes for a folder without one). ``comparison``: the config
    a comparison's designs share (``validate.shared_part``). ``processes``: the job's, on which
    the run is checked too; ``plan`` is then its parallel plan (``validate.check_run``), else None."""
    import dataclasses

    from .train.config import apply_overrides, preset
    from .train.validate import check_given, check_hf_source, check_run, shared_part

    cfg = base or preset(args.preset)
    if assignments is None:
        assignments = args.set or []
    given = ([f"data.source={args.data}"] if args.data else []) + list(assignments)
    keys = {a.partition("=")[0].strip() for a in given}
    model_keys = sorted(k for k in keys if k.startswith("model."))
    if model_keys and (init_from is not None or cfg.model is None):
        folder = init_from or cfg.init_from
        raise ValueError(f"--set {model_keys[0]}: the run trains the model of {folder} as that folder holds it; "
                         f"its model.* settings are the folder's (convert or export another folder to change them)")
    cfg = apply_overrides(cfg, given)
    from .train.data import is_path_source

    source = Path(cfg.data.source).expanduser()
    token_files = is_path_source(cfg.data.source) and (source / "train.bin").is_file()
    if init_from is not None:
        tokenizer = cfg.data.tokenizer
        if "data.tokenizer" not in keys:  # token files hold ids already: their bytes are read as they are
            has_tokenizer = any((init_from / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json"))
            tokenizer = "model" if has_tokenizer and not token_files else "byte"
        cfg = dataclasses.replace(cfg, model=None, init_from=str(init_from.expanduser().resolve()),
                                  data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
    if "model.vocab_size" in keys and not token_files:
        raise ValueError(f"--set model.vocab_size={cfg.model.vocab_size}: the model's vocabulary is the "
                         f"tokenizer's (256 byte tokens, or data.bpe_vocab_size with data.tokenizer=bpe); "
                         f"model.vocab_size is set only for a folder of token files (train.bin, val.bin)")
    if "model.vocab_size" in keys:
        from .train.hf_shards import check_shards_vocabulary

        check_shards_vocabulary(source, cfg.model.vocab_size)
    plan = check_run(shared_part(cfg) if comparison else cfg, processes)
    check_hf_source(cfg.data)
    check_given(cfg, keys, token_files)  # what the user set must act; a default or a saved value need not
    return cfg, plan


def run_folder_name(cfg, model) -> str:
    """The run's folder name: ``run.name`` (or the name ``model``, the run's ``RunModel``, gives:
    the residual kind, the source folder's name) taken literally, then a timestamp; a name that
    is not one folder name is refused."""
    import time

    name = cfg.run.name or model.run_name(cfg)
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or name.startswith("-"):
        raise ValueError(f"run.name={name!r} must be one folder name: no '/', not '.' or '..', not starting "
                         f"with '-'")
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


#: what sets a comparison (or a sweep) up: with --resume its own settings are used instead
COMPARE_SETTINGS = ("--preset", "--set", "--data", "--designs", "--seeds", "--baseline", "--out", "--budgets",
                    "--from", "--shock-steps", "--tasks", "--include-path", "--limit")
SWEEP_SETTINGS = ("--preset", "--set", "--data", "--designs", "--seeds", "--baseline", "--out", "--budgets", "--over")
#: the settings of a comparison --from a model folder alone
FOLDER_COMPARISON_SETTINGS = ("--shock-steps", "--tasks", "--include-path", "--limit")


def given_settings(argv, options=COMPARE_SETTINGS) -> list[str]:
    """The ``options`` (default: ``COMPARE_SETTINGS``) on a command line (as argparse reads them:
    a long option or a prefix of one, alone or with ``=VALUE``)."""
    given = set()
    for word in argv:
        name = word.partition("=")[0]
        if name.startswith("--") and len(name) > 2:
            given.update(option for option in options if option.startswith(name))
    return [option for option in options if option in given]


def comparison_settings(args, init_from: Path | None = None):
    """``(config, designs, seeds, overrides)`` of a comparison or sweep's arguments: ``--set``'s
    residual options go to the designs that take them, the rest to the shared config; the seeds
    are ``--seeds``' (``--set run.seed`` refused in their favour). With ``init_from`` (``compare
    --from``) the model is the folder's (``config_from_args``) and the designs default to the
    control and one conversion, ``source convert``."""
    from .experiments.designs import check_shared_optim, comparison_choice, split_residual_overrides

    seeds = [a for a in args.set or [] if a.partition("=")[0].strip() == "run.seed"]
    if seeds:
        raise ValueError(f"--set {seeds[0]}: a comparison's seeds are chosen with --seeds "
                         f"(e.g. --seeds {seeds[0].partition('=')[2].strip() or '0'}); leave out --set run.seed")
    folder_designs = ["source", "convert"] if init_from is not None else None
    designs, seeds = comparison_choice(args.preset, args.designs or folder_designs, args.seeds)
    check_shared_optim(designs, {a.partition("=")[0].strip(): f"--set {a}" for a in args.set or []},
                       folder=init_from is not None)
    if init_from is not None:
        return config_from_args(args, init_from=init_from, comparison=True), designs, seeds, {}
    shared, overrides = split_residual_overrides(args.set or [])
    cfg = config_from_args(args, shared, comparison=True)
    return cfg, designs, seeds, overrides


def folder_comparison_settings(args, cfg):
    """What ``compare --from`` adds to a comparison, checked before any work: the run config
    logging each of the first ``--shock-steps`` steps (all of them when the run has fewer) and
    recording the source folder's digest, the folders' models (``experiments.comparison_folders.ComparisonFolders``),
    and ``compare.json``'s ``downstream`` (``--tasks``, known to lm-eval, with ``--include-path``
    and ``--limit``, which apply with it only; ``complete`` once every run is evaluated)."""
    import dataclasses

    if args.shock_steps < 1:
        raise ValueError(f"--shock-steps {args.shock_steps} must be a positive number of steps")
    extra = {}
    if not args.tasks:
        given = given_settings(args.argv[1:], ("--include-path", "--limit"))
        if given:
            raise ValueError(f"{given[0]} applies to the evaluation on --tasks; give --tasks TASK ... or leave "
                             f"{given[0]} out")
    else:
        if args.limit is not None and not args.limit > 0:
            raise ValueError(f"--limit {args.limit} must be a positive number of items per task, or a fraction in (0, 1)")
        from .eval_tasks import check_tasks

        check_tasks(args.tasks, args.include_path)  # before lm-eval loads: a missing folder, an unknown name
        from .hf.evaluate import check_known_tasks

        check_known_tasks(args.tasks, args.include_path)
        extra["downstream"] = dict(tasks=list(args.tasks), include_path=args.include_path, limit=args.limit,
                                   complete=False)
    from .experiments.comparison_folders import ComparisonFolders

    folders = ComparisonFolders(args.init_from)
    cfg = dataclasses.replace(cfg, init_from_digest=folders.digest,
                              run=dataclasses.replace(cfg.run, log_first=min(args.shock_steps, cfg.run.steps)))
    return cfg, folders, extra


def refuse_mixed_data_without_resume(args, what: str) -> None:
    """``--allow-mixed-data`` lets a resumed comparison mix corpora; a new one reads one corpus."""
    if args.allow_mixed_data and not args.resume:
        raise ValueError(f"--allow-mixed-data applies to --resume {what.upper()}_DIR (a {what} continued where its "
                         f"runs read other data); a new {what} reads one corpus: leave it out")


def resumed_comparison_source(args, root: Path, record):
    """The ``ComparisonFolders`` of a comparison --from a folder resumed from ``root`` (None for
    a comparison of attnres's own designs): its source folder checked against the digest the
    comparison recorded (``source_digest.check_source``), or its new place ``--source``, which is
    then recorded in ``compare.json`` (``record``, its ``ComparisonRecord``)."""
    from .experiments.compare import repoint_source, saved_config

    if not record.init_from:
        if args.source:
            raise ValueError(f"--source gives the new place of the folder a comparison --from a folder started from; "
                             f"{root} compares attnres's own designs: leave it out")
        return None
    from .experiments.comparison_folders import ComparisonFolders
    from .train.source_digest import check_source

    base = saved_config(root, record)
    checked = check_source(base, f"the comparison's source (init_from in {root / 'compare.json'})",
                           f"attnres compare --resume {root} --source DIR",
                           "a new comparison (attnres compare --from MODEL_DIR)", args.source)
    if checked.init_from != base.init_from:
        repoint_source(root, record, checked.init_from)
    return ComparisonFolders(checked.init_from)


def cmd_compare(args) -> int:
    from .experiments.compare import plan_comparison
    from .experiments.comparison_run import continue_comparison, start_comparison

    refuse_mixed_data_without_resume(args, "comparison")
    if args.resume:
        given = given_settings(args.argv[1:])
        if given:
            raise ValueError("--resume continues the comparison with the settings it was started "
                             f"with; leave out {' '.join(given)}")
        from .analysis.comparison_record import read_record

        root = Path(args.resume)
        record = read_record(root)
        folders = resumed_comparison_source(args, root, record)
        outcome = continue_comparison(root, record, folders, args.allow_mixed_data)
    else:
        if args.source:
            raise ValueError("--source gives the new place of the folder a comparison --from a folder started from, "
                             "with --resume COMPARISON_DIR; a new comparison names its folder with --from")
        given = given_settings(args.argv[1:], FOLDER_COMPARISON_SETTINGS)
        if given and not args.init_from:
            raise ValueError(f"{given[0]} applies to a comparison --from a model folder (the conversion against "
                             f"its control); give --from MODEL_DIR or leave it out")
        init_from = Path(args.init_from) if args.init_from else None
        cfg, designs, seeds, overrides = comparison_settings(args, init_from)
        folders, extra = None, {}
        if init_from is not None:
            cfg, folders, extra = folder_comparison_settings(args, cfg)
        plan = plan_comparison(cfg, designs, seeds, overrides, args.baseline, args.budgets, folders)
        outcome = start_comparison(plan, out_dir=args.out, command=["attnres", *args.argv], extra=extra)
    print(outcome.report)
    return outcome.exit_code  # 130 after SIGINT, 143 after SIGTERM


def cmd_sweep(args) -> int:
    from .signals import exit_status
    from .experiments.designs import check_shared_optim
    from .experiments.sweep import Sweep, check_not_set, parse_over, resume_sweep, run_sweep

    refuse_mixed_data_without_resume(args, "sweep")
    if args.resume:
        given = given_settings(args.argv[1:], SWEEP_SETTINGS)
        if given:
            raise ValueError(f"--resume continues the sweep with the settings it was started with; leave out "
                             f"{' '.join(given)}")
        root, signal = resume_sweep(Path(args.resume), allow_mixed_data=args.allow_mixed_data)
    else:
        fields = parse_over(args.over or [])
        check_not_set(fields, ([f"data.source={args.data}"] if args.data else []) + list(args.set or []))
        cfg, designs, seeds, overrides = comparison_settings(args)
        check_shared_optim(designs, {key: f"--over {key}={','.join(values)}" for key, values in fields.items()})
        sweep = Sweep(cfg, fields, designs, seeds, overrides, args.baseline, args.budgets, ["attnres", *args.argv])
        root, signal = run_sweep(sweep, args.out)
    if signal is not None:
        print(f"stopped: the sweep is incomplete; continue it with: attnres sweep --resume {root}", file=sys.stderr)
    print(root / "sweep.json")
    return exit_status(signal)


def resumed_layout(saved, assignments):
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
    from .experiments.train_rate import preset_train_rate
    from .train.distributed import launched_world_size
    from .train.run_model import OwnModel
    from .train.trainer import train

    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --run-dir and --overwrite starts it over: give one")
    if args.resume and args.init_from:
        raise ValueError("--from starts a run from a model folder and --resume continues a run, which knows its "
                         "folder (give its new place with --source DIR if it moved): give one")
    if args.source and not args.resume:
        raise ValueError("--source gives the new place of the folder a run started from, to continue it with --resume "
                         "--run-dir RUN; a new run names its folder with --from")
    if args.resume:
        if not args.run_dir:
            raise ValueError("--resume continues the run in --run-dir: give its folder")
        if given_settings(args.argv[1:], ("--preset",)):
            raise ValueError("--resume continues the run with the settings it was started with; leave out "
                             "--preset (--set changes one of them, e.g. --set run.steps=2000)")
        from .train.run_files import load_run_config

        run_dir = Path(args.run_dir)
        # the saved settings, with --set (e.g. run.steps=2000 to train further, or another
        # layout) and --data (refused by train unless it is the run's own) applied
        cfg, plan = checked_config(args, base=resumed_layout(load_run_config(run_dir), args.set or []),
                                   processes=launched_world_size())
    else:
        cfg, plan = checked_config(args, init_from=Path(args.init_from) if args.init_from else None,
                                   processes=launched_world_size())
        run_dir = Path(args.run_dir) if args.run_dir else None
    model = OwnModel()
    if cfg.init_from is not None:  # the folder's model, read by the layer that knows its format
        import dataclasses

        from .hf.training import saved_init_from, saved_model
        from .train.source_digest import check_source

        if args.resume:  # the folder the run started from, as it was (or moved: --source)
            cfg = check_source(cfg, saved_init_from(run_dir), f"attnres train --resume --run-dir {run_dir} --source DIR",
                               "a new run (attnres train --from MODEL_DIR --run-dir NEW_RUN)", args.source)
        model = saved_model(cfg.init_from, saved_init_from(run_dir) if args.resume else "--from")
        if not args.resume:  # the run records what it starts from
            cfg = dataclasses.replace(cfg, init_from_digest=model.digest)
    elif args.source:
        raise ValueError(f"--source gives the new place of the folder a run started from (train --from); "
                         f"{run_dir} built its own model: leave --source out")
    elif not args.resume:  # its own model: at the rate a preset's comparison gives its design (regime)
        cfg, note = preset_train_rate(args.preset, cfg, args.set or [])
        if note and rank() == 0:
            print(note, file=sys.stderr)
    made = None
    if run_dir is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # under torchrun every rank names the folder alike: --run-dir avoids a shared second
        run_dir = Path(cfg.run.out_dir) / run_folder_name(cfg, model)
    elif run_dir is None:  # a default name, made here so that no other command takes it too
        from .files import new_folder

        parent = Path(cfg.run.out_dir)
        made = [p for p in (parent, *parent.parents) if not p.exists()]  # rmdir'ed in this order
        run_dir = new_folder(parent, run_folder_name(cfg, model))
        made.insert(0, run_dir)
    try:
        result = train(cfg, run_dir, resume=args.resume, overwrite=args.overwrite, model=model, plan=plan)
    except BaseException:
        # refused before its first step: the folders made for it go too (rmdir: only when empty)
        with contextlib.suppress(OSError):
            for folder in made or ():
                folder.rmdir()
        raise
    from .train import distributed

    distributed.teardown()
    if rank() == 0:  # under torchrun, one line for the job
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
    from .train.run_files import load_run_config
    from .train.validate import runnable_model

    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    if cfg.model is None:
        raise ValueError(f"{run_dir} continued the model of {cfg.init_from} (train --from): {command} reads attnres's "
                         f"own runs; `attnres export {run_dir} OUT` writes it as its folder's architecture, which "
                         f"transformers' generate() and `attnres serve` take")
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
    if cfg.model.vocab_size != 256:  # token files: ids of the tokenizer that made them, not bytes
        raise ValueError(f"generate reads and prints bytes; this run read token ids of a {cfg.model.vocab_size}-token "
                         f"vocabulary from {cfg.data.source}, which only the tokenizer that made them decodes")
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

    given = given_settings(args.argv[1:], ("--heads", "--block-layers"))
    defaulted = [name for name, option in (("heads", "--heads"), ("block_layers", "--block-layers")) if option not in given]
    info = convert_checkpoint(args.src, args.dst, heads=args.heads, block_layers=args.block_layers,
                              overwrite=args.overwrite, defaulted=defaulted)
    share = 100 * info["added_parameters"] / info["base_parameters"]
    print(f"converted to {info['model_type']}: added {info['added_parameters']:,} routing parameters "
          f"({share:.4f}% of {info['base_parameters']:,}); saved to {args.dst}")
    return 0


def cmd_export(args) -> int:
    from .hf.export import export_run

    info = export_run(args.run_dir, args.out, overwrite=args.overwrite, format=args.format, source=args.source)
    print(f"exported step {info['step']} ({info['parameters']:,} parameters) of {args.run_dir} to {args.out}")
    return 0


def check_eval_folder(model_dir) -> None:
    """``attnres eval``'s folder, read before lm-eval and transformers load (seconds): a folder
    with a ``config.json`` of a saved model; a training run's folder is pointed to ``attnres
    export``, which writes the folder eval reads."""
    from .files import read_json
    from .train.run_files import is_run_config

    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder: give a saved model's folder (attnres export or attnres convert)")
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path} is not a saved model folder (config.json missing)")
    value = read_json(config)
    if is_run_config(value):
        raise ValueError(f"{path} is a training run's folder; `attnres export {path} OUT` writes its latest "
                         f"checkpoint as the model folder that eval reads")


def cmd_eval(args) -> int:
    if args.limit is not None and not args.limit > 0:
        raise ValueError(f"limit={args.limit} must be a positive number of examples per task, a fraction in (0, 1) "
                         f"of them, or None for all")
    if args.batch_size < 1:
        raise ValueError(f"batch_size={args.batch_size} must be >= 1")
    check_eval_folder(args.model_dir)  # all before lm-eval and transformers load
    from .eval_tasks import check_tasks

    check_tasks(args.tasks, args.include_path)
    from .hf.evaluate import evaluate

    results = evaluate(args.model_dir, args.tasks, include_path=args.include_path, limit=args.limit,
                       device=args.device, batch_size=args.batch_size)
    print(json.dumps(results["results"], indent=2, default=str))
    return 0


def cmd_serve(args) -> int:
    from .serving.server import serve

    serve(Path(args.model_dir), args.host, args.port, args.kv_cache_gib)
    return 0  # not reached: vLLM's server replaces this process




def cmd_corpus(args) -> int:
    from .train.frozen_corpus import fetch

    print(fetch(args.name))
    return 0


def cmd_shards(args) -> int:
    from .train.hf_shards import hf_shards

    args.init_from = None
    cfg = config_from_args(args)
    if not cfg.data.source.startswith("hf:"):
        raise ValueError(f"data.source={cfg.data.source!r}: `attnres shards` makes the token shards of an "
                         f"hf:NAME[:CONFIG] source (--data hf:NAME --set data.max_train_tokens=N)")
    print(hf_shards(cfg.data, cfg.model.vocab_size))
    return 0
