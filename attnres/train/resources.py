"""The memory a run needs, estimated before anything is allocated, against what the machine has.

The estimate counts the model's parameters and buffers on the meta device (no memory): per
process, the fp32 weights, their gradients and AdamW's two moments (16 bytes a parameter),
divided over the ranks that shard them (FSDP: every rank, a pipeline's stages sharded over
its copies too; a pipeline alone: its ranks), plus the
buffers (the rotary tables). Activations are not counted: a run the estimate admits may still
need more. What is available: the device's free memory on CUDA
(``torch.cuda.mem_get_info``), else ``MemAvailable`` in ``/proc/meminfo`` shared by the
job's processes on this machine.
"""

from __future__ import annotations

import os

import torch

BYTES_PER_PARAMETER = 16  # fp32 weight, gradient, AdamW's exp_avg and exp_avg_sq


def model_sizes(model_config) -> tuple[int, int]:
    """``(parameters, buffer bytes)`` of the model ``model_config`` describes, counted on the
    meta device."""
    from .stage_local import meta_model

    model = meta_model(model_config)
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return params, buffers


def lower_bound(m) -> int:
    """Parameters the model has at least, from its sizes alone (embedding, and per layer the
    query and output projections and a SwiGLU MLP): a model too large for the machine is refused
    without being built, even on the meta device."""
    ffn = m.moe_hidden or m.ffn_dim if m.moe_experts else m.ffn_dim
    per_layer = 2 * m.dim * m.dim + 3 * m.dim * ffn * max(1, m.moe_experts)
    return m.vocab_size * m.dim + m.n_layers * per_layer


def estimate_bytes(cfg, plan, sizes=None) -> tuple[int, int]:
    """``(bytes per process, parameters)``: the weights, gradients and optimizer state of one
    process of a job laid out as ``plan`` (``parallel_plan.ParallelPlan``: its parameters split
    into ``plan.model_shards`` parts), and the buffers; ``sizes``: ``model_sizes``'s answer."""
    params, buffers = sizes or model_sizes(cfg.model)
    return params * BYTES_PER_PARAMETER // plan.model_shards + buffers, params


def available_bytes(device: torch.device) -> tuple[int | None, str]:
    """``(bytes, where)``: the free memory of ``device`` (CUDA), else ``MemAvailable``; None
    when it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    return None, ""


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_memory(cfg, device: torch.device, plan, available: int | None = None) -> None:
    """Refuse a model whose estimated memory per process (``estimate_bytes``) exceeds what is
    available to it, naming the estimate; ``available`` replaces the measured memory."""
    where = "given"
    if available is None:
        available, where = available_bytes(device)
        if available is None:
            return
        if device.type != "cuda":  # the job's processes on this machine share its memory
            available //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            where += f", shared by {os.environ.get('LOCAL_WORLD_SIZE', '1')} process(es)"
    sizes = (lower_bound(cfg.model), 0)
    need, params = estimate_bytes(cfg, plan, sizes)
    if need <= available:  # not refused by the bound: count on the meta device
        sizes = model_sizes(cfg.model)
        need, params = estimate_bytes(cfg, plan, sizes)
    if need <= available:
        return
    buffers = sizes[1]
    if buffers > need - buffers:  # the rotary tables, one row per position of model.max_seq_len
        raise ValueError(
            f"model.max_seq_len={cfg.model.max_seq_len}: the model's buffers (its rotary tables, one row per position) "
            f"take about {_gib(buffers)} per process, its {params:,} parameters with their gradients and AdamW state "
            f"{_gib(need - buffers)}; {_gib(available)} is available ({where}): lower model.max_seq_len (the run "
            f"reads run.seq_len={cfg.run.seq_len} tokens at a time)"
        )
    raise ValueError(
        f"the model ({params:,} parameters, dim={cfg.model.dim}, n_layers={cfg.model.n_layers}) needs about "
        f"{_gib(need)} per process for its weights, gradients, AdamW state and buffers; {_gib(available)} "
        f"is available ({where}): choose smaller sizes"
    )


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")
