"""The comparison report's figures (PNG files): validation loss curves, depth-weight heatmaps,
expert load, and values over depth. Each takes ``matplotlib.pyplot`` (``pyplot``) and what it
draws, read from a comparison's saved files (``analysis.comparison``), and writes one file.
"""

from __future__ import annotations

import statistics

from .comparison import val_curve
from .conversion_stats import step_noise


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display); ``ValueError`` saying
    how to install it when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("the report's figures need matplotlib: pip install 'attnres[report]'") from None
    return plt


def save_figure(plt, fig, path) -> None:
    """``fig`` laid out and written to ``path`` (PNG, 120 dpi), then closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss_curves(plt, designs, path):
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
    save_figure(plt, fig, path)


def plot_depth_weights(plt, name, analysis, path):
    """One heatmap per head of a design's depth weights (``analysis["depth_weights"]``: site ->
    ``[N_sources][heads]``, the mean over validation tokens): routing sites by sources."""
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


def plot_expert_load(plt, loads, path):
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


def plot_per_depth(plt, designs, key, ylabel, title, xlabel, path):
    """One value per depth (``key`` of each design's first run: a list, or None where the run has
    none), a line per design on a log scale."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, runs in designs.items():
        values = key(runs[0])
        if values:
            ax.plot(range(len(values)), values, marker="o", ms=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(plt, fig, path)


def plot_budget_curve(plt, results, baseline, path):
    """The baseline's final loss against its budget (mean over seeds, each seed faint), with
    each design's mean final loss at budget 1 marked on the curve where it lands (its
    compute-equivalent multiplier), or at the edge where it lies beyond the measured range."""
    budgets = results["budgets"]
    base = results["designs"][baseline]["val_loss"]
    runs = results["budget_runs"]
    labels = [label for label in runs]
    seeds = [s for s in base if all(s in runs[label]["val_loss"] for label in labels)]
    curves = [[base[s], *(runs[label]["val_loss"][s] for label in labels)] for s in seeds]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for curve in curves:
        ax.plot(budgets, curve, color="C0", alpha=0.25, lw=1)
    if curves:
        ax.plot(budgets, [statistics.fmean(v) for v in zip(*curves)], color="C0", marker="o", label=f"{baseline}")
    for k, (name, e) in enumerate(results["designs"].items()):
        ce = e.get("compute_equivalent")
        if name == baseline or ce is None:
            continue
        x = ce["budget"] if ce["budget"] is not None else (budgets[0] if ce["beyond"].startswith("<") else budgets[-1])
        ax.scatter([x], [e["val_loss_mean"]], color=f"C{k + 1}", zorder=3,
                   label=f"{name}: {x:.2f}x" if ce["budget"] is not None else f"{name}: {ce['beyond']}")
    ax.set_xscale("log")
    ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax.set_xlabel(f"{baseline}'s budget (multiple of the steps)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)


def plot_first_steps(plt, curves: dict[str, dict[int, float]], seed: int, path, control: str | None = None):
    """Each design's training loss at every one of the first steps (design -> step -> loss), of
    one seed: a conversion's optimization shock shows as a gap to the control's curve. With
    ``control``, a second panel draws each other design's loss minus the control's, step by
    step, against the control's own noise (the standard deviation of its step-to-step changes,
    shaded): where the curves overlap to the eye the difference still shows."""
    with_diff = control in curves and len(curves) > 1
    fig, axes = plt.subplots(1, 2 if with_diff else 1, figsize=(12 if with_diff else 7, 4.2), squeeze=False)
    ax = axes[0][0]
    for k, (name, losses) in enumerate(curves.items()):
        steps = sorted(losses)
        ax.plot(steps, [losses[s] for s in steps], lw=1.2, label=name, color=f"C{k}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"The first {max(len(c) for c in curves.values())} steps, seed {seed}")
    ax.grid(alpha=0.3)
    ax.legend()
    if with_diff:
        bx, base = axes[0][1], curves[control]
        steps = sorted(base)
        noise = step_noise(base) or 0.0
        bx.axhspan(-noise, noise, color="0.5", alpha=0.15, label=f"{control}'s step-to-step noise (sd {noise:.3g})")
        for k, (name, losses) in enumerate(curves.items()):
            if name != control:
                common = [s for s in steps if s in losses]
                bx.plot(common, [losses[s] - base[s] for s in common], lw=1.2, label=name, color=f"C{k}")
        bx.set_xlabel("step")
        bx.set_ylabel(f"training loss - {control}'s (nats/token)")
        bx.set_yscale("symlog", linthresh=1e-6)
        bx.set_title(f"Difference to {control}, seed {seed}")
        bx.grid(alpha=0.3)
        bx.legend(fontsize=8)
    save_figure(plt, fig, path)
