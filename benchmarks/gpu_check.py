"""GPU checks in one script: parity, compile, and the GPU benchmarks (run whenever a GPU is at hand).

1. parity on CUDA: the Triton kernels against the naive reference, fp32 and bf16, forward and
   gradients (read, multi-query + merge, Block stream);
2. the Triton ops under ``torch.compile(fullgraph=True)`` on a small Block AttnRes model;
3. routing forward+backward: Triton Block (8 blocks) vs ``torch.compile(naive)``, 16k tokens,
   D=2048, 32 sublayers, bf16;
4. training throughput of Block AttnRes vs PreNorm: reference LM dim 1024, 16 layers, seq 1024,
   batch 8, bf16 autocast.

    python benchmarks/gpu_check.py [--out results.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing import CheapStack  # noqa: E402

from attnres import ModelConfig, Transformer, param_groups  # noqa: E402
from attnres.ops import backend, depth_attention  # noqa: E402


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def parity(dtype):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    dim, n, heads = 1024, 9, 8
    sources = [torch.randn(4096, dim, device=dev, generator=g).to(dtype).requires_grad_() for _ in range(n)]
    q = (0.05 * torch.randn(dim, device=dev, generator=g)).requires_grad_()
    k = (1 + 0.1 * torch.randn(dim, device=dev, generator=g)).requires_grad_()
    out = {}
    a = depth_attention(q, sources, k, heads=heads, backend="triton")
    b = depth_attention(q, [s.float() for s in sources], k, heads=heads, backend="naive")
    cot = torch.randn_like(b)
    ga = torch.autograd.grad(a.float(), [q, k, *sources], cot)
    gb = torch.autograd.grad(b, [q, k, *sources], cot)
    out["read_forward"] = rel_err(a, b)
    out["read_grads"] = max(rel_err(x, y) for x, y in zip(ga, gb))
    qs = (0.05 * torch.randn(4, dim, device=dev, generator=g)).requires_grad_()
    triton = backend("triton")
    o1, lse1 = triton.attend(qs, sources[:-1], None, heads=heads)
    h = triton.merge(o1[1], lse1[1], sources[-1], qs[1], None, heads=heads)
    ref = depth_attention(qs[1], [s.float() for s in sources], None, heads=heads, backend="naive")
    out["two_phase_forward"] = rel_err(h, ref)
    return out


def compiled_model():
    torch._dynamo.reset()
    model = Transformer(ModelConfig(vocab_size=256, dim=256, n_layers=4, n_heads=4, residual="block",
                                    num_blocks=4, heads=4, backend="triton")).cuda()
    x = torch.randint(0, 256, (4, 128), device="cuda")
    eager = model.loss(x[:, :-1], x[:, 1:])
    eager.backward()
    g_eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    loss = torch.nn.functional.cross_entropy(compiled(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
    loss.backward()
    return {"loss_diff": float((loss - eager).abs()),
            "grad_rel_err": max(rel_err(p.grad, g) for p, g in zip(model.parameters(), g_eager))}


def timed(fn, rounds):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def routing_bench(tokens, dim, m, rounds):
    def step_fn(model, fn):
        e = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step():
            fn(e).float().square().mean().backward()
        return step

    fast = CheapStack("block", dim, m, "triton").cuda().to(torch.bfloat16)
    naive = CheapStack("block", dim, m, "naive").cuda().to(torch.bfloat16)
    t_fast = timed(step_fn(fast, fast), rounds)
    t_comp = timed(step_fn(naive, torch.compile(naive)), rounds)
    return {"triton_ms": 1000 * t_fast, "compiled_naive_ms": 1000 * t_comp, "speedup": t_comp / t_fast}


def train_bench(rounds):
    sizes = dict(vocab_size=256, dim=1024, n_layers=16, n_heads=16, max_seq_len=1024)
    res = {}
    for name, opts in [("prenorm", dict(residual="prenorm")), ("block", dict(residual="block", num_blocks=8))]:
        model = Transformer(ModelConfig(**sizes, **opts)).cuda()
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=True)
        x = torch.randint(0, 256, (8, 1025), device="cuda")

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model.loss(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        res[name] = 8 * 1024 / timed(step, rounds)
    res["block_throughput_vs_prenorm"] = res["block"] / res["prenorm"]
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA device")
    rounds = 5 if args.quick else 20
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["parity_fp32"] = parity(torch.float32)
    report["parity_bf16"] = parity(torch.bfloat16)
    report["compile"] = compiled_model()
    report["routing"] = routing_bench(16384, 2048, 32, rounds)
    report["train"] = train_bench(rounds)
    print(json.dumps(report, indent=2))
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
