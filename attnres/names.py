"""The names the command line offers, in a module that imports nothing: the designs a comparison
trains (with each one's model options), the training presets, what each comparison preset
compares, and the named corpora. ``attnres --help``, every subcommand's help and the refusal of an unknown name read them
here, so that they answer before PyTorch loads (seconds); ``experiments/designs.py`` and
``train/config.py``, which act on the names, take them from here too: each list is written once.
"""

#: a comparison's designs: label -> model options (``ModelConfig`` fields); "n_kv_heads" stands
#: for the model's number of KV heads (``experiments/designs.py``, ``design_options``)
DESIGNS: dict[str, dict] = {
    "prenorm": dict(residual="prenorm"),
    "block": dict(residual="block", num_blocks=8),
    "mhar": dict(residual="block", num_blocks=8, heads="n_kv_heads"),
    "full": dict(residual="full"),
    "mhc": dict(residual="mhc"),
    "gr": dict(residual="gr"),
    "hc": dict(residual="hc"),
    "delta": dict(residual="delta", num_blocks=8, heads="n_kv_heads"),
    "denseformer": dict(residual="denseformer"),
}
#: the designs of ``attnres compare --from MODEL_DIR``: the folder's model trained as it is (the
#: control), and its Delta AttnRes conversion, whose options (``convert:heads=2:block_layers=1``)
#: are ``attnres convert``'s ``--heads`` and ``--block-layers``, with these defaults
FOLDER_DESIGNS = ("source", "convert")
CONVERT_DEFAULTS = {"heads": 8, "block_layers": 4}
#: what ``attnres compare`` trains when neither ``--designs`` nor its preset names the designs
DEFAULT_DESIGNS = ("prenorm", "block", "mhar", "full", "mhc", "gr")

#: the training presets, each made by the function of its name in ``train/config.py``
PRESET_NAMES = ("tiny", "demo", "small", "study", "ablations", "regime")
#: the rows of the AttnRes paper's ablation table (its Table 4) that run at the study's size, as
#: designs of a comparison (docs/RESULTS.md maps each to its row): the baseline, Full and its
#: switches, Block (8 blocks of 2 sublayers) and its switches, the block-size sweep and the
#: mixing rules without a pseudo-query
ABLATIONS = (
    "prenorm", "full", "full:query=input", "full:score=sigmoid", "full:key_norm=false", "full:mixing=learned",
    "full:window=8", "block", "block:block_size=4", "block:block_size=8", "block:block_size=16", "block:heads=16",
    "block:key_norm=false", "denseformer",
)
#: the regime's designs, each at the learning rate its grid chose and fresh seeds confirmed;
#: ``attnres train --preset regime`` trains a model that is one of them at its rate too
REGIME_DESIGNS = ("prenorm:lr=8e-3", "block:lr=5e-3", "mhar:lr=3e-3", "full:lr=2e-3")
#: what ``attnres compare --preset NAME`` compares when --designs and --seeds are not given
#: (others: ``DEFAULT_DESIGNS``, seed 0)
COMPARISON_PRESETS = {
    "study": {"designs": ("prenorm", "block", "mhar", "full"), "seeds": (0, 1, 2, 3, 4, 5)},
    "ablations": {"designs": ABLATIONS, "seeds": (0, 1, 2)},
    # each design at its own learning rate (docs/RESULTS.md, "Each design's learning rate": the
    # grid's best over seeds 0-1, confirmed on seeds 2-3), on the seeds that chose nothing
    "regime": {"designs": REGIME_DESIGNS, "seeds": tuple(range(4, 16))},
}

#: the named, versioned corpora (``train/frozen_corpus.py`` defines each), the first the default
#: ``data.source``; ``attnres corpus NAME`` fetches one
CORPUS_NAMES = ("sdists-v1",)
