"""The comparison report: a Markdown page with PNG figures, rebuilt from saved artifacts.

A comparison folder holds one sub-folder per run (``<design>`` or ``<design>-seed<k>``) with
``config.json``, ``summary.json``, ``metrics.jsonl`` and ``analysis.json``; ``compare.json``
lists them in order. Every number in the report is read from those files.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..files import read_json, read_jsonl


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("the report's figures need matplotlib: pip install 'attnres[report]'") from None
    return plt


def load_runs(compare_dir: Path) -> tuple[dict, list[dict]]:
    compare_dir = Path(compare_dir)
    index_path = compare_dir / "compare.json"
    if not index_path.exists():
        raise ValueError(f"{compare_dir} is not a comparison folder: compare.json is missing")
    index = read_json(index_path)
    runs = []
    for entry in index["runs"]:
        d = compare_dir / entry["dir"]
        missing = [n for n in ("summary.json", "metrics.jsonl", "config.json") if not (d / n).exists()]
        if missing:
            raise ValueError(f"run {d} is incomplete: {missing} missing")
        run = dict(entry)
        run["summary"] = read_json(d / "summary.json")
        run["config"] = read_json(d / "config.json")
        run["metrics"] = read_jsonl(d / "metrics.jsonl")
        analysis = d / "analysis.json"
        run["analysis"] = read_json(analysis) if analysis.exists() else None
        runs.append(run)
    return index, runs


def _by_design(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for run in runs:
        out.setdefault(run["design"], []).append(run)
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def _fig_loss_curves(plt, designs, path):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, runs in designs.items():
        for k, run in enumerate(runs):
            pts = [(m["tokens"], m["val_loss"]) for m in run["metrics"] if m["split"] == "val"]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", ms=3, label=name if k == 0 else None,
                        color=f"C{list(designs).index(name)}", alpha=1.0 if k == 0 else 0.5)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Validation loss")
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
    for h in range(heads):
        ax = axes[0, h]
        im = ax.imshow(grid[h], vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_yticks(range(len(sites)), labels if h == 0 else [""] * len(sites), fontsize=7)
        ax.set_xlabel("source (0 = embedding)")
        ax.set_title(f"head {h}" if heads > 1 else name)
    fig.colorbar(im, ax=axes[0, -1], fraction=0.05)
    fig.suptitle(f"{name}: depth weights, mean over validation tokens", fontsize=10)
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


def write_report(compare_dir: Path) -> Path:
    """(Re)build ``compare_dir/report.md`` and its figures from the saved artifacts."""
    compare_dir = Path(compare_dir)
    plt = _matplotlib()
    index, runs = load_runs(compare_dir)
    designs = _by_design(runs)
    baseline = "prenorm" if "prenorm" in designs else next(iter(designs))
    byte_tokens = runs[0]["config"]["data"]["tokenizer"] == "byte"
    unit = "bits/byte" if byte_tokens else "bits/token"
    base_loss = _mean(r["summary"]["final_val_loss"] for r in designs[baseline])
    base_step = _mean(r["summary"]["step_time_s"] for r in designs[baseline])
    first = runs[0]
    tokens = first["summary"]["tokens"]
    m = first["config"]["model"]
    seeds = sorted({r["seed"] for r in runs})

    lines = [
        "# Residual designs compared",
        "",
        f"Data: {first['summary']['data']}. Every design saw the same {tokens:,} training tokens "
        f"({first['config']['run']['steps']} steps of {first['config']['run']['batch_size']} x "
        f"{first['config']['run']['seq_len']}) in the same order, from the same initial seed, and was "
        f"evaluated on the same {first['config']['run']['eval_batches']} validation batches.",
        f"Model: dim {m['dim']}, {m['n_layers']} layers ({2 * m['n_layers']} sublayers), "
        f"{m['n_heads']} heads, vocabulary {m['vocab_size']}. Seeds: {', '.join(map(str, seeds))}.",
        "",
    ]
    if len(seeds) > 1:
        spread = [statistics.pstdev([r["summary"]["final_val_loss"] for r in rs]) for rs in designs.values() if len(rs) > 1]
        noise = max(spread) if spread else float("nan")
        lines.append(f"Seed noise (largest standard deviation of validation loss across seeds): {noise:.4f} nats. "
                     "Differences smaller than that mean nothing.")
    else:
        lines.append("One seed per design: differences smaller than the seed-to-seed noise mean nothing, and "
                     "this run cannot measure that noise (rerun with `--seeds 0 1` to see it).")
    lines += [
        "",
        f"| design | val loss (nats) | {unit} | vs {baseline} | parameters | tokens/s | step time vs {baseline} | peak memory (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in designs.items():
        loss = _mean(r["summary"]["final_val_loss"] for r in rs)
        s0 = rs[0]["summary"]
        lines.append(
            f"| {name} | {loss:.4f} | {loss / math.log(2):.4f} | {loss - base_loss:+.4f} | {s0['parameters']:,} | "
            f"{_mean(r['summary']['tokens_per_s'] for r in rs):,.0f} | "
            f"{_mean(r['summary']['step_time_s'] for r in rs) / base_step:.2f}x | "
            f"{_mean(r['summary']['peak_memory_mib'] for r in rs):,.0f} |"
        )
    options = {r["design"]: r.get("options") for r in runs if r.get("options")}
    if options:
        lines += ["", "What each design ran with (its residual options, those given with `--set model.*` included):",
                  "", "| design | residual | options |", "|---|---|---|"]
        for name, opts in options.items():
            rest = ", ".join(f"{k}={v}" for k, v in opts.items() if k != "residual") or "defaults"
            lines.append(f"| {name} | {opts['residual']} | {rest} |")
    lines += [
        "",
        "Step times were measured one design after another on a shared machine; the benchmarks "
        "(`benchmarks/`) measure overheads properly, interleaved.",
        "",
        "## Validation loss",
        "",
        "![validation loss](loss_curves.png)",
        "",
    ]
    _fig_loss_curves(plt, designs, compare_dir / "loss_curves.png")

    heat = [(n, rs[0]["analysis"]) for n, rs in designs.items() if rs[0]["analysis"] and rs[0]["analysis"]["depth_weights"]]
    if heat:
        lines += ["## Depth weights", "",
                  "Rows are routing sites (sublayers, then the output), columns the sources they route over: "
                  "column 0 is the embedding; for Full AttnRes column j is sublayer j-1's output; for Block "
                  "AttnRes the columns are the completed blocks in order, and the last filled cell of a row in "
                  "the middle of a block is the partial sum of that block.", ""]
        for name, analysis in heat:
            fname = f"depth_weights_{name}.png"
            _fig_depth_weights(plt, name, analysis, compare_dir / fname)
            lines += [f"![{name} depth weights]({fname})", ""]

    fig, ax = _fig_per_depth(
        plt, designs, lambda r: (r["analysis"] or {}).get("read_rms"), "RMS (mean over tokens)",
        "Hidden-state RMS at each read, before its norm", None, logy=True)
    ax.set_xlabel("sublayer (last point: the output)")
    fig.tight_layout()
    fig.savefig(compare_dir / "hidden_rms.png", dpi=120)
    plt.close(fig)
    fig, ax = _fig_per_depth(
        plt, designs, lambda r: r["summary"].get("layer_grad_norms"), "gradient L2 norm",
        "Per-layer gradient norm, mean over the last 10% of steps", None, logy=True)
    ax.set_xlabel("transformer layer")
    fig.tight_layout()
    fig.savefig(compare_dir / "grad_norms.png", dpi=120)
    plt.close(fig)
    lines += [
        "## Hidden-state growth over depth", "",
        "PreNorm's running sum grows with depth, diluting each new sublayer's contribution; "
        "AttnRes reads a normalized mix instead. For multi-stream designs the value is the mixed read.", "",
        "![hidden-state RMS](hidden_rms.png)", "",
        "## Gradient norms per layer", "",
        "![gradient norms](grad_norms.png)", "",
    ]
    probes = [(n, rs[0]["analysis"]["width_probe"]) for n, rs in designs.items()
              if rs[0]["analysis"] and rs[0]["analysis"].get("width_probe")]
    if probes:
        lines += ["## Width disagreement (single-head models)", "",
                  "Each trained single-head query is split into slices, each slice routes with its own "
                  "softmax over the same sources, and the mean KL(slice || shared) is compared with a random "
                  "query of equal norm. A positive probe says the width wants to route differently per slice: "
                  "the case for multi-head routing.", "",
                  "| design | slices | KL trained | KL random | probe |", "|---|---|---|---|---|"]
        for name, p in probes:
            lines.append(f"| {name} | {p['slices']} | {p['trained']:.4f} | {p['random']:.4f} | {p['probe']:+.4f} |")
        lines.append("")
    path = compare_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
