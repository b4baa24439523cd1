"""The models of ``attnres compare --from SOURCE``: the folder's model as it is (the control,
design ``source``) and its Delta AttnRes conversions (``convert:heads=H:block_layers=L``), each
written once into the comparison's ``models/`` and read from there by every seed and on a resume.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import architectures
from ..analysis.comparison import label_path
from ..hf.convert import convert_checkpoint
from ..hf.training import read_config, saved_model
from ..streams.delta import check_routing_options
from ..train.saved_model import SavedModel, check_fits
from ..train.source_digest import folder_digest
from .designs import parse_folder_design


class ComparisonFolders:
    """The models of ``attnres compare --from SOURCE`` (``experiments.compare``'s ``folders``): design
    ``source`` is the folder's model as it is; each ``convert[:heads=H][:block_layers=L]`` is its
    Delta conversion, written once (``convert_checkpoint``) into ``ROOT/models/<label>`` and read
    from there by every seed and on a resume."""

    def __init__(self, source: str | Path):
        self.source = Path(source).expanduser().resolve()
        self.config = read_config(self.source)
        #: the source folder's digest, which the comparison records (``TrainConfig.init_from_digest``)
        self.digest = folder_digest(self.source)

    def check(self, options: dict[str, dict], base) -> None:
        """Refuse, before any work, a source ``convert`` does not take, a conversion's options
        that do not fit its model (``options``: label -> ``{"design", "heads", "block_layers"}``)
        and settings of the comparison's config ``base`` the folder cannot serve (a sequence
        past its context, its tokenizer when it has none); a conversion keeps both."""
        source = saved_model(self.source)
        check_fits(dataclasses.replace(base, init_from=str(self.source)), source)
        if self.config.model_type not in architectures.SOURCES:
            raise ValueError(f"--from {self.source}: model_type={self.config.model_type!r}; a comparison converts its "
                             f"source, one of {sorted(architectures.SOURCES)} (attnres convert's)")
        for label, values in options.items():
            if values["design"] == "convert":
                given = {part.partition("=")[0] for part in label.split(":")[1:]}
                try:
                    check_routing_options(self.config, values["heads"], values["block_layers"],
                                          [name for name in ("heads", "block_layers") if name not in given])
                except ValueError as err:
                    raise ValueError(f"design {label!r}: {err}") from None

    def __call__(self, label: str, root: Path) -> SavedModel:
        name, options = parse_folder_design(label)
        if name == "source":
            return saved_model(self.source)
        folder = Path(root) / "models" / label_path(label)
        if not (folder / "config.json").is_file():  # written whole or not at all (convert_checkpoint)
            convert_checkpoint(self.source, folder, heads=options["heads"], block_layers=options["block_layers"])
        return saved_model(folder)
