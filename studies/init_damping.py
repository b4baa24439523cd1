"""How much RMSNorm's epsilon damps AttnRes reads at initialization (docs/RESULTS.md, hypothesis 2).

With zero pseudo-queries every routing weight is uniform, so a Full AttnRes read is
``RMSNorm(mean of its sources)`` where PreNorm's is ``RMSNorm(sum of the same sources)``: equal
but for epsilon, since ``mean = sum / n`` and ``x / sqrt(ms(x) + eps)`` is scale-free only when
``eps << ms(x)``. Loading PreNorm's initial weights into Full and Block therefore isolates what
epsilon does at step 0. For each epsilon this prints, on validation tokens of the study preset's
model:

  logit gap    max |logits(design) - logits(PreNorm)| and that over the std of PreNorm's logits
  damping      sqrt(ms / (ms + eps)) of each read before its norm (1 = undamped), min and mean
               over the routing sites, where ms is the read's mean square

    python studies/init_damping.py [--data SOURCE]

``--data``: the corpus of the validation tokens (default: the study preset's; docs/RESULTS.md's
figures read ``stdlib``).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from attnres import ModelConfig, Transformer
from attnres.streams import Trace
from attnres.train.config import study
from attnres.train.data import EVAL_SEED, batch_at, load_corpus


def model_like(prenorm: Transformer, residual: str, eps: float) -> Transformer:
    """``prenorm``'s weights in a model of ``residual`` with norm epsilon ``eps`` (the stream's
    own parameters at their initialization: uniform routing)."""
    config = dataclasses.replace(prenorm.config, residual=residual, norm_eps=eps)
    model = Transformer(config)
    missing, unexpected = model.load_state_dict(prenorm.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("stream.") for name in missing), (missing, unexpected)
    return model.eval()


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="data.source of the validation tokens (default: the study preset's)")
    args = parser.parse_args()
    cfg = study()
    if args.data:
        cfg.data.source = args.data
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    tokens, _ = batch_at(corpus.val, 4, cfg.run.seq_len, EVAL_SEED, 0)
    torch.manual_seed(0)
    base = Transformer(ModelConfig(**{**dataclasses.asdict(cfg.model), "residual": "prenorm"})).eval()
    print(f"# dim {cfg.model.dim}, {cfg.model.n_layers} layers, init_std {cfg.model.init_std}; "
          f"validation tokens {tuple(tokens.shape)}")
    print("design   eps      logit_gap  gap/std  damping_min  damping_mean")
    for eps in (1e-6, 1e-12):
        reference = model_like(base, "prenorm", eps)
        ref_logits = reference(tokens)
        for residual in ("prenorm", "block", "full"):
            model = model_like(base, residual, eps)
            trace = Trace()
            logits = model(tokens, trace=trace)
            gap = (logits - ref_logits).abs().max().item()
            damping = [float((ms / (ms + eps)).sqrt().mean())
                       for ms in (r.double() ** 2 for r in trace.read_rms.values())]
            print(f"{residual:8s} {eps:<8.0e} {gap:9.2e}  {gap / ref_logits.std().item():7.3f}  "
                  f"{min(damping):11.4f}  {sum(damping) / len(damping):12.4f}")


if __name__ == "__main__":
    main()
