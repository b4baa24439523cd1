"""The comparison report: a Markdown page with PNG figures, rebuilt from saved artifacts.

Every number in the report is read from the comparison's folder (``analysis.comparison``: the
runs, what an incomplete comparison lacks, ``results.json``'s numbers); the figures are drawn by
``analysis.figures``. An incomplete comparison (stopped by a signal, or killed) is reported as
such: what is missing, and numbers from complete pairs only (the seeds every design finished).
"""

from __future__ import annotations

import json
import math
import shlex

# the comparison's reading is imported from here too (experiments/compare.py, studies/)
from .comparison import (SUMMARY_FIELDS, Comparison, by_design, choose_baseline, comparison_results,  # noqa: F401
                         label_path, load_comparison, load_runs, metric_fields, run_name, val_curve)
from .conversion_report import downstream_section, shock_section
from .figures import plot_budget_curve, plot_depth_weights, plot_expert_load, plot_loss_curves, plot_per_depth, pyplot


def check_report_dependencies(seeds: int) -> None:
    """Raise ``ValueError`` unless the report of a comparison over ``seeds`` seeds can be
    written (matplotlib; scipy for the intervals of two or more): checked before any training."""
    pyplot()
    if seeds > 1:
        try:
            import scipy.stats  # noqa: F401
        except ImportError:
            raise ValueError("the intervals over seeds need scipy: pip install 'attnres[report]'") from None


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def rerun_command(command: list[str] | None, seeds=(0, 1, 2)) -> str:
    """The comparison's own ``command`` (when it was recorded) with ``--seeds`` replaced."""
    words, skipping = [], False
    for word in command or ["attnres", "compare"]:
        if word == "--seeds" or word.startswith("--seeds="):
            skipping = word == "--seeds"
            continue
        if skipping and not word.startswith("-"):
            continue
        skipping = False
        words.append(word)
    return shlex.join([*words, "--seeds", *map(str, seeds)])


def _signed(x: float) -> str:
    """A difference in nats, to 4 decimals; one that would print as +0.0000 (a conversion that
    has barely left its source) in scientific notation instead, so that the two ends of one
    interval may be written differently."""
    return f"{x:+.4f}" if x == 0 or abs(x) >= 5e-5 else f"{x:+.2e}"


def _summary_lines(command, designs, results, unit) -> list[str]:
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
        elif e["diff_mean"] is None:  # a pair that saw other tokens: no difference is taken
            cells += ["not compared: other tokens"] + ["", "not compared"] * paired
        else:
            cells.append(_signed(e["diff_mean"]))
            if paired:
                low, high = e["ci95"]
                cells += [f"[{_signed(low)}, {_signed(high)}]", "not resolved" if e["verdict"] == "unresolved" else e["verdict"]]
        cells += [f"{runs[0]['summary']['parameters']:,}", f"{_mean(r['summary']['peak_memory_mib'] for r in runs):,.0f}"]
        return "| " + " | ".join(cells) + " |"

    if not paired:
        header = ["val loss (nats)", unit, f"vs {baseline}"]
        lines = [
            "**One seed: this comparison cannot tell a difference between designs from seed noise.** "
            "A different initialization and batch order moves every design's loss; only several seeds, "
            "paired, measure by how much. To resolve the differences, run:",
            "", f"    {rerun_command(command)}", "",
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


def _incomplete_section(c: Comparison) -> list[str]:
    """What an incomplete comparison lacks, which seeds its numbers use, how to finish it."""
    if c.results["complete"]:
        return []
    stopped = c.record.stopped_by
    why = f"stopped by {stopped}" if stopped else "it did not run to its end"
    lines = [f"**This comparison is incomplete**: {why}. Not finished:", "",
             *(f"- {m}" for m in c.results["missing"]), ""]
    seeds, planned = c.results["seeds"], ", ".join(map(str, c.record.seeds))
    if seeds and len(seeds) == len(c.record.seeds):  # only the baseline's runs at larger budgets are missing
        lines.append(f"Every design finished every seed ({planned}): the table below is whole. What is missing "
                     "are the baseline's runs at larger budgets; the multipliers use only the seeds whose runs at "
                     "every budget finished.")
    elif seeds:
        lines.append("The numbers below use only complete pairs: the seeds that every design "
                     f"finished ({', '.join(map(str, seeds))} of {planned}); the runs of the other "
                     "seeds are left out.")
    else:
        lines.append("No seed was finished by every design: there is nothing to compare yet.")
    if c.record.config is None:  # saved before compare.json held what --resume needs
        return [*lines, "", "It was saved before `attnres compare --resume` existed: run it again.", ""]
    return [*lines, "", f"To finish it: `attnres compare --resume {c.root}`", ""]


def _header(c: Comparison) -> list[str]:
    """The title, the data, budget and model every design shared, and the summary table."""
    first = c.runs[0]
    run, m = first["config"]["run"], first["config"]["model"]
    unit = "bits/byte" if first["config"]["data"]["tokenizer"] == "byte" else "bits/token"
    if m is None:  # a comparison --from a folder
        model = (f"Model: the {first['summary']['residual']} in `{c.record.init_from}` "
                 f"({first['summary']['parameters']:,} parameters), trained on as it is (`source`, the control) and "
                 f"converted to Delta AttnRes (each `convert` design, its routing starting as the identity). The "
                 f"seeds vary the data order of one source model: the intervals leave out the source's own variance.")
    else:
        model = (f"Model: dim {m['dim']}, {m['n_layers']} layers ({2 * m['n_layers']} sublayers), "
                 f"{m['n_heads']} heads, vocabulary {m['vocab_size']}{_moe_text(m)}.")
    return [
        "# Residual designs compared",
        "",
        *_incomplete_section(c),
        f"Data: {first['summary']['data']}{_digest_text(first['summary'])}. {_tokens_text(c)}",
        f"{model} Seeds: {', '.join(map(str, c.seeds))}. "
        f"Baseline: {c.baseline}. The numbers are also in `results.json`.",
        "",
        *_summary_lines(c.record.command, c.designs, c.results, unit),
        *_machines_note(c),
        *_data_note(c),
        *_packages_note(c),
        *_epsilon_note(c),
    ]


def _runs_by(c: Comparison, key) -> dict[str, list[str]]:
    """The runs (``"<design> seed <n>"``) grouped by ``key(summary)``; a run whose key is None
    (a field recorded only since) is left out."""
    groups: dict[str, list[str]] = {}
    for r in c.runs:
        k = key(r["summary"])
        if k is not None:
            groups.setdefault(k, []).append(f"{r['design']} seed {r['seed']}")
    return groups


def _machines_note(c: Comparison) -> list[str]:
    """When the runs come from more than one machine (``summary.json``'s ``machine``; a
    comparison continued elsewhere), which ran where: runs reproduce bit for bit on one machine
    only, so a pair split over machines differs by their arithmetic too."""
    def described(summary: dict) -> str:
        m = summary.get("machine") or {}
        return f"{m.get('id', 'unrecorded')} ({m.get('cpu', '?')}, {m.get('threads', '?')} threads)"

    where = _runs_by(c, described)
    if len(where) < 2:
        return []
    return ["", f"**The runs come from {len(where)} machines**: " + "; ".join(
        f"{m}: {', '.join(runs)}" for m, runs in where.items()) + ". Runs reproduce bit for bit on one machine "
        "only: a paired difference whose two runs ran on different machines holds the machines' difference too.", ""]


def _digest_text(summary: dict) -> str:
    """`` (data_sha256 X)`` for a run that recorded the digest of the tokens it read, else ''."""
    digest = summary.get("data_sha256")
    return f" (`data_sha256` {digest})" if digest else ""


def _data_note(c: Comparison) -> list[str]:
    """When the runs read different tokens (``summary.json``'s ``data_sha256``: a named corpus
    reads the same bytes everywhere, but ``data.source=stdlib`` is each machine's interpreter's
    library, and a comparison continued with ``--allow-mixed-data`` may hold both), which read
    which: their pairs then differ by their data too. Runs from before the digest was recorded
    are left out."""
    read = _runs_by(c, lambda summary: summary.get("data_sha256"))
    if len(read) < 2:
        return []
    return ["", f"**The runs read {len(read)} different corpora** (`data_sha256`): " + "; ".join(
        f"{d}: {', '.join(runs)}" for d, runs in read.items()) + ". A paired difference whose two runs read "
        "different data holds the data's difference too.", ""]


def _packages_note(c: Comparison) -> list[str]:
    """When the runs computed with different packages (``summary.json``'s ``machine``: the digest
    of the lock the environment was set up from, ``lock_sha256``, and the installed distributions
    that differ from it, ``unlocked``), which ran with which: their pairs then differ by the
    packages too (numpy, scipy, transformers, ...). Runs from before these were recorded are left out."""
    def described(summary: dict) -> str | None:
        m = summary.get("machine") or {}
        if m.get("lock_sha256") is None and m.get("unlocked") is None:
            return None
        differ = ", ".join(f"{name} {v['installed'] or 'not installed'} "
                           + (f"(locked {v['locked']})" if v["locked"] else "(not in the lock)")
                           for name, v in sorted((m.get("unlocked") or {}).items()))
        return f"lock {(m.get('lock_sha256') or 'unread')[:16]}, " + (f"unlocked {differ}" if differ else "as locked")

    ran = _runs_by(c, described)
    if len(ran) < 2:
        return []
    return ["", f"**The runs come from {len(ran)} sets of packages** (`lock_sha256`, `unlocked`): " + "; ".join(
        f"{p}: {', '.join(runs)}" for p, runs in ran.items()) + ". A paired difference whose two runs computed "
        "with different packages holds the packages' difference too.", ""]


def _epsilon_note(c: Comparison) -> list[str]:
    """Which ``norm_eps`` each design ran at, and where the defaults come from (the measurement
    behind them: docs/RESULTS.md, "Epsilon for every design: the default settled")."""
    ran = {}
    for r in c.runs:
        m = r["config"]["model"]
        if m is not None:
            ran.setdefault(f"{m['norm_eps']:g}" + (" (relative)" if m.get("norm_eps_scale") == "init" else ""),
                           []).append(r["design"])
    if not ran:
        return []
    at = "; ".join(f"{eps}: {', '.join(dict.fromkeys(names))}" for eps, names in ran.items())
    defaults = c.record.kind_norm_eps
    if defaults is None:  # planned before each kind had a default of its own
        return ["", f"Epsilon (`model.norm_eps`) by design: {at}. This comparison was planned when every design "
                    "took the shared epsilon unless its label gave one; since, each residual kind has its own "
                    "default (docs/RESULTS.md, \"Epsilon for every design\").", ""]
    kinds = "; ".join(f"{eps:g}: {', '.join(k for k, e in defaults.items() if e == eps)}"
                      for eps in dict.fromkeys(defaults.values()))
    return ["", f"Epsilon (`model.norm_eps`) by design: {at}. A design given none runs at its residual kind's "
                f"default ({kinds}), the value docs/RESULTS.md found best for it (\"Epsilon for every design\"): "
                "at 1e-6 the reads of Block (MHAR is a Block with heads) and Full are damped early (Full 0.058 and "
                "Block 0.025 nats worse, resolved over six seeds); at 1e-12 HC, mHC, GR and Delta end worse on the "
                "mean (+0.012 to +0.047 nats over three seeds, not resolved).", ""]


def _tokens_text(c: Comparison) -> str:
    """What the designs saw: the same training tokens, or (a run resumed to more steps by hand)
    which run saw how many, and that the pairs of unequal tokens are not compared."""
    first = c.runs[0]
    run = first["config"]["run"]
    counts = {r["summary"]["tokens"] for r in c.runs}
    if len(counts) == 1:
        return (f"Every design saw the same {first['summary']['tokens']:,} training tokens ({run['steps']} steps of "
                f"{run['batch_size']} x {run['seq_len']}) in the same order, from the same initial seed, and was "
                f"evaluated on the same {run['eval_batches']} validation batches.")
    seen = "; ".join(f"{r['design']}, seed {r['seed']}: {r['summary']['tokens']:,} ({r['summary']['steps']} steps)"
                     for r in c.runs)
    unequal = sorted(name for name, e in c.results["designs"].items() if e.get("unequal_tokens"))
    return (f"**The designs did not all see the same training tokens**: {seen}. A difference between runs of "
            f"unequal budgets measures the budget as well as the design: {', '.join(unequal) or 'none'} "
            f"{'is' if len(unequal) == 1 else 'are'} not compared with {c.baseline}. Each design was evaluated on "
            f"the same {run['eval_batches']} validation batches.")


def _options_section(c: Comparison) -> list[str]:
    """Each design's residual options, as ``--set`` takes them (none for an older comparison)."""
    options = {r["design"]: r.get("options") for r in c.runs if r.get("options")}
    if not options:
        return []
    lines = ["", "What each design ran with (its residual options, those given with `--set model.*` included):",
             "", "| design | residual | options |", "|---|---|---|"]
    for name, opts in options.items():
        kind = opts.get("residual", opts.get("design"))  # a comparison --from a folder: source or convert
        rest = ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"  # as --set takes it
                         for k, v in opts.items() if k not in ("residual", "design")) or "defaults"
        lines.append(f"| {name} | {kind} | {rest} |")
    return lines


def _loss_section(c: Comparison, plt) -> list[str]:
    """Why the runs' step times are left out, then the validation loss curves (``loss_curves.png``)."""
    plot_loss_curves(plt, c.designs, c.root / "loss_curves.png")
    return [
        "",
        "Step times are not reported from the runs: the designs train one after another on a shared machine, "
        "so their times move with the machine's load (0.4x to 1.25x between two identical runs). "
        "`benchmarks/train_step.py` times them interleaved, several rounds (`docs/BENCHMARKS.md`)"
        + ("; with `--budgets` the comparison times them so before training (below)." if c.results.get("budgets")
           else "."),
        "",
        "## Validation loss",
        "",
        "![validation loss](loss_curves.png)",
        "",
    ]


def _fmt_interval(low_high) -> str:
    return "" if low_high is None else f"[{low_high[0]:.2f}, {low_high[1]:.2f}]"


def _budget_section(c: Comparison, plt) -> list[str]:
    """With ``--budgets``: each design's compute-equivalent multiplier (``analysis.budget``) and
    the baseline's final loss against budget with each design marked where it lands
    (``budget.png``)."""
    budgets = c.results.get("budgets")
    if not budgets or len(budgets) < 2:
        return []
    base = c.record.baseline
    measured = {name: e["compute_equivalent"] for name, e in c.results["designs"].items() if "compute_equivalent" in e}
    if not measured:  # no seed's curve is whole: a table and a figure would be empty
        runs = [m for m in c.results["missing"] if m.startswith(f"{base}@x")]
        return ["## Compute-equivalent multiplier", "",
                f"No multiplier yet: {base}'s curve of final loss against budget needs, for a seed, its runs at "
                f"every budget ({', '.join(f'{b:g}' for b in budgets)}), and no seed has them all"
                + (f" ({'; '.join(runs)})" if runs else "") + ".", ""]
    used = sorted(next(iter(measured.values()))["per_seed"], key=int)
    plot_budget_curve(plt, c.results, base, c.root / "budget.png")
    lines = ["## Compute-equivalent multiplier", "",
             f"{base} also trained at {', '.join(f'{b:g}' for b in budgets)} times the budget (its runs "
             f"`{base}@x<multiple>`, out of the table above). A design's multiplier is the budget at which "
             f"{base}'s final loss reaches the design's, interpolated in log budget per seed; the geometric mean "
             "over seeds with a 95% Student-t interval on the log scale (`attnres/analysis/budget.py`). In wall-clock "
             "terms each budget is scaled by the design's step time relative to the baseline's, timed interleaved "
             "before training; those figures hold only on a quiet machine."
             + ("" if len(used) == len(c.results["seeds"]) else
                f" The multipliers use seed{'s' * (len(used) > 1)} {', '.join(used)}, whose runs at every budget "
                f"finished; the table above uses {', '.join(map(str, c.results['seeds']))}."), "",
             "| design | multiplier | 95% interval | in wall-clock terms | 95% interval | step time vs baseline |",
             "|---|---|---|---|---|---|"]
    for name, e in c.results["designs"].items():
        ce = e.get("compute_equivalent")
        if ce is None:
            continue
        ratio = ce.get("step_time_ratio")
        step = "" if ratio is None else f"{ratio:.3f} ({ce['step_time_ratio_range'][0]:.3f}..{ce['step_time_ratio_range'][1]:.3f})"
        if ce["budget"] is None:
            lines.append(f"| {name} | beyond the range ({ce['beyond']}) | | | | {step} |")
            continue
        time = "" if ce["time"] is None else f"{ce['time']:.3f}"
        lines.append(f"| {name} | {ce['budget']:.3f} | {_fmt_interval(ce['ci95'])} | {time} | "
                     f"{_fmt_interval(ce['time_ci95'])} | {step} |")
    return [*lines, "", "![final loss against budget](budget.png)", ""]


def _depth_weights_section(c: Comparison, plt) -> list[str]:
    """One heatmap of depth weights per design that routes over depth."""
    heat = [(n, rs[0]["analysis"]) for n, rs in c.designs.items()
            if rs[0]["analysis"] and rs[0]["analysis"].get("depth_weights")]
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
        plot_depth_weights(plt, name, analysis, c.root / fname)
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
    plot_expert_load(plt, loads, c.root / "expert_load.png")
    return lines


def _depth_growth_section(c: Comparison, plt) -> list[str]:
    """The hidden-state RMS at each read and the per-layer gradient norms, over depth (none for
    the folders' models of a comparison --from a folder, whose runs record neither)."""
    if not any(r["analysis"] or r["summary"].get("layer_grad_norms") for r in c.runs):
        return []
    plot_per_depth(plt, c.designs, lambda r: (r["analysis"] or {}).get("read_rms"), "RMS (mean over tokens)",
                   "Hidden-state RMS at each read, before its norm", "sublayer (last point: the output)",
                   c.root / "hidden_rms.png")
    plot_per_depth(plt, c.designs, lambda r: r["summary"].get("layer_grad_norms"), "gradient L2 norm",
                   "Per-layer gradient norm, mean over the last 10% of steps", "transformer layer",
                   c.root / "grad_norms.png")
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
    options, the validation loss, the compute-equivalent multipliers (with ``--budgets``), a
    conversion's shock and downstream answers (``--from``), the depth weights, the expert load, growth over depth, the width probe; for a comparison without
    a seed that every design finished, what it lacks."""
    plt = pyplot()
    c = load_comparison(compare_dir, baseline)
    if not c.runs:  # no seed finished by every design
        lines = ["# Residual designs compared", "", *_incomplete_section(c)]
    else:
        lines = [*_header(c), *_options_section(c), *_loss_section(c, plt), *_budget_section(c, plt),
                 *shock_section(c, plt), *downstream_section(c), *_depth_weights_section(c, plt), *_expert_load_section(c, plt),
                 *_depth_growth_section(c, plt), *_width_probe_section(c)]
    (c.root / "results.json").write_text(json.dumps(c.results, indent=2))
    path = c.root / "report.md"
    path.write_text("\n".join(lines))
    return path
