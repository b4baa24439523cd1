"""Train a tiny Block AttnRes byte-level LM on the Python standard library's sources for a
minute, then print its learned depth weights: which earlier blocks each sublayer reads."""

import time

import torch

from attnres import ModelConfig, Transformer, param_groups
from attnres.train.data import random_batch, stdlib_corpus

torch.manual_seed(0)
train, val = stdlib_corpus(max_train_bytes=4_000_000, max_val_bytes=200_000)
config = ModelConfig(vocab_size=256, dim=96, n_layers=4, n_heads=4, max_seq_len=128,
                     residual="block", num_blocks=4)
model = Transformer(config)
opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
g = torch.Generator().manual_seed(0)
start = time.time()
for step in range(150):
    x, y = random_batch(train, 16, 128, g)
    loss = model.loss(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 25 == 0 or step == 149:
        print(f"step {step:4d}  train loss {loss.item():.3f} nats/byte  ({time.time() - start:.0f}s)")

model.eval()
with torch.no_grad():
    x, y = random_batch(val, 8, 128, torch.Generator().manual_seed(1))
    logits, weights = model(x, return_depth_weights=True)
    val_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
print(f"validation loss {val_loss:.3f} nats/byte")
print("\nDepth weights (mean over validation tokens); sources are e, B0, B1, ... then the partial P:")
for site, w in sorted(weights.items()):
    name = "output" if site == config.num_sublayers else f"sublayer {site:2d} ({'attn' if site % 2 == 0 else 'mlp '})"
    print(f"  {name}: " + "  ".join(f"{v:.2f}" for v in w.mean(dim=(1, 2, 3)).tolist()))
