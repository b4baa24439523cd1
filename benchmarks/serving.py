"""Serving throughput with vLLM (``attnres.serving``), offline, many prompts of mixed lengths:

- a converted model (Delta AttnRes around a Llama) against its source Llama, both in vLLM, in
  one run: time per generated token, median of interleaved rounds and the ratio's spread (the
  paper reports under 2% for inference; the target here is <= 1.05x);
- vLLM against our own ``Transformer.generate`` on the same requests, for attnres's own Block
  model: ``generate`` takes one batch of prompts of one length, so it decodes each request alone.

Models: Llama-shaped, dim 512, 8 layers, 8 heads of 64, KV heads 8, MLP 1536, vocab 256 (the
byte tokenizer); the converted one with 8 routing heads in blocks of 2 layers; the native Block
model at the same width and depth. Requests: ``--prompts`` prompts of 8..``--max-prompt`` tokens
(seeded), ``--max-tokens`` greedy tokens each. vLLM runs in the serving environment
(``make serve-setup``), eager, fp32, on the CPU.

    python benchmarks/serving.py [--rounds 3] [--prompts 32] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# benchmarks/kernels.py would shadow the package ``kernels`` that transformers imports: transformers
# is imported with this folder off the path, then the folder goes back for ``common``
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
import attnres.hf  # noqa: E402,F401

sys.path.insert(0, str(HERE))
from common import REPO, print_table, write_csv  # noqa: E402

SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"
WIDTH = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, head_dim=64)


def build_folders(root: Path) -> dict[str, Path]:
    """The source Llama, its conversion, and a native Block model, saved with the byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnres.hf import AttnResConfig, AttnResForCausalLM, byte_tokenizer, convert_checkpoint
    from attnres.model import ModelConfig

    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(vocab_size=256, max_position_embeddings=1024, **WIDTH))
    source.save_pretrained(root / "llama")
    byte_tokenizer().save_pretrained(root / "llama")
    convert_checkpoint(root / "llama", root / "llama-attnres", heads=8, block_layers=2)
    native = AttnResForCausalLM(AttnResConfig.from_model_config(ModelConfig(
        vocab_size=256, dim=512, n_layers=8, n_heads=8, ffn_dim=1536, max_seq_len=1024, residual="block",
        block_size=4)))
    native.save_pretrained(root / "block")
    byte_tokenizer().save_pretrained(root / "block")
    return {"llama": root / "llama", "llama-attnres": root / "llama-attnres", "block": root / "block"}


def requests(count: int, longest: int, max_tokens: int) -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, longest + 1, (count,), generator=g).tolist()
    return {"prompts": [torch.randint(1, 256, (n,), generator=g).tolist() for n in lengths], "max_tokens": max_tokens}


def time_generate(folder: Path, spec: dict, rounds: int) -> list[float]:
    """Seconds per round of ``Transformer.generate`` on every request, each alone (a warm-up first)."""
    from attnres.hf import AttnResForCausalLM

    model = AttnResForCausalLM.from_pretrained(folder).model.eval()
    times = []
    with torch.no_grad():
        for r in range(rounds + 1):
            start = time.perf_counter()
            for prompt in spec["prompts"]:
                model.generate(torch.tensor([prompt]), spec["max_tokens"])
            if r:
                times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if not SERVE_PYTHON.exists():
        raise SystemExit(f"{SERVE_PYTHON} does not exist: run `make serve-setup` first")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = build_folders(root)
        spec = requests(args.prompts, args.max_prompt, args.max_tokens)
        (root / "requests.json").write_text(json.dumps(spec))
        subprocess.run([str(SERVE_PYTHON), str(Path(__file__).parent / "serving_worker.py"), str(root / "vllm.json"),
                        str(root / "requests.json"), str(args.rounds), str(1 << 29), *map(str, folders.values())],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        vllm = {name: json.loads((root / "vllm.json").read_text())[str(f)] for name, f in folders.items()}
        ours = time_generate(folders["block"], spec, args.rounds)
    tokens = args.prompts * args.max_tokens
    rows = []
    for name, times, baseline, engine in [("llama", vllm["llama"], vllm["llama"], "vllm"),
                                          ("llama-attnres", vllm["llama-attnres"], vllm["llama"], "vllm"),
                                          ("block", vllm["block"], vllm["block"], "vllm"),
                                          ("block", ours, vllm["block"], "Transformer.generate")]:
        ratios = [t / b for t, b in zip(times, baseline)]
        rows.append(dict(model=name, engine=engine, median_s=statistics.median(times),
                         ms_per_token=1000 * statistics.median(times) / tokens, tokens_per_s=tokens / statistics.median(times),
                         ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios)))
    print_table(rows, list(rows[0]))
    print(write_csv("serving", rows))


if __name__ == "__main__":
    main()
