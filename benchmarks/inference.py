"""Inference latency of the reference LM for each residual design, against PreNorm.

Prefill: batch 1, a 1024-token prompt, one forward (no_grad). Decode: batch 1 and 8 (``--batch``),
128 tokens generated one at a time after a 1024-token prompt, with the KV cache (the residual
state is per token, so nothing else is cached); the variants decode token by token in turn, each
from its own cache (all held at once: about 0.3 GB per variant at batch 8), and a round's time is
the sum over its tokens. Same model as
benchmarks/train_step.py; ratios per round against ``prenorm`` in the same run.

``--hf``: a Llama of the same shapes (``transformers``, random weights) and its Delta AttnRes
conversion (``attnres convert``'s model: 8 heads, blocks of 2 layers), greedy ``generate`` with
the Hugging Face cache, batch 1, a 256-token prompt and 64 new tokens, whole calls in turn; then
the same greedy steps (a forward of the next token with the Hugging Face cache) token by token,
the two models in turn; ratios per round against the source model.

    python benchmarks/inference.py
    python benchmarks/inference.py --variants prenorm block mhar --rounds 7 --hf
    python benchmarks/inference.py --revisions 7483a66   # and the same variants at a git revision (block@REV)
    python benchmarks/inference.py --hf-only --rounds 15  # only the converted Llama against its source

With ``--revisions``, a second table (``NAME_against.csv``) gives each design's prefill and decode
against the same design at each revision: the median and min..max of the per-round ratios.

glibc's malloc makes prefill timings depend on its heap state (see docs/BENCHMARKS.md); to time
without page-fault churn, fix its thresholds in the environment:

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 python benchmarks/inference.py

The table header names the settings; a run with them writes ``inference_malloc_fixed.csv``.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    against_revisions,
    allocator,
    import_revision,
    interleaved,
    machine,
    print_table,
    ratio_summary,
    ratio_to_own_baseline,
    span,
    split_variant,
    with_revisions,
    write_csv,
)
from train_step import SIZES, VARIANTS  # noqa: E402

import attnres  # noqa: E402


def build(variant, prompt_len, new_tokens):
    torch.manual_seed(0)
    name, rev = split_variant(variant)
    package = attnres if rev is None else import_revision(rev)
    config = package.ModelConfig(**{**SIZES, "max_seq_len": prompt_len + new_tokens}, **VARIANTS[name])
    model = package.Transformer(config).eval()
    with torch.no_grad():
        if hasattr(model.stream, "pseudo_queries"):
            model.stream.pseudo_queries.normal_(0, 0.02)
    prompt = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def prefill():
        model(prompt)

    @torch.no_grad()
    def decoder(batch: int = 1):
        """After the prompt's prefill (not timed), a function that decodes the next token and
        returns its seconds."""
        prompts = prompt.expand(batch, -1)
        cache = model.new_cache(batch, prompt_len + new_tokens)
        model(prompts, cache=cache, start_pos=0)
        state = dict(token=prompts[:, -1:], pos=prompt_len)
        # each token a decode pass, as generate runs it (a revision without the flag inferred it)
        decode = {"decode": True} if "decode" in inspect.signature(model.forward).parameters else {}

        @torch.no_grad()
        def step() -> float:
            start = time.perf_counter()
            logits = model(state["token"], cache=cache, start_pos=state["pos"], **decode)
            state["token"] = logits[:, -1].argmax(-1, keepdim=True)
            state["pos"] += 1
            return time.perf_counter() - start

        return step

    return prefill, decoder


HF_NEW_TOKENS = 64


def hf_models(prompt_len: int = 256, new_tokens: int = HF_NEW_TOKENS) -> tuple[dict, torch.Tensor]:
    """``({"hf-llama": source, "hf-llama-attnres": its conversion}, prompt)``: a Llama shaped
    like ``SIZES`` (random weights) and its Delta AttnRes conversion with live routing."""
    import transformers

    from attnres.hf import convert

    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=SIZES["vocab_size"], hidden_size=SIZES["dim"], intermediate_size=SIZES["ffn_dim"],
        num_hidden_layers=SIZES["n_layers"], num_attention_heads=SIZES["n_heads"],
        num_key_value_heads=SIZES["n_kv_heads"], max_position_embeddings=prompt_len + new_tokens)).eval()
    converted = convert(source, heads=8, block_layers=2).eval()
    with torch.no_grad():  # live routing, as after some training
        converted.routing.pseudo_queries.normal_(0, 0.02)
    prompt = torch.randint(0, SIZES["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    return {"hf-llama": source, "hf-llama-attnres": converted}, prompt


def hf_generate_calls(models: dict, prompt: torch.Tensor, new_tokens: int = HF_NEW_TOKENS) -> dict:
    """Greedy ``generate`` of each model; each call returns its seconds per generated token."""
    prompt_len = prompt.shape[1]

    def timed(model):
        def call():
            start = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            assert out.shape[1] == prompt_len + new_tokens
            return (time.perf_counter() - start) / new_tokens
        return call

    return {name: timed(model) for name, model in models.items()}


def hf_stepper(model, prompt: torch.Tensor):
    """After the prompt's prefill with the Hugging Face cache (not timed), a function that takes
    the next greedy step (the step ``generate`` repeats) and returns its seconds."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
    state = dict(past=out.past_key_values, token=out.logits[:, -1:].argmax(-1))

    @torch.no_grad()
    def step() -> float:
        start = time.perf_counter()
        out = model(state["token"], past_key_values=state["past"], use_cache=True)
        state["past"], state["token"] = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - start

    return step


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="*", default=["prenorm", "block", "mhar", "full", "delta", "hc", "mhc", "gr"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes (default: 1 8)")
    p.add_argument("--hf", action="store_true", help="also time a converted Llama's generate against its source")
    p.add_argument("--hf-only", action="store_true",
                   help="time only that (--hf), over --rounds rounds; --variants, --revisions and --batch do not apply")
    p.add_argument("--revisions", nargs="*", default=[], metavar="REV",
                   help="also run every variant on the package at these git revisions")
    p.add_argument("--csv", help="name of the results file under benchmarks/results/ (default: inference, "
                                 "inference_malloc_fixed with the thresholds fixed, then @REV for each revision)")
    args = p.parse_args()
    variants = list(dict.fromkeys(["prenorm", *args.variants]))
    variants = with_revisions(variants, args.revisions)
    if args.hf_only:
        print(f"# converted Llama against its source: {SIZES}, prompt 256, {HF_NEW_TOKENS} new tokens; {machine()}")
        return hf_table(args, args.csv or "inference")
    print(f"# inference: {SIZES}, prompt {args.prompt}, decode {args.new_tokens}; {machine()}")
    built = {v: build(v, args.prompt, args.new_tokens) for v in variants}
    measured = {"prefill": interleaved({v: b[0] for v, b in built.items()}, args.rounds, warmup=1)}
    pre = ratio_to_own_baseline(measured["prefill"], "prenorm")
    dec = {}
    for batch in args.batch:
        dec_times = {v: [] for v in variants}
        for _ in range(args.rounds):
            # every variant decodes its next token in turn, so that the machine's drift over a
            # round falls on all of them alike; a round's time is the sum of its tokens'
            steps = {v: b[1](batch) for v, b in built.items()}
            spent = dict.fromkeys(variants, 0.0)
            for _ in range(args.new_tokens):
                for v, step in steps.items():
                    spent[v] += step()
            for v in variants:
                dec_times[v].append(spent[v])
            del steps
        dec[batch] = ratio_to_own_baseline(dec_times, "prenorm")
        measured[f"decode_b{batch}"] = dec_times
    rows = []
    for v in variants:
        row = dict(variant=v, prefill_ms=1000 * pre[v]["median_s"], prefill_vs_prenorm=pre[v]["ratio"],
                   prefill_spread=span(pre[v]["ratio_min"], pre[v]["ratio_max"]))
        for batch, d in dec.items():
            suffix = "" if batch == 1 else f"_b{batch}"
            row |= {f"decode_ms_per_token{suffix}": 1000 * d[v]["median_s"] / args.new_tokens,
                    f"decode_vs_prenorm{suffix}": d[v]["ratio"],
                    f"decode_spread{suffix}": span(d[v]["ratio_min"], d[v]["ratio_max"])}
        rows.append(row)
    print_table(rows, list(rows[0]))
    name = "inference" if allocator() == "malloc defaults" else "inference_malloc_fixed"
    name = args.csv or name + "".join(f"@{rev}" for rev in args.revisions or ())
    write_csv(name, rows)
    if args.revisions:
        compared = against_revisions(measured)
        print_table(compared, list(compared[0]))
        write_csv(f"{name}_against", compared)
    if args.hf:
        del built
        hf_table(args, name)


def hf_table(args, name: str) -> None:
    """Time the converted Llama against its source: whole greedy ``generate`` calls in turn, then
    the same greedy steps token by token in turn (each model from its own cache, so that the
    machine's drift falls on both alike); write ``NAME_hf.csv``."""
    models, prompt = hf_models()
    calls = hf_generate_calls(models, prompt)
    for call in calls.values():  # warm-up
        call()
    per_token = {v: [] for v in calls}
    for _ in range(args.rounds):
        for v, call in calls.items():
            per_token[v].append(call())
    stepped = {v: [] for v in models}
    for _ in range(args.rounds):
        steps = {v: hf_stepper(model, prompt) for v, model in models.items()}
        spent = dict.fromkeys(models, 0.0)
        for _ in range(HF_NEW_TOKENS):
            for v, step in steps.items():
                spent[v] += step()
        for v in models:
            stepped[v].append(spent[v] / HF_NEW_TOKENS)
    hf_rows = []
    for label, times in (("generate", per_token), ("greedy step, token by token", stepped)):
        for v, r in ratio_summary(times, "hf-llama").items():
            hf_rows.append(dict(timing=label, variant=v, ms_per_token=1000 * r["median_s"], vs_source=r["ratio"],
                                spread=span(r["ratio_min"], r["ratio_max"])))
    print_table(hf_rows, list(hf_rows[0]))
    write_csv(f"{name}_hf", hf_rows)


if __name__ == "__main__":
    main()
