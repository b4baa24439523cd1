"""The comparison report: a Markdown page with PNG figures, rebuilt from saved artifacts.

A comparison folder holds one sub-folder per run (``<design>`` or ``<design>-seed<k>``) with
``config.json``, ``summary.json``, ``metrics.jsonl`` and ``analysis.json``; ``compare.json``
lists them in order (with the steps each planned and reached) and says whether the comparison is
complete. An incomplete one (stopped by a signal, or killed) is reported as such: what is
missing, and numbers from complete pairs only (the seeds every design finished). Every number
in the report is read from those files; the report's numbers also go to ``results.json``
(``comparison_results``).
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..files import read_json, read_jsonl
from .stats import mean_and_sd, paired_difference


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("the report's figures need matplotlib: pip install 'attnres[report]'") from None
    return plt


def check_report_dependencies(seeds: int) -> None:
    """Raise ``ValueError`` unless the report of a comparison over ``seeds`` seeds can be
    written (matplotlib; scipy for the intervals of two or more): checked before any training."""
    _matplotlib()
    if seeds > 1:
        try:
            import scipy.stats  # noqa: F401
        except ImportError:
            raise ValueError("the intervals over seeds need scipy: pip install 'attnres[report]'") from None


#: what the report reads of each run's summary.json and metrics.jsonl rows (checked on reading)
SUMMARY_FIELDS = {"final_val_loss": (int, float, type(None)), "parameters": int,
                  "peak_memory_mib": (int, float)}


def metric_fields(row: dict) -> dict:
    number = (int, float)
    return {"split": str, "step": int, "tokens": int, **({"val_loss": number} if row.get("split") == "val" else {})}


def label_path(label: str) -> str:
    """The filesystem-safe form of a design's label (``name:field=value:...``), for folder and
    figure names: each colon written as ``+`` (``full:norm_eps=1e-12`` -> ``full+norm_eps=1e-12``)."""
    return label.replace(":", "+")


def run_name(design: str, seed: int, seeds) -> str:
    """The folder of ``design``'s run for ``seed`` in a comparison over ``seeds``: the design's
    label (``label_path``), with ``-seed<k>`` when there are several seeds."""
    name = label_path(design)
    return name if len(seeds) == 1 else f"{name}-seed{seed}"


def _list_problem(index: dict, key: str, kind: type) -> str | None:
    values = index.get(key)
    if key not in index:
        return f"has no {key!r}"
    if not isinstance(values, list) or not values or any(type(v) is not kind for v in values):
        return f"{key!r} is {values!r}, not a non-empty list of {kind.__name__}"
    return None


def _run_problem(index: dict, k: int, run) -> str | None:
    if not isinstance(run, dict):
        return f"runs[{k}] is {run!r}, not an object"
    lacking = [key for key in ("design", "seed", "dir") if key not in run]
    if lacking:
        return f"runs[{k}] has no {lacking}"
    if run["design"] not in index["designs"] or run["seed"] not in index["seeds"]:
        return (f"runs[{k}] is design {run['design']!r}, seed {run['seed']!r}: not one the "
                "comparison lists")
    folder = run["dir"]
    if not isinstance(folder, str) or folder in ("", ".", "..") or Path(folder).name != folder:
        return f"runs[{k}] has dir {folder!r}: not the name of a folder inside the comparison's"
    steps = [run.get(key) for key in ("steps", "steps_done") if key in run]
    if any(type(v) is not int or v < 0 for v in steps):
        return f"runs[{k}] has steps {steps}: not integers >= 0"
    return None


def index_problem(index) -> str | None:
    """What is wrong with a comparison's ``compare.json`` (``index``), or None: it is an object
    with its ``designs`` and ``seeds`` (non-empty lists), and ``runs``, each naming one of them
    once and a folder inside the comparison's, with its steps (planned and done) when given."""
    if not isinstance(index, dict):
        return f"holds {type(index).__name__} {index!r:.40}, not an object"
    problem = _list_problem(index, "designs", str) or _list_problem(index, "seeds", int)
    if problem:
        return problem
    if not isinstance(index.get("runs"), list):
        return "has no 'runs' list"
    for k, run in enumerate(index["runs"]):
        problem = _run_problem(index, k, run)
        if problem:
            return problem
    pairs = [(r["design"], r["seed"]) for r in index["runs"]]
    if len(set(pairs)) != len(pairs):
        return "lists a design and seed twice in 'runs'"
    if not isinstance(index.get("complete", True), bool):
        return f"'complete' is {index['complete']!r}, not true or false"
    return None


def load_index(compare_dir: Path) -> dict:
    """A comparison's ``compare.json``, checked (``index_problem``): ``ValueError`` naming the
    file and what is wrong."""
    index_path = Path(compare_dir) / "compare.json"
    if not index_path.exists():
        raise ValueError(f"{compare_dir} is not a comparison folder: compare.json is missing")
    index = read_json(index_path)
    problem = index_problem(index)
    if problem:
        raise ValueError(f"{index_path} {problem}; was it cut short or edited by hand?")
    return index


def load_runs(compare_dir: Path) -> tuple[dict, list[dict]]:
    """The comparison's index and the runs it records, each with its saved files."""
    compare_dir = Path(compare_dir)
    index = load_index(compare_dir)
    runs = []
    for entry in index["runs"]:
        d = compare_dir / entry["dir"]
        missing = [n for n in ("summary.json", "metrics.jsonl", "config.json") if not (d / n).exists()]
        if missing:
            raise ValueError(f"run {d} is incomplete: {missing} missing")
        run = dict(entry)
        run["summary"] = read_json(d / "summary.json", SUMMARY_FIELDS)
        run["config"] = read_json(d / "config.json", {s: dict for s in ("model", "data", "run")})
        run["metrics"] = read_jsonl(d / "metrics.jsonl", metric_fields)
        analysis = d / "analysis.json"
        run["analysis"] = read_json(analysis) if analysis.exists() else None
        runs.append(run)
    return index, runs


def _last_checkpoint(run_dir: Path) -> str:
    """``"; its last checkpoint is step N"`` from a run folder's ``checkpoints/latest``, or ''."""
    try:
        name = (run_dir / "checkpoints" / "latest").read_text()
        return f"; its last checkpoint is step {int(name.split('-')[1])}"
    except (OSError, ValueError, IndexError):
        return ""


def run_status(root: Path, index: dict, runs: list[dict]) -> dict[tuple[str, int], str | None]:
    """``(design, seed)`` -> None for every run the comparison plans that finished its steps,
    else what became of it: stopped at a step (``steps_done`` of ``steps`` in ``compare.json``,
    or for an older comparison its summary's steps against its config's), killed while it
    trained (a folder that ``compare.json`` does not record), or not started."""
    entries = {(r["design"], r["seed"]): r for r in runs}
    status = {}
    for seed in index["seeds"]:
        for design in index["designs"]:
            run, folder = entries.get((design, seed)), root / run_name(design, seed, index["seeds"])
            if run is not None:
                steps = run.get("steps", run["config"].get("run", {}).get("steps"))
                done = run.get("steps_done", run["summary"].get("steps", steps))
                finished = steps is None or done >= steps
                status[design, seed] = None if finished else f"stopped at step {done} of {steps}"
            elif folder.is_dir():
                status[design, seed] = ("killed while it trained (compare.json has no record of it)"
                                        + _last_checkpoint(folder))
            else:
                status[design, seed] = "not started"
    return status


def by_design(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for run in runs:
        out.setdefault(run["design"], []).append(run)
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def val_curve(run: dict) -> dict[int, float]:
    """Validation loss by training tokens."""
    return {m["tokens"]: m["val_loss"] for m in run["metrics"] if m["split"] == "val"}


def _fig_loss_curves(plt, designs, path):
    """Each design's validation loss: the mean over seeds, with a band from the lowest to the
    highest seed where there are several."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k, (name, runs) in enumerate(designs.items()):
        curves = [val_curve(run) for run in runs]
        tokens = sorted(set.intersection(*(set(c) for c in curves)))
        if not tokens:
            continue
        values = [[c[t] for c in curves] for t in tokens]
        ax.plot(tokens, [statistics.fmean(v) for v in values], marker="o", ms=3, label=name, color=f"C{k}")
        if len(curves) > 1:
            ax.fill_between(tokens, [min(v) for v in values], [max(v) for v in values], color=f"C{k}", alpha=0.2)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Validation loss" + (" (mean over seeds; band: lowest to highest seed)"
                                      if any(len(r) > 1 for r in designs.values()) else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fig_depth_weights(plt, name, analysis, path):
    import numpy as np

    weights = analysis["depth_weights"]
    sites = sorted(weights, key=int)
    n_src = max(len(weights[s]) for s in sites)
    heads = len(weights[sites[0]][0])
    grid = np.full((heads, len(sites), n_src), np.nan)
    for r, s in enumerate(sites):
        w = np.asarray(weights[s])  # [N, H]
        grid[:, r, : w.shape[0]] = w.T
    fig, axes = plt.subplots(1, heads, figsize=(1.2 + 3.2 * heads if heads > 1 else 6, 0.6 + 0.28 * len(sites)), squeeze=False)
    M = analysis["num_sublayers"]
    labels = [("output" if int(s) == M else f"{int(s)} {'attn' if int(s) % 2 == 0 else 'mlp'}") for s in sites]
    # softmax weights on the scale 0..1; DenseFormer's weights are free scalars (1 at
    # initialization), shown on the range they reach
    vmin, vmax = min(0.0, float(np.nanmin(grid))), max(1.0, float(np.nanmax(grid)))
    for h in range(heads):
        ax = axes[0, h]
        im = ax.imshow(grid[h], vmin=vmin, vmax=vmax, cmap="viridis", aspect="auto")
        ax.set_yticks(range(len(sites)), labels if h == 0 else [""] * len(sites), fontsize=7)
        ax.set_xlabel("source (0 = embedding)")
        ax.set_title(f"head {h}" if heads > 1 else name)
    fig.colorbar(im, ax=axes[0, -1], fraction=0.05)
    fig.suptitle(f"{name}: depth weights, mean over validation tokens", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _fig_expert_load(plt, loads, path):
    """One heatmap per design: MoE layers by experts, the fraction of assignments (1/E: even)."""
    import numpy as np

    layers, experts = np.asarray(loads[0][1]).shape
    fig, axes = plt.subplots(1, len(loads), figsize=(1.0 + (1.2 + 0.3 * experts) * len(loads), 1.2 + 0.3 * layers),
                             squeeze=False, constrained_layout=True)
    vmax = max(2.0 / experts, max(float(np.max(load)) for _, load in loads))
    for i, (ax, (name, load)) in enumerate(zip(axes[0], loads)):
        im = ax.imshow(np.asarray(load), vmin=0, vmax=vmax, cmap="magma", aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(experts))
        ax.set_yticks(range(layers))
        ax.set_xlabel("expert")
        if i == 0:
            ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=axes[0, -1], fraction=0.08)
    fig.suptitle("Expert load: fraction of top-k assignments, validation tokens", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _fig_per_depth(plt, designs, key, ylabel, title, path, logy=False):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, runs in designs.items():
        values = key(runs[0])
        if values:
            ax.plot(range(len(values)), values, marker="o", ms=3, label=name)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig, ax


def choose_baseline(designs, requested: str | None = None) -> str:
    """``requested`` when given (it must be one of ``designs``), else ``prenorm`` when it is
    among them, else the first design."""
    designs = list(designs)
    if requested is not None:
        if requested not in designs:
            raise ValueError(f"baseline {requested!r} is not among the designs {designs}")
        return requested
    return "prenorm" if "prenorm" in designs else designs[0]


def final_losses(runs: list[dict]) -> dict[str, float]:
    """Seed (a string, as in results.json) -> final validation loss."""
    return {str(r["seed"]): r["summary"]["final_val_loss"] for r in runs}


def comparison_results(designs: dict[str, list[dict]], baseline: str) -> dict:
    """What ``results.json`` holds: every design's final validation loss per seed, and for each
    design but the baseline its paired difference to the baseline (``analysis.stats``)."""
    base = final_losses(designs[baseline])
    out = {"baseline": baseline, "designs": {}}
    for name, runs in designs.items():
        losses = final_losses(runs)
        mean, sd = mean_and_sd(list(losses.values()))
        entry = {"val_loss": losses, "val_loss_mean": mean, "val_loss_sd": sd}
        if name != baseline:
            paired = paired_difference(base, losses)
            entry.update(diff_mean=paired["diff_mean"], ci95=paired["ci95"], verdict=paired["verdict"])
        out["designs"][name] = entry
    return out


def rerun_command(index: dict, seeds=(0, 1, 2)) -> str:
    """The comparison's own command (when it was recorded) with ``--seeds`` replaced."""
    words, skipping = [], False
    for word in index.get("command") or ["attnres", "compare"]:
        if word == "--seeds" or word.startswith("--seeds="):
            skipping = word == "--seeds"
            continue
        if skipping and not word.startswith("-"):
            continue
        skipping = False
        words.append(word)
    return shlex.join([*words, "--seeds", *map(str, seeds)])


def _summary_lines(index, designs, results, unit) -> list[str]:
    baseline = results["baseline"]
    entries = results["designs"]
    seeds = sorted({s for e in entries.values() for s in e["val_loss"]}, key=int)
    paired = len(seeds) > 1

    def row(name: str, runs: list[dict]) -> str:
        e = entries[name]
        loss = f"{e['val_loss_mean']:.4f}" + ("" if e["val_loss_sd"] is None else f" ± {e['val_loss_sd']:.4f}")
        cells = [name, loss, f"{e['val_loss_mean'] / math.log(2):.4f}"]
        if name == baseline:
            cells += ["baseline"] + ["", ""] * paired
        else:
            cells.append(f"{e['diff_mean']:+.4f}")
            if paired:
                low, high = e["ci95"]
                cells += [f"[{low:+.4f}, {high:+.4f}]", "not resolved" if e["verdict"] == "unresolved" else e["verdict"]]
        cells += [f"{runs[0]['summary']['parameters']:,}", f"{_mean(r['summary']['peak_memory_mib'] for r in runs):,.0f}"]
        return "| " + " | ".join(cells) + " |"

    if not paired:
        header = ["val loss (nats)", unit, f"vs {baseline}"]
        lines = [
            "**One seed: this comparison cannot tell a difference between designs from seed noise.** "
            "A different initialization and batch order moves every design's loss; only several seeds, "
            "paired, measure by how much. To resolve the differences, run:",
            "", f"    {rerun_command(index)}", "",
        ]
    else:
        header = ["val loss (nats), mean ± sd", unit, f"vs {baseline}, paired", "95% interval", "verdict"]
        lines = [
            f"Final validation loss over {len(seeds)} seeds. For each seed every design starts from the same "
            "initialization seed and sees the same batches, so the difference to the baseline is taken per "
            "seed and averaged; the 95% interval of that mean difference is Student's t with n-1 degrees of "
            "freedom (`scipy.stats.ttest_rel`). Verdict: better (interval below 0), worse (above 0), or not "
            "resolved at this budget (the interval holds 0).",
            "",
        ]
    header = ["design", *header, "parameters", "peak memory (MiB)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [row(name, runs) for name, runs in designs.items()]
    if paired:
        lines += ["", "Per seed (final validation loss, nats):", "",
                  "| design | " + " | ".join(f"seed {s}" for s in seeds) + " |",
                  "|---|" + "---|" * len(seeds)]
        for name in designs:
            losses = entries[name]["val_loss"]
            lines.append(f"| {name} | " + " | ".join(f"{losses[s]:.4f}" if s in losses else "" for s in seeds) + " |")
    return lines


def _moe_text(m: dict) -> str:
    """The MoE part of the model's description ('' for a dense model or an older config)."""
    if not m.get("moe_experts"):
        return ""
    shared = f" + {m['moe_shared_experts']} shared" if m["moe_shared_experts"] else ""
    balance = (f"balance loss x {m['moe_aux_weight']:g}" if m["moe_balance"] == "aux"
               else f"bias balance, rate {m['moe_bias_rate']:g}")
    capacity = f", capacity {m['moe_capacity']:g}" if m["moe_capacity"] else ""
    return (f"; every MLP a mixture of {m['moe_experts']} experts{shared} of width {m['moe_hidden'] or m['ffn_dim']}, "
            f"top-{m['moe_top_k']}, {balance}{capacity}")


@dataclass
class Comparison:
    """What every section of the report reads: the comparison's folder (where the figures go),
    its index (``compare.json``), its runs in order and grouped by design, the baseline and the
    numbers of ``results.json`` (``comparison_results``)."""

    root: Path
    index: dict
    runs: list[dict]
    designs: dict[str, list[dict]]
    baseline: str
    results: dict

    @property
    def seeds(self) -> list[int]:
        return sorted({r["seed"] for r in self.runs})

    def first_analyses(self, key: str) -> list[tuple[str, object]]:
        """``(design, value)`` of analysis field ``key`` from each design's first run, where it
        has one."""
        return [(name, runs[0]["analysis"][key]) for name, runs in self.designs.items()
                if runs[0]["analysis"] and runs[0]["analysis"].get(key)]


def load_comparison(compare_dir: Path, baseline: str | None = None) -> Comparison:
    """The comparison in ``compare_dir`` with its baseline: ``baseline`` when given, else the
    one the comparison chose (``choose_baseline``). Only complete pairs are compared: the runs
    of the seeds that every design finished (``run_status``); ``results`` says which seeds
    those are (``seeds``), whether the comparison is ``complete`` and what is ``missing``."""
    index, runs = load_runs(compare_dir)
    status = run_status(Path(compare_dir), index, runs)
    seeds = [s for s in index["seeds"] if all(status[d, s] is None for d in index["designs"])]
    runs = [r for r in runs if r["seed"] in seeds]
    designs = by_design(runs)
    baseline = choose_baseline(index["designs"], baseline or index.get("baseline"))
    results = comparison_results(designs, baseline) if runs else dict(baseline=baseline, designs={})
    missing = [f"{d}, seed {s}: {text}" for (d, s), text in status.items() if text]
    results.update(complete=not missing, seeds=seeds, missing=missing)
    return Comparison(Path(compare_dir), index, runs, designs, baseline, results)


def _incomplete_section(c: Comparison) -> list[str]:
    """What an incomplete comparison lacks, which seeds its numbers use, how to finish it."""
    if c.results["complete"]:
        return []
    stopped = c.index.get("stopped_by")
    why = f"stopped by {stopped}" if stopped else "it did not run to its end"
    lines = [f"**This comparison is incomplete**: {why}. Not finished:", "",
             *(f"- {m}" for m in c.results["missing"]), ""]
    seeds, planned = c.results["seeds"], ", ".join(map(str, c.index["seeds"]))
    if seeds:
        lines.append("The numbers below use only complete pairs: the seeds that every design "
                     f"finished ({', '.join(map(str, seeds))} of {planned}); the runs of the other "
                     "seeds are left out.")
    else:
        lines.append("No seed was finished by every design: there is nothing to compare yet.")
    if "config" not in c.index:  # saved before compare.json held what --resume needs
        return [*lines, "", "It was saved before `attnres compare --resume` existed: run it again.", ""]
    return [*lines, "", f"To finish it: `attnres compare --resume {c.root}`", ""]


def _header(c: Comparison) -> list[str]:
    """The title, the data, budget and model every design shared, and the summary table."""
    first = c.runs[0]
    run, m = first["config"]["run"], first["config"]["model"]
    unit = "bits/byte" if first["config"]["data"]["tokenizer"] == "byte" else "bits/token"
    return [
        "# Residual designs compared",
        "",
        *_incomplete_section(c),
        f"Data: {first['summary']['data']}. Every design saw the same {first['summary']['tokens']:,} training tokens "
        f"({run['steps']} steps of {run['batch_size']} x {run['seq_len']}) in the same order, from the same initial "
        f"seed, and was evaluated on the same {run['eval_batches']} validation batches.",
        f"Model: dim {m['dim']}, {m['n_layers']} layers ({2 * m['n_layers']} sublayers), "
        f"{m['n_heads']} heads, vocabulary {m['vocab_size']}{_moe_text(m)}. Seeds: {', '.join(map(str, c.seeds))}. "
        f"Baseline: {c.baseline}. The numbers are also in `results.json`.",
        "",
        *_summary_lines(c.index, c.designs, c.results, unit),
    ]


def _options_section(c: Comparison) -> list[str]:
    """Each design's residual options, as ``--set`` takes them (none for an older comparison)."""
    options = {r["design"]: r.get("options") for r in c.runs if r.get("options")}
    if not options:
        return []
    lines = ["", "What each design ran with (its residual options, those given with `--set model.*` included):",
             "", "| design | residual | options |", "|---|---|---|"]
    for name, opts in options.items():
        rest = ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"  # as --set takes it
                         for k, v in opts.items() if k != "residual") or "defaults"
        lines.append(f"| {name} | {opts['residual']} | {rest} |")
    return lines


def _loss_section(c: Comparison, plt) -> list[str]:
    """Why step times are left out, then the validation loss curves (``loss_curves.png``)."""
    _fig_loss_curves(plt, c.designs, c.root / "loss_curves.png")
    return [
        "",
        "Step times are not reported: the designs train one after another on a shared machine, so "
        "their times move with the machine's load (0.4x to 1.25x between two identical runs). "
        "`benchmarks/train_step.py` times them interleaved, several rounds (`docs/BENCHMARKS.md`).",
        "",
        "## Validation loss",
        "",
        "![validation loss](loss_curves.png)",
        "",
    ]


def _depth_weights_section(c: Comparison, plt) -> list[str]:
    """One heatmap of depth weights per design that routes over depth."""
    heat = [(n, rs[0]["analysis"]) for n, rs in c.designs.items() if rs[0]["analysis"] and rs[0]["analysis"]["depth_weights"]]
    if not heat:
        return []
    lines = ["## Depth weights", "",
             "Rows are routing sites (sublayers, then the output), columns the sources they route over: "
             "column 0 is the embedding; for Full AttnRes column j is sublayer j-1's output; for Block "
             "AttnRes the columns are the completed blocks in order, and the last filled cell of a row in "
             "the middle of a block is the partial sum of that block. With a window (`full:window=W`) "
             "a row's sources outside it weigh 0. DenseFormer's cells are its learned weights, not a "
             "distribution (all 1 at initialization: PreNorm's sum), on the range they reach.", ""]
    for name, analysis in heat:
        fname = f"depth_weights_{label_path(name)}.png"
        _fig_depth_weights(plt, name, analysis, c.root / fname)
        lines += [f"![{name} depth weights]({fname})", ""]
    return lines


def _expert_load_section(c: Comparison, plt) -> list[str]:
    """For mixture-of-experts models: the load per layer and expert, and its imbalance."""
    loads = c.first_analyses("expert_load")
    if not loads:
        return []
    m = c.runs[0]["config"]["model"]
    experts = len(loads[0][1][0])
    seed = f" (seed {next(iter(c.designs.values()))[0]['seed']})" if len(c.seeds) > 1 else ""
    lines = ["## Expert load", "",
             f"The fraction of top-{m['moe_top_k']} assignments each of the {experts} experts receives in each "
             f"layer of the trained model{seed}, on the validation batch of the depth weights "
             f"(1/{experts} = {1 / experts:.3f} is even). "
             "Imbalance is the most loaded expert's fraction times the number of experts (1.0: even), "
             "averaged over layers; the training log holds the same per step (`expert_load`).", "",
             "![expert load](expert_load.png)", "",
             "| design | imbalance (mean over layers) | most loaded | least loaded |", "|---|---|---|---|"]
    for name, load in loads:
        imbalance = sum(max(row) * len(row) for row in load) / len(load)
        lines.append(f"| {name} | {imbalance:.3f} | {max(map(max, load)):.3f} | {min(map(min, load)):.3f} |")
    lines.append("")
    _fig_expert_load(plt, loads, c.root / "expert_load.png")
    return lines


def _save_per_depth(plt, c: Comparison, key, ylabel, title, xlabel, name) -> None:
    fig, ax = _fig_per_depth(plt, c.designs, key, ylabel, title, None, logy=True)
    ax.set_xlabel(xlabel)
    fig.tight_layout()
    fig.savefig(c.root / name, dpi=120)
    plt.close(fig)


def _depth_growth_section(c: Comparison, plt) -> list[str]:
    """The hidden-state RMS at each read and the per-layer gradient norms, over depth."""
    _save_per_depth(plt, c, lambda r: (r["analysis"] or {}).get("read_rms"), "RMS (mean over tokens)",
                    "Hidden-state RMS at each read, before its norm", "sublayer (last point: the output)",
                    "hidden_rms.png")
    _save_per_depth(plt, c, lambda r: r["summary"].get("layer_grad_norms"), "gradient L2 norm",
                    "Per-layer gradient norm, mean over the last 10% of steps", "transformer layer", "grad_norms.png")
    return [
        "## Hidden-state growth over depth", "",
        "PreNorm's running sum grows with depth, diluting each new sublayer's contribution; "
        "AttnRes reads a normalized mix instead. For multi-stream designs the value is the mixed read.", "",
        "![hidden-state RMS](hidden_rms.png)", "",
        "## Gradient norms per layer", "",
        "![gradient norms](grad_norms.png)", "",
    ]


def _width_probe_section(c: Comparison) -> list[str]:
    """For single-head models: whether slices of the width would route differently."""
    probes = c.first_analyses("width_probe")
    if not probes:
        return []
    lines = ["## Width disagreement (single-head models)", "",
             "Each trained single-head query is split into slices, each slice routes with its own "
             "softmax over the same sources, and the mean KL(slice || shared) is compared with a random "
             "query of equal norm. A positive probe says the width wants to route differently per slice: "
             "the case for multi-head routing.", "",
             "| design | slices | KL trained | KL random | probe |", "|---|---|---|---|---|"]
    for name, p in probes:
        lines.append(f"| {name} | {p['slices']} | {p['trained']:.4f} | {p['random']:.4f} | {p['probe']:+.4f} |")
    lines.append("")
    return lines


def write_report(compare_dir: Path, baseline: str | None = None) -> Path:
    """(Re)build ``compare_dir/report.md``, its figures and ``results.json`` from the saved
    artifacts. ``baseline``: the design the others are compared with (default: the one the
    comparison chose, see ``choose_baseline``). The report's sections, in order: the header
    (with, for an incomplete comparison, what it lacks) and summary table, the designs'
    options, the validation loss, the depth weights, the expert load, growth over depth, the
    width probe; for a comparison without a seed that every design finished, what it lacks."""
    plt = _matplotlib()
    c = load_comparison(compare_dir, baseline)
    if not c.runs:  # no seed finished by every design
        lines = ["# Residual designs compared", "", *_incomplete_section(c)]
    else:
        lines = [*_header(c), *_options_section(c), *_loss_section(c, plt),
                 *_depth_weights_section(c, plt), *_expert_load_section(c, plt),
                 *_depth_growth_section(c, plt), *_width_probe_section(c)]
    (c.root / "results.json").write_text(json.dumps(c.results, indent=2))
    path = c.root / "report.md"
    path.write_text("\n".join(lines))
    return path
