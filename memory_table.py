"""
memory_table.py -- the paper's memory tables by its formulas, measured on real ranks, simulated at
its scale, and Table 2's measured columns under a real memory cap, beside the published numbers.
docs/memory.md has the output and the method.

    python memory_table.py                      # every section but --fit
    python memory_table.py --formula --json     # Tables 1 and 2 by formula, as rows
    python memory_table.py --simulate --sizes 1t   # zero.py itself at 1T / Nd 1024 (without --sizes: 7.5B, 128B too)
    python memory_table.py --measure --world 2 4   # real gloo ranks: model-state bytes
    python memory_table.py --fit                # the largest model per stage under a 200 MB cap (minutes)

GB means 10^9 bytes throughout, as in the paper.
"""
import argparse
import collections
import ctypes
import dataclasses
import faulthandler
import gc
import inspect
import json
import math
import os
import queue
import re
import resource
import statistics
import sys
import time
import warnings
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal
from fractions import Fraction

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import train
import zero
from gpt import GPT, PRESETS, num_params
from ranks import RankEnded, run_on_ranks, settled

STAGES = ["baseline", "P_os", "P_os+g", "P_os+g+p"]   # stage 0 (plain DP), 1, 2, 3
GB = 1e9                                              # bytes; the paper's GB
DTYPES = {"fp32": ("float32", 4, 4, 8), "bf16": ("bfloat16", 2, 2, 12)}   # name, param, grad bytes, K


# ---------------------------------------------------------------------------
# Section 5 / Figure 1 -- model states per device, by stage
# Mixed-precision Adam: fp16 parameters 2Ψ, fp16 gradients 2Ψ, optimizer states KΨ (K = 12:
# fp32 master parameters, momentum, variance). Each stage divides one more term by Nd:
#   baseline (2 + 2 + K)Ψ,  P_os 2Ψ + 2Ψ + KΨ/Nd,  P_os+g 2Ψ + (2 + K)Ψ/Nd,  P_os+g+p (2 + 2 + K)Ψ/Nd
# ---------------------------------------------------------------------------

def model_state_terms(psi, nd, stage, K=12, param_bytes=2, grad_bytes=2):
    """(parameter, gradient, optimizer-state) bytes on one device: psi parameters,
    data-parallel degree nd, ZeRO stage."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (got {stage!r})")
    params = param_bytes * psi / (nd if stage >= 3 else 1)   # fp16 parameters: split at P_os+g+p
    grads = grad_bytes * psi / (nd if stage >= 2 else 1)     # fp16 gradients: split from P_os+g
    optim = K * psi / (nd if stage >= 1 else 1)              # optimizer states: split from P_os
    return params, grads, optim


def model_state_bytes(psi, nd, stage, K=12, param_bytes=2, grad_bytes=2):
    """Bytes of model states on one device: psi parameters, data-parallel degree nd, ZeRO stage."""
    return sum(model_state_terms(psi, nd, stage, K, param_bytes, grad_bytes))


def dtype_terms(psi, nd, stage, dtype):
    """model_state_terms with a DTYPES key's bytes and K."""
    _, param_bytes, grad_bytes, K = DTYPES[dtype]
    return model_state_terms(psi, nd, stage, K, param_bytes, grad_bytes)


def agrees(ours, published_text):
    """Does our number agree with a published cell, by AGREEMENT_RULE? A B or T suffix ("7.6B",
    "0.5T") means ours is a parameter count, divided by 1e9 or 1e12 first."""
    text = published_text.strip()
    scale = {"B": 1e9, "T": 1e12}.get(text[-1:], 1)
    number = Decimal(text.rstrip("BT"))
    value = Decimal(repr(ours / scale))                # repr: the shortest decimal of the float
    step = Decimal(1).scaleb(number.as_tuple().exponent)   # 1, 0.1, 0.01 for d = 0, 1, 2
    return number in (value.quantize(step, ROUND_HALF_UP), value.quantize(step, ROUND_DOWN))


def _cell(ours, published, ok):
    return f"{ours} | {published} {'✓' if ok else '✗'}"


def _table(rows, headers):
    return tabulate(rows, headers, disable_numparse=True)


# ---------------------------------------------------------------------------
# Table 1 (Section 5) -- per-device model-state memory in GB, K = 12
# ---------------------------------------------------------------------------

TABLE1_PSI = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}    # the paper's round Ψ, not gpt.py's
# PUBLISHED Table 1, as printed in the paper: {Ψ: {Nd: (P_os, P_os+g, P_os+g+p)}} in GB
TABLE1_PUBLISHED = {
    "7.5B": {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
             64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"), 1024: ("30.1", "15.1", "0.12")},
    "128B": {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
             64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    "1T": {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"), 16: ("4750", "2875", "1000"),
           64: ("4187", "2218", "250"), 256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}
AGREEMENT_RULE = ("✓: the published value has d decimals; ours agrees if rounding it to d decimals (half up)\n"
                  "or truncating it to d decimals gives the published value (the paper truncates some\n"
                  "cells: 4187.5 -> 4187, 2218.75 -> 2218, 513.5 -> 513).")


def table1_rows():
    """One row per cell: 3 models x 6 Nd x 3 stages = 54 rows."""
    rows = []
    for model, psi in TABLE1_PSI.items():
        for nd, published in TABLE1_PUBLISHED[model].items():
            for stage in (1, 2, 3):
                gb = model_state_bytes(psi, nd, stage) / GB
                rows.append(dict(model=model, psi=psi, nd=nd, stage=stage, name=STAGES[stage], gb=gb,
                                 published=published[stage - 1], agrees=agrees(gb, published[stage - 1])))
    return rows


def table1_text(rows):
    """Pivot the 54 cells back to the paper's shape: one line per (Ψ, Nd), one column per stage.
    Ours as the float's shortest exact decimal, without a trailing .0: 120, 30.087890625."""
    lines = {}
    for r in rows:
        ours = repr(r["gb"]).removesuffix(".0")
        lines.setdefault((r["model"], r["nd"]), []).append(_cell(ours, r["published"], r["agrees"]))
    table = [[model, nd, *cells] for (model, nd), cells in lines.items()]
    return _table(table, ["Ψ", "Nd"] + [f"{s}: ours | paper" for s in STAGES[1:]]) + "\n" + AGREEMENT_RULE


# ---------------------------------------------------------------------------
# Table 2 -- the largest model on 32 GB devices, Nd = 64, GPUs = 64 x MP
# Solve model_state_bytes(Ψ, 64, stage) / MP = 32 GB for Ψ (the bytes are linear in Ψ).
# ---------------------------------------------------------------------------

DEVICE_BYTES = 32e9   # a 32 GB V100
TABLE2_ND = 64
# PUBLISHED Table 2, as printed: {MP: (baseline, P_os, P_os+g, P_os+g+p, measured baseline, measured P_os)}
TABLE2_PUBLISHED = {
    1: ("2B", "7.6B", "14.4B", "128B", "1.3B", "6.2B"),
    2: ("4B", "15.2B", "28.8B", "256B", "2.5B", "12.5B"),
    4: ("8B", "30.4B", "57.6B", "0.5T", "5B", "25B"),
    8: ("16B", "60.8B", "115.2B", "1T", "10B", "50B"),
    16: ("32B", "121.6B", "230.4B", "2T", "20B", "100B"),
}
TABLE2_NOTE = ("✓: the published value has d decimals in its unit (B = 1e9, T = 1e12 parameters); ours agrees\n"
               "if rounding it to d decimals (half up) or truncating it to d decimals gives the published value."
               "\n✗: the paper's P_os and P_os+g columns are MP x its MP = 1 value as printed (30.4B = 4 x 7.6B,"
               "\n115.2B = 8 x 14.4B): it scaled an already-rounded number, ours is exact (4 x 7.6418B = 30.567B)."
               "\nThe measured columns are the paper's (ZeRO-OS on V100s), shown for information only.")


def table2_rows():
    """One row per (MP, stage): 5 MP x 4 stages = 20 rows; psi in parameters."""
    rows = []
    for mp, published in TABLE2_PUBLISHED.items():
        for stage in (0, 1, 2, 3):
            psi = DEVICE_BYTES * mp / model_state_bytes(1, TABLE2_ND, stage)   # bytes are linear in Ψ
            rows.append(dict(mp=mp, gpus=TABLE2_ND * mp, nd=TABLE2_ND, stage=stage, name=STAGES[stage],
                             psi=psi, published=published[stage], agrees=agrees(psi, published[stage]),
                             measured_baseline=published[4], measured_p_os=published[5]))
    return rows


def table2_text(rows):
    """One line per MP; ours in the published cell's unit (B or T), then the measured columns."""
    lines = {}
    for r in rows:
        unit = r["published"][-1]                                 # "B" or "T"
        ours = f"{r['psi'] / {'B': 1e9, 'T': 1e12}[unit]:.5g}{unit}"
        lines.setdefault(r["mp"], []).append(_cell(ours, r["published"], r["agrees"]))
    table = [[mp, mp * TABLE2_ND, *cells, *TABLE2_PUBLISHED[mp][4:]] for mp, cells in lines.items()]
    headers = ["MP", "GPUs", *STAGES, "measured: baseline", "measured: P_os"]
    return "each cell: ours | paper\n" + _table(table, headers) + "\n" + TABLE2_NOTE


# Each section returns {key: {"heading", "rows", "text"}}; main prints the texts or the rows as JSON.
def formula_section(args):
    """Tables 1 and 2 by formula."""
    t1, t2 = table1_rows(), table2_rows()
    return {
        "table1": dict(heading="Table 1 by formula: per-device model-state memory (GB), K = 12 (Section 5)",
                       rows=t1, text=table1_text(t1)),
        "table2": dict(heading=f"Table 2 by formula: largest model on 32 GB devices, Nd = {TABLE2_ND}, "
                               "GPUs = 64 x MP", rows=t2, text=table2_text(t2)),
    }


# ---------------------------------------------------------------------------
# Section 4 -- simulated at the paper's scale: gpt.py's 7.5B, 128B and 1T models on the meta
# device (no memory) inside a fake process group of Nd ranks (collectives move no data),
# running zero.py's own code: initialize, one forward and backward, one step. The bytes are
# counted from the tensors then alive (meta tensors have sizes, not data).
# ---------------------------------------------------------------------------

SIMULATED = [("7.5b", "7.5B", 64), ("128b", "128B", 256), ("1t", "1T", 1024)]


class PeakNewBytes(TorchDispatchMode):
    """with PeakNewBytes() as m: ... -> m.peak: the most bytes held at once by the storages the ops
    inside made (an in-place op or a view makes none), each counted until it is freed."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = {}, 0  # storage id -> (a weak reference to it, its bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        for t in tree_flatten(out)[0]:
            if torch.is_tensor(t) and _storage(t) not in inputs:
                self.live[_storage(t)] = StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()
        self.live = {k: (ref, n) for k, (ref, n) in self.live.items() if not ref.expired()}
        self.peak = max(self.peak, sum(n for ref, n in self.live.values()))
        return out


def simulate(preset, nd, stage, rank):
    """zero.py at `stage` for a meta GPT, as `rank` of a fake world of nd, default buckets, AdamW
    with foreach=True as on a GPU: (Ψ, model-state bytes after backward, the CommCounter of one
    training step, PeakNewBytes of its clip_grad_norm_ and step())."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # registers the "fake" backend
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=nd)
    before = zero.live_tensor_bytes("meta")  # what an earlier simulation may have left, not yet collected
    try:
        module = GPT(PRESETS[preset], device="meta")
        psi = sum(p.numel() for p in module.parameters())
        model, optimizer = zero.initialize(module, torch.optim.AdamW, stage=stage, param_dtype=torch.bfloat16,
                                           stage3_units=module.h, init_fn=module.init_weights, device="meta",
                                           lr=1e-4, foreach=True)
        idx = torch.zeros(1, 8, dtype=torch.long, device="meta")
        optimizer.backward(model(idx, idx)[1])  # stage 3 learns the units' order
        optimizer.clip_grad_norm_(1.0)  # as train.py: the clipping plan is made here
        optimizer.step()  # the optimizer states exist from here on
        optimizer.zero_grad()
        with CommCounter(_zero_storages(optimizer)) as comm:  # one training step
            optimizer.backward(model(idx, idx)[1])
            measured = zero.live_tensor_bytes("meta") - before - idx.numel() * idx.element_size()  # after backward
            with PeakNewBytes() as made:
                optimizer.clip_grad_norm_(1.0)
                optimizer.step()
        del model, optimizer, module
        return psi, measured, comm, made.peak
    finally:
        dist.destroy_process_group()


def simulate_section(args):
    rows, comm_rows = [], []
    for preset, paper_model, nd in [m for m in SIMULATED if m[0] in args.sizes]:
        for stage in (1, 2, 3):
            t0 = time.perf_counter()
            for rank in (0, nd - 1):
                psi, measured, comm, step_peak = simulate(preset, nd, stage, rank)
                comm_rows.append(dict(model=preset, psi=psi, nd=nd, stage=stage, name=STAGES[stage], rank=rank,
                                      largest_temporary_bytes=comm.largest, largest_temporary_numel=comm.largest_numel,
                                      bucket_numel=zero.default_bucket_numel(nd),
                                      sent=float(sum(comm.sent.values())), received=float(sum(comm.received.values())),
                                      step_peak_bytes=step_peak))
                if rank == 0:
                    formula = model_state_bytes(psi, nd, stage)
                    rows.append(dict(model=preset, psi=psi, nd=nd, stage=stage, name=STAGES[stage],
                                     measured_gb=measured / GB, formula_gb=formula / GB, ratio=measured / formula,
                                     published_gb=TABLE1_PUBLISHED[paper_model][nd][stage - 1]))
            rows[-1]["seconds"] = time.perf_counter() - t0
    table = [[r["model"], f"{r['psi'] / 1e9:.2f}B", r["nd"], r["name"], f"{r['measured_gb']:.4f}",
              f"{r['formula_gb']:.4f}", f"{r['ratio']:.5f}", r["published_gb"], f"{r['seconds']:.1f}"] for r in rows]
    headers = ["model", "Ψ", "Nd", "stage", "measured GB/rank", "formula GB", "ratio", "Table 1 (Ψ rounded)", "s (2 ranks)"]
    text = (_table(table, headers) +
            "\nmeasured: bytes of the meta tensors alive after backward on rank 0 of a fake world of Nd ranks,\n"
            "zero.py's real partitioning (bf16 parameters and gradients, fp32 master + Adam: K = 12); formula:\n"
            "Section 5 for gpt.py's exact Ψ; Table 1's cell is for the paper's round Ψ.")
    table = [[r["model"], r["nd"], r["name"], r["rank"], f"{r['largest_temporary_bytes'] / 2**20:.0f}",
              f"{r['largest_temporary_numel'] / r['bucket_numel']:.2f}", f"{r['sent'] / r['psi']:.4f}",
              f"{r['received'] / r['psi']:.4f}", f"{r['step_peak_bytes'] / 2**20:.0f}"] for r in comm_rows]
    headers = ["model", "Nd", "stage", "rank", "largest temporary MiB", "in buckets", "sent / Ψ", "received / Ψ",
               "step's peak MiB"]
    comm_text = (_table(table, headers) +
                 "\none training step (backward, clip_grad_norm_, step) of the same runs, as rank 0 and as rank\n"
                 "Nd-1, default buckets (zero.default_bucket_numel: 2^22 elements at Nd 64, 2^24 at 256, 2^26 at\n"
                 "1024, each rank's chunk 2^16 elements). largest temporary: the largest tensor handed to a\n"
                 "collective that is not the parameters' or gradients' own storage, in MiB and in elements over\n"
                 "bucket_numel (clipping moves fp32 gradients, the reductions bf16); sent and received: elements\n"
                 "per step (all_to_all: what goes to and comes from the other ranks; the others: the ring\n"
                 "convention).\n"
                 "Section 7: 2 x (Nd-1)/Nd Ψ at stages 1-2 and 3 x (Nd-1)/Nd Ψ at stage 3, the same on every\n"
                 "rank, less at stage 3 the last block and the output layer, which the forward keeps for\n"
                 "backward instead of gathering them twice; clipping adds about Ψ/Nd sent: each gradient's\n"
                 "pieces brought whole to the rank finding its norm, so a rank receives at least its largest\n"
                 "gradient (rank 0 at 7.5b: the token embedding).\n"
                 "step's peak: the most bytes clip_grad_norm_ and step() (AdamW, foreach as on a GPU) hold at once\n"
                 "in tensors they make. The step converts, unscales and clips the gradient and runs the optimizer\n"
                 "a bucket's worth of the shard at a time; clipping brings each gradient whole, in fp32, to the\n"
                 "rank taking its norm: not handed to a collective, the one temporary beyond C_B, one large\n"
                 "gradient at a time beside at most a bucket of small ones (stage 3 gathers a unit at least\n"
                 "that large).")
    return {"simulate": dict(heading="Simulated at the paper's scale: zero.py on meta models in a fake world",
                             rows=rows, text=text),
            "simulate_comm": dict(heading="Communication at the paper's scale: the same simulated step, per rank",
                                  rows=comm_rows, text=comm_text)}


# ---------------------------------------------------------------------------
# Section 3 -- measured on real ranks. A small GPT trained two steps with zero.py; after the
# second backward (the paper's accounting point: parameters, gradients and optimizer states all
# exist) every storage created since the model was built and still alive is sorted:
#   gradients         the storages the second backward wrote or created
#   optimizer states  tensors in a live torch.optim.Optimizer's state, and its parameters in
#                     another dtype than the model's (16-bit training's fp32 master: K = 12)
#   parameters        the rest: the nn.Parameters' storages, or stage 3's shard
# This reads torch's objects and the bytes themselves, not zero.py's bookkeeping.
# ---------------------------------------------------------------------------

def _storage(t):
    return t.untyped_storage()._cdata


def _zero_storages(optimizer):
    """Ids of zero.py's own parameter and gradient storages: a collective's buffers, not copies."""
    return [_storage(t) for t in optimizer.parameters.storages() + optimizer.gradients.storages()]


def _bytes(storage):
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)   # (nbytes,) a view of the raw bytes


def _batch(config, batch_size, seq_len, seed):
    """(batch_size, seq_len + 1) random tokens, the same for a seed: inputs idx[:, :-1], targets idx[:, 1:]."""
    return torch.randint(config.vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(seed))


def split_model_states(new, before_backward, dtype):
    """(parameter, gradient, optimizer-state) bytes of the storages `new`, given a copy of each
    storage's bytes taken just before the backward."""
    grads = {s for s, st in new.items() if s not in before_backward or not torch.equal(_bytes(st), before_backward[s])}
    optim = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # isinstance on torch.distributed.reduce_op warns
        optimizers = [o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)]
    for o in optimizers:
        optim |= {_storage(v) for state in o.state.values() for v in state.values() if torch.is_tensor(v)}
        optim |= {_storage(p) for g in o.param_groups for p in g["params"] if p.dtype != dtype}
    g_bytes = sum(st.nbytes() for s, st in new.items() if s in grads)
    o_bytes = sum(st.nbytes() for s, st in new.items() if s in optim and s not in grads)
    return sum(st.nbytes() for st in new.values()) - g_bytes - o_bytes, g_bytes, o_bytes


def _warm_cublas(device):
    """A linear layer's forward and backward on `device`: the calling thread and autograd's make
    their cuBLAS handles and workspaces, which the allocator then holds for the process's life."""
    layer = torch.nn.Linear(64, 64, device=device)
    layer(torch.ones(32, 64, device=device)).sum().backward()


def measure_on_rank(stage, dtype_name, preset, batch_size=4, seq_len=64):
    """One configuration on this rank: (Ψ, model-state split, activation bytes, the CUDA
    allocator's bytes after backward beyond those before the model (None on the CPU))."""
    dtype, config = getattr(torch, DTYPES[dtype_name][0]), PRESETS[preset]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cuda":  # cuBLAS's workspaces (one per thread, 32 MiB each on Hopper) come with a
        _warm_cublas(device)   # thread's first matmul: make them before the baseline, not as model states
    before = zero.live_storages(device.type)   # held: no new storage can take one of their ids
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    module = GPT(config, seed=0, device="meta")
    psi = sum(p.numel() for p in module.parameters())
    model, optimizer = zero.initialize(module, torch.optim.AdamW, stage=stage, lr=1e-3,
                                       param_dtype=None if dtype == torch.float32 else dtype,
                                       stage3_units=module.h, init_fn=module.init_weights, device=device)
    memory = zero.MemoryHooks(model, every_module=False)
    idx = _batch(config, batch_size, seq_len, dist.get_rank()).to(device)
    before[_storage(idx)] = idx.untyped_storage()
    for step in range(2):
        memory.recording = step == 1
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        if step == 1:
            memory.recording = False
            snapshot = {s: _bytes(st).clone() for s, st in zero.live_storages(device.type).items() if s not in before}
        optimizer.backward(loss)
        del loss
        dist.barrier()  # every rank's collectives done (their buffers let go: settled, below)
        if step == 1 and device.type == "cuda":  # beyond what was there, the input and the snapshot
            extra = idx.untyped_storage().nbytes() + sum(c.untyped_storage().nbytes() for c in snapshot.values())
            allocated = torch.cuda.memory_allocated(device) - allocated - extra
        if step == 0:
            optimizer.step()          # the optimizer states exist from here on
            optimizer.zero_grad()
    copies = {_storage(c) for c in snapshot.values()}
    settled(lambda: sum(st.nbytes() for s, st in zero.live_storages(device.type).items() if s not in before))
    new = {s: st for s, st in zero.live_storages(device.type).items() if s not in before and s not in copies}
    split = split_model_states(new, snapshot, dtype)
    activations = memory.kept_by_forward()
    del model, optimizer, module, memory, new, snapshot
    return psi, split, activations, allocated if device.type == "cuda" else None


def each_on_rank(fn, configs):
    """fn(*config) for every config, on this rank."""
    return [fn(*c) for c in configs]


def measure_section(args):
    """Model states on real ranks, split and set beside the formula."""
    backend = "nccl" if torch.cuda.device_count() >= max(args.world) else "gloo"  # a GPU per rank, or the CPU
    rows, worst = [], []   # worst: per configuration, the rank holding the most (the per-device figure)
    for nd in args.world:
        configs = [(stage, dt, args.model) for dt in DTYPES for stage in (0, 1, 2, 3)]
        per_rank = run_on_ranks(nd, each_on_rank, measure_on_rank, configs, backend=backend)
        for k, (stage, dt, _) in enumerate(configs):
            psi = per_rank[0][k][0]
            formula = dtype_terms(psi, nd, stage, dt)
            for rank, results in enumerate(per_rank):
                split, activations, allocator = results[k][1:]
                rows.append(dict(nd=nd, rank=rank, stage=stage, name=STAGES[stage], dtype=dt, psi=psi, allocator=allocator,
                                 params=split[0], grads=split[1], optim=split[2], total=sum(split),
                                 formula_params=formula[0], formula_grads=formula[1], formula_optim=formula[2],
                                 formula=sum(formula), ratio=sum(split) / sum(formula), activations=activations))
            worst.append(max(rows[-nd:], key=lambda r: r["total"]))
    table = [[r["dtype"], r["nd"], r["name"]] +
             [f"{r[k] / 1e6:.3f} / {r['formula_' + k] / 1e6:.3f}" for k in ("params", "grads", "optim")] +
             [f"{r['total'] / 1e6:.3f}", f"{r['formula'] / 1e6:.3f}", f"{r['ratio']:.4f}", f"{r['activations'] / 1e6:.2f}"]
             for r in worst]
    headers = ["dtype", "Nd", "stage", "params MB: measured / formula", "grads MB", "optimizer MB",
               "model states MB", "formula MB", "ratio", "activations MB"]
    if backend == "nccl":  # the CUDA allocator's own figure beside the live tensors'
        headers.append("CUDA allocator MB")
        for line, r in zip(table, worst):
            line.append(f"{r['allocator'] / 1e6:.3f}")
    where = "NCCL ranks, one GPU each" if backend == "nccl" else "gloo ranks on the CPU"
    text = (f"gpt.py '{args.model}' (Ψ = {num_params(PRESETS[args.model]):,}), AdamW, zero.py on Nd {where}, "
            "after the second backward.\n" + _table(table, headers) +
            "\nmeasured (the rank holding the most; --json has every rank): storages alive in the rank, sorted:\n"
            "gradients = what the backward wrote or created; optimizer states = a torch.optim.Optimizer's state\n"
            "and, in bf16, its fp32 master copy; parameters = the rest (nn.Parameters, or stage 3's shard).\n"
            "formula: Section 5 with fp32 parameters and gradients (4 + 4 bytes, K = 8: momentum and variance) or\n"
            "bf16 (2 + 2 bytes, K = 12: fp32 master, momentum, variance). Ratios above 1 are padding (the flat\n"
            f"space is padded to a multiple of {zero.ALIGN} x Nd) and AdamW's 4-byte step counter per parameter piece.\n"
            "activations: live bytes at the end of forward minus its start (what forward keeps for backward;\n"
            "at P_os+g+p with the last units' gathered parameters, which the forward keeps for backward).")
    return {"measure": dict(heading="Measured on real ranks: per-rank model states against the formula (Section 5)",
                            rows=rows, text=text)}


# ---------------------------------------------------------------------------
# Section 7 -- communication volume: elements each rank sends in one training step, counted by
# wrapping the torch.distributed collectives zero.py calls. Convention (ring algorithms, as in
# Section 7): all_gather and reduce_scatter send (n-1)/n of the full tensor from every rank;
# broadcast (n-1)/n of the tensor per rank on average (a pipelined chain); all_reduce 2(n-1)/n;
# all_to_all_single the elements it sends to the other ranks (point to point: no convention).
# ---------------------------------------------------------------------------

class CommCounter:
    """with CommCounter() as c: ... -> c.sent[(phase, collective)]: elements this rank sends
    (Fractions), c.bytes[...] the same in bytes, c.received[...] the elements it receives;
    c.largest, c.largest_numel: bytes and elements of the largest tensor handed to a collective
    whose storage id is not in `persistent` (a temporary). Wraps dist.<name> for every name in
    SENT; torch's own nested calls go to distributed_c10d, so none is counted twice."""
    SENT = {  # collective: (its tensor argument, elements sent by rank r of n for a tensor t)
        "all_to_all_single": ("input", lambda a, t, n, r: sum(a["input_split_sizes"]) - a["input_split_sizes"][r]
                              if a["input_split_sizes"] else Fraction(n - 1, n) * t.numel()),
        "all_gather_single": ("input_tensor", lambda a, t, n, r: (n - 1) * t.numel()),
        "all_gather_into_tensor": ("input_tensor", lambda a, t, n, r: (n - 1) * t.numel()),
        "reduce_scatter_single": ("input", lambda a, t, n, r: Fraction(n - 1, n) * t.numel()),
        "reduce_scatter_tensor": ("input", lambda a, t, n, r: Fraction(n - 1, n) * t.numel()),
        "broadcast": ("tensor", lambda a, t, n, r: Fraction(n - 1, n) * t.numel()),
        "all_reduce": ("tensor", lambda a, t, n, r: Fraction(2 * (n - 1), n) * t.numel()),
    }

    def __init__(self, persistent=()):
        self.phase, self.sent, self.bytes, self.saved = "", collections.Counter(), collections.Counter(), {}
        self.received, self.largest, self.largest_numel = collections.Counter(), 0, 0
        self.persistent = set(persistent)

    def _counted(self, name, fn):
        signature, (arg, elements) = inspect.signature(fn), self.SENT[name]

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a, group = bound.arguments, bound.arguments["group"]
            n, r = dist.get_world_size(group), dist.get_rank(group)
            sent = elements(a, a[arg], n, r)
            self.sent[(self.phase, name)] += sent
            self.bytes[(self.phase, name)] += sent * a[arg].element_size()
            splits = a.get("output_split_sizes")
            self.received[(self.phase, name)] += (sent if name != "all_to_all_single" else sum(splits) - splits[r]
                                                  if splits else Fraction(n - 1, n) * a["output"].numel())
            for t in a.values():
                if torch.is_tensor(t) and _storage(t) not in self.persistent:
                    self.largest = max(self.largest, t.numel() * t.element_size())
                    self.largest_numel = max(self.largest_numel, t.numel())
            return fn(*args, **kwargs)
        return call

    def __enter__(self):
        for name in self.SENT:
            self.saved[name] = getattr(dist, name)
            setattr(dist, name, self._counted(name, self.saved[name]))
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


# ---------------------------------------------------------------------------
# Table 2, measured -- the paper's measured columns (1.3B baseline and 6.2B with P_os on 32 GB
# V100s, against 2B and 7.6B by formula) in miniature: the largest gpt.py model (one preset,
# n_layer grown) that trains two steps as train.py does on Nd fresh gloo ranks, each with its
# address space capped (RLIMIT_AS) at what it holds before the model + the budget. A failed
# allocation on any rank means "did not fit". docs/memory.md describes the cap and the search.
# ---------------------------------------------------------------------------

FIT_BUDGET_MB = 200   # per rank: the default run fits a handful of blocks at stage 0
M_ARENA_MAX, M_MMAP_THRESHOLD = -8, -3   # glibc's mallopt parameters (malloc.h)
STALL_S = 180   # a try takes 4-10 s: a rank still in it after this prints its threads' stacks and ends


@dataclasses.dataclass(frozen=True)
class FitSetting:
    """What every try of one search shares. budget: bytes of address space per rank on top of
    what the rank holds before the model is built (None: no cap)."""
    nd: int = 4
    budget: int | None = round(FIT_BUDGET_MB * 1e6)
    dtype: str = "fp32"               # a DTYPES key: fp32 AdamW, or bf16 with an fp32 master (K = 12)
    family: str = "small"             # the gpt.py preset whose n_layer grows
    batch_size: int = 1               # sequences per rank per step
    seq_len: int = 128                # train.py's
    bucket_numel: int | None = None   # C_B, elements per bucket; None: train.py's default


def fit_config(family, n_layer):
    """The shape family: gpt.py preset `family` with n_layer blocks (width, heads, vocab kept)."""
    return dataclasses.replace(PRESETS[family], n_layer=n_layer)


def _vm(field="VmSize"):
    """This process's address space (VmSize) or its high-water mark (VmPeak), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024   # "VmSize:  811520 kB"
    raise RuntimeError(f"no {field} in /proc/self/status: the memory cap needs Linux")


def _warm_up(setting, dtype):
    """Run the kernels and collectives of a training step on a one-block model, so that what the
    libraries map lazily (code, thread buffers) is there before the address space is read."""
    config = fit_config(setting.family, 1)
    module = GPT(config, seed=0).to(dtype)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    idx = torch.randint(config.vocab_size, (1, 9))
    for _ in range(2):
        module(idx[:, :-1], idx[:, 1:])[1].backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
    nd = dist.get_world_size()
    x, y = torch.ones(nd * 64, dtype=dtype), torch.empty(nd * nd * 64, dtype=dtype)   # (nd * 64,), (nd * nd * 64,)
    for async_op in (False, True):
        for work in (dist.all_to_all_single(torch.empty_like(x), x, async_op=async_op),
                     dist.all_gather_single(y, x, async_op=async_op), dist.all_reduce(x, async_op=async_op),
                     dist.broadcast(x, group_src=0, async_op=async_op)):
            if work is not None:
                work.wait()
    zero.check_group()   # the ranks' checks (stage 3's gathers, zero's collective calls): a gloo group of its own
    del module, optimizer, x, y
    gc.collect()


def train_under_cap(setting, stage, n_layer):
    """On this rank: cap the address space, build the model, train two steps as train.py does.
    Returns psi and FIT_NOTE's bytes (peak, init_peak, steady = held, activations,
    largest_temporary = C_B) above the address space before the model. Raises
    MemoryError("did not fit ...") when an allocation fails under the cap."""
    faulthandler.enable()   # a fatal signal prints where each thread was
    faulthandler.dump_traceback_later(STALL_S, exit=True)   # and so does a stall, then ends the rank
    # glibc: one malloc arena for every thread (each would reserve 64 MiB of address space), and
    # a fixed mmap threshold, so that every tensor that matters is a mapping unmapped when freed
    libc = ctypes.CDLL(None)
    libc.mallopt(M_ARENA_MAX, 1)
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    defaults = train.parse_args([])   # train.py's AdamW, clipping and bucket size
    dtype = getattr(torch, DTYPES[setting.dtype][0])
    config = fit_config(setting.family, n_layer)
    _warm_up(setting, dtype)
    idx = _batch(config, setting.batch_size, setting.seq_len, dist.get_rank())
    base = _vm()
    limit = resource.getrlimit(resource.RLIMIT_AS)
    if setting.budget is not None:
        resource.setrlimit(resource.RLIMIT_AS, (base + setting.budget, limit[1]))
    phase, seen = "build", {}
    try:
        module = GPT(config, seed=defaults.seed, device="meta")   # as train.py: initialised shard by shard
        psi = sum(p.numel() for p in module.parameters())
        decay = [p for p in module.parameters() if p.dim() >= 2]
        no_decay = [p for p in module.parameters() if p.dim() < 2]
        phase = "initialize"
        model, optimizer = zero.initialize(module, torch.optim.AdamW, stage=stage,
                                           param_groups=[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                                           param_dtype=None if dtype == torch.float32 else dtype,
                                           bucket_numel=setting.bucket_numel or defaults.bucket_numel,
                                           stage3_units=module.h, init_fn=module.init_weights, device="cpu",
                                           lr=defaults.lr, betas=(0.9, 0.95),
                                           weight_decay=defaults.weight_decay)
        del module, decay, no_decay
        seen["init_peak"] = _vm("VmPeak") - base
        for step in (1, 2):
            if step == 2:   # the steady state: parameters, gradients (stages 0-1) and optimizer states
                optimizer.wait_params()   # what the forward waits for anyway (stages 1-2's gathers in flight)
                seen["steady"] = _vm() - base
            with CommCounter(_zero_storages(optimizer)) as comm:
                phase = f"forward {step}"
                loss = model(idx[:, :-1], idx[:, 1:])[1]
                if step == 2:
                    seen["activations"] = _vm() - base - seen["steady"]   # what forward keeps for backward
                phase = f"backward {step}"
                optimizer.backward(loss)
                del loss
                phase = f"step {step}"
                optimizer.clip_grad_norm_(defaults.grad_clip)
                optimizer.step()
                optimizer.zero_grad()
        seen["largest_temporary"] = comm.largest
    except (RuntimeError, MemoryError) as e:
        resource.setrlimit(resource.RLIMIT_AS, limit)   # room to report it
        out_of_memory = isinstance(e, MemoryError) or any(
            words in str(e) for words in ("can't allocate memory", "bad_alloc", "could not create a primitive"))
        # torch's allocator, C++'s new inside a kernel, or oneDNN's when the memory for a kernel it
        # builds cannot be had (its message carries no status: under the cap, that is the memory)
        if setting.budget is not None and out_of_memory:
            first_line = (str(e).splitlines() or [type(e).__name__])[0]
            raise MemoryError(f"did not fit: out of memory in {phase} at n_layer {n_layer} "
                              f"({first_line[:100]})") from None
        raise
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)
        faulthandler.cancel_dump_traceback_later()
    return dict(psi=psi, peak=_vm("VmPeak") - base, **seen)


def try_fit(setting, stage, n_layer):
    """One try on setting.nd fresh ranks: (True, every rank's train_under_cap result) if all
    trained two steps, (False, "did not fit: ...") if one ran out of memory under the cap. A rank
    that ends without a word (a signal, or the stall watchdog: its stacks are on stderr) is an
    error, not a failure to fit: a crash can be a bug the cap only brings out (a buffer freed
    under a collective still writing into it)."""
    try:
        return True, run_on_ranks(setting.nd, train_under_cap, setting, stage, n_layer, timeout=STALL_S + 60)
    except (RankEnded, queue.Empty) as e:
        raise RuntimeError(f"stage {stage}, n_layer {n_layer} ended without a result: "
                           f"{str(e) or f'no result in {STALL_S + 60} s'}") from None
    except RuntimeError as e:
        line = next((l for l in str(e).splitlines() if l.startswith("MemoryError: did not fit")), None)
        if line is None:   # not the cap: a real error
            raise
        return False, line.removeprefix("MemoryError: ")


def largest_fit(fits, start, guess):
    """(the largest n >= 1 with fits(n) or 0, the smallest n without), fits holding up to some n
    and failing above it. From `start`; after a fit, to guess(lo) (the largest n that should fit)
    if it lies between the known fit and failure, or lo + 1 if it says lo; otherwise steps of 1,
    2, 4, ... then bisection. Every n is tried at most once."""
    lo, hi, step, n = 0, math.inf, 1, max(1, start)
    while hi - lo > 1:
        if n > 1024:
            raise RuntimeError(f"n_layer {n} would still be tried: is the cap working? (budget too large)")
        if fits(n):
            lo = n
        else:
            hi = n
        estimate = guess(lo) if lo else None
        if estimate is not None and lo < estimate < hi:
            n = estimate
        elif estimate is not None and estimate <= lo:
            n = lo + 1
        elif hi == math.inf:   # up from a fit
            n, step = lo + step, 2 * step
        elif lo == 0:   # down from a failure
            n, step = max(1, hi - step), 2 * step
        else:
            n = (lo + hi) // 2
    return lo, hi


def family_psi(family, n_layer):
    """Ψ of the family with n_layer blocks, linear in n_layer (a real n_layer: between two models)."""
    psi0 = num_params(fit_config(family, 0))   # embeddings, positions, ln_f
    return psi0 + n_layer * (num_params(fit_config(family, 1)) - psi0)


def predicted_psi(setting, stage, activations=(0, 0), temporary=0):
    """Ψ whose bytes per rank fill the budget: Section 5's model states, plus activations of
    a + b n_layer bytes and one temporary buffer (all linear in n_layer: solved for it)."""
    per_psi = sum(dtype_terms(1, setting.nd, stage, setting.dtype))   # bytes per parameter
    psi0, psi_block = family_psi(setting.family, 0), family_psi(setting.family, 1) - family_psi(setting.family, 0)
    n_layer = (setting.budget - per_psi * psi0 - activations[0] - temporary) / (per_psi * psi_block + activations[1])
    return family_psi(setting.family, n_layer)


def _n_layer_of(family, psi):
    """The largest n_layer (at least 1) whose Ψ is at most psi."""
    return max(1, math.floor((psi - family_psi(family, 0)) / (family_psi(family, 1) - family_psi(family, 0))))


def _line(points):
    """Least-squares (intercept, slope) through (n_layer, bytes): through 0 for one n_layer, (0, 0) for none."""
    if not points:
        return 0, 0
    xs, ys = zip(*points)
    if len(set(xs)) == 1:
        return 0.0, statistics.fmean(ys) / xs[0]
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def fit_stage(setting, stage, start):
    """Search one stage from n_layer `start`: (its row, {n_layer: try}). The row's bytes are the
    rank holding the most at the fit."""
    started, tries = time.perf_counter(), {}

    def fits(n_layer):
        t0 = time.perf_counter()
        ok, result = try_fit(setting, stage, n_layer)
        tries[n_layer] = dict(n_layer=n_layer, fits=ok, seconds=time.perf_counter() - t0,
                              ranks=result if ok else None, failure=None if ok else result)
        print(f"  {setting.dtype} {STAGES[stage]:8s} n_layer {n_layer:3d}: {'fits' if ok else result} "
              f"({tries[n_layer]['seconds']:.1f} s)", file=sys.stderr, flush=True)
        return ok

    def guess(lo):
        """lo + the blocks the budget left at lo's peak still holds, each costing what the peak grew
        by a block between this stage's fits, or with one fit, Section 5's bytes plus lo's
        activations per block."""
        fitted = sorted((n, max(r["peak"] for r in t["ranks"])) for n, t in tries.items() if t["fits"])
        (n0, p0), (n1, p1) = fitted[0], fitted[-1]
        if n1 > n0:
            per_block = (p1 - p0) / (n1 - n0)
        else:
            block = family_psi(setting.family, 1) - family_psi(setting.family, 0)
            per_block = (sum(dtype_terms(block, setting.nd, stage, setting.dtype)) +
                         max(r["activations"] for r in tries[lo]["ranks"]) / lo)
        return lo + math.floor((setting.budget - p1) / per_block) if per_block > 0 else None

    n_layer, fails_at = largest_fit(fits, start, guess)
    fit = max(tries[n_layer]["ranks"], key=lambda r: r["peak"]) if n_layer else {}
    failure = tries[fails_at]["failure"]
    row = dict(dataclasses.asdict(setting), stage=stage, name=STAGES[stage], n_layer=n_layer,
               psi=round(family_psi(setting.family, n_layer)) if n_layer else 0, fails_at=fails_at,
               failure=failure, fails_in=re.search(r" in (.+?) at n_layer", failure)[1],
               **{k: fit.get(k) for k in ("peak", "init_peak", "steady", "activations")},
               largest_temporary=fit.get("largest_temporary", 0),
               tries=[{k: t[k] for k in ("n_layer", "fits", "seconds")} for t in tries.values()],
               seconds=time.perf_counter() - started)
    return row, tries


def fit_section(args):
    """Per dtype and stage, the largest model that trains under the cap, beside the formula's."""
    rows, t_start = [], time.perf_counter()
    for dtype in args.dtypes:
        setting = FitSetting(nd=args.nd, budget=round(args.budget * 1e6), dtype=dtype, family=args.family,
                             batch_size=args.batch_size, seq_len=args.seq_len, bucket_numel=args.bucket_numel)
        kept = []   # (n_layer, activation bytes) of every try that trained, any stage: the rank holding the most
        for stage in (0, 1, 2, 3):
            if stage == 0:   # half Section 5's largest model (which counts nothing else): its peak guides the next
                start = _n_layer_of(setting.family, predicted_psi(setting, 0) / 2)
            else:   # Section 5 plus the residuals seen so far, as far short as the stage before fell
                last = rows[-1]
                residuals = dict(activations=_line(kept), temporary=last["largest_temporary"])
                start = _n_layer_of(setting.family, predicted_psi(setting, stage, **residuals) * last["psi"] /
                                    predicted_psi(setting, stage - 1, **residuals))
            row, tries = fit_stage(setting, stage, start)
            kept += [(n, max(r["activations"] for r in t["ranks"])) for n, t in tries.items() if t["fits"]]
            rows.append(row)
        for r in rows[-4:]:   # the formula's largest model for the budget: Section 5 alone (as the
            # paper's 7.6B), and Section 5 plus every activation measured for this dtype and C_B
            for key, residuals in (("formula", {}), ("predicted", dict(activations=_line(kept),
                                                                      temporary=r["largest_temporary"]))):
                r[f"{key}_psi"] = predicted_psi(setting, r["stage"], **residuals)
                r[f"{key}_ratio"] = r["psi"] / r[f"{key}_psi"]
            r["activation_line"] = _line(kept)
    heading = (f"Table 2, measured: the largest model per stage that trains under a real {args.budget:g} MB cap "
               f"per rank, Nd = {args.nd}")
    return {"fit": dict(heading=heading, rows=rows, text=fit_text(rows, time.perf_counter() - t_start))}


FIT_NOTE = """\
n_layer, Ψ: the largest model that trained two steps on every rank under the cap; fails at: the
next n_layer, which the search tried, and where it ran out of memory.
Section 5 Ψ: the largest model whose model states alone fill the budget, as the paper's theoretical
columns (fp32 AdamW: 16Ψ, 4Ψ + 4Ψ + 8Ψ/Nd, 4Ψ + 12Ψ/Nd, 16Ψ/Nd bytes; bf16 with an fp32 master:
K = 12); ratio: measured / that, as the paper's 6.2B / 7.6B = 0.82 (P_os) and 1.3B / 2B = 0.65.
+ residual Ψ: Section 5 plus the activations (a + b n_layer, fitted to every try that trained) and
the C_B buffer measured here; ratio: measured / that. vs baseline: Ψ over the baseline's, measured
and by Section 5 (the paper's headline: Nd-fold at P_os+g+p; Table 2, MP 1: 6.2B / 1.3B = 4.8
measured, 7.6B / 2B = 3.8 by formula).
Bytes at each fit, the rank holding the most: Section 5's model states; held: the address space
before the second forward; activations: what that forward added; C_B: the largest temporary
handed to a collective; init peak: the high-water mark when zero.initialize returned; peak: after
two steps (within the budget). The model is built on the meta device and initialised shard by
shard, as train.py does: the init peak is what the rank keeps plus about one block."""


def fit_text(rows, seconds):
    r0, c = rows[0], fit_config(rows[0]["family"], 1)
    setting = (f"gpt.py '{r0['family']}' (n_embd {c.n_embd}, {c.n_head} heads, vocab {c.vocab_size}), n_layer grown; "
               f"Nd = {r0['nd']} gloo ranks, each capped at\nits address space before the model + "
               f"{r0['budget'] / 1e6:g} MB; {r0['batch_size']} x {r0['seq_len']} tokens per rank, two steps with "
               "train.py's\nAdamW and clipping, buckets of "
               f"{r0['bucket_numel'] or zero.default_bucket_numel(r0['nd']):,} elements.")
    base = {r["dtype"]: r for r in rows if r["stage"] == 0}
    mb = lambda x: "-" if x is None else f"{x / 1e6:.1f}"
    table = [[r["dtype"], r["name"], r["n_layer"], f"{r['psi'] / 1e6:.2f}M", f"{r['fails_at']}: {r['fails_in']}",
              f"{r['formula_psi'] / 1e6:.2f}M", f"{r['formula_ratio']:.2f}",
              f"{r['predicted_psi'] / 1e6:.2f}M", f"{r['predicted_ratio']:.2f}",
              f"{r['psi'] / base[r['dtype']]['psi']:.2f}" if base[r['dtype']]['psi'] else "-",
              f"{r['formula_psi'] / base[r['dtype']]['formula_psi']:.2f}", len(r["tries"])] for r in rows]
    headers = ["dtype", "stage", "n_layer", "Ψ", "fails at", "Section 5 Ψ", "ratio", "+ residual Ψ", "ratio",
               "vs baseline", "Section 5 vs baseline", "tries"]
    bytes_table = [[r["dtype"], r["name"], r["n_layer"], mb(sum(dtype_terms(r["psi"], r["nd"], r["stage"], r["dtype"]))),
                    *[mb(r[k]) for k in ("steady", "activations", "largest_temporary", "init_peak", "peak")]]
                   for r in rows]
    bytes_headers = ["dtype", "stage", "n_layer", "Section 5 MB", "held MB", "activations MB", "C_B MB", "init peak MB",
                     "peak MB"]
    return "\n".join([setting, _table(table, headers), "", _table(bytes_table, bytes_headers), FIT_NOTE,
                      f"wall time {seconds:.0f} s ({sum(len(r['tries']) for r in rows)} tries)"])


SECTIONS = {  # flag -> section, in the order they print
    "formula": formula_section,
    "measure": measure_section,
    "simulate": simulate_section,
}
SECTION_FLAGS = {  # section -> the flags only it reads
    "measure": ["world", "model"],
    "simulate": ["sizes"],
    "fit": ["budget", "nd", "family", "dtypes", "batch_size", "seq_len", "bucket_numel"],
}


def main(argv=None):
    parser = argparse.ArgumentParser(description="ZeRO's memory tables by formula, beside the paper's.",
                                     allow_abbrev=False)  # (a flag is known given by its own name)
    for name in SECTIONS:
        parser.add_argument(f"--{name}", action="store_true", help=f"print the {name} section")
    parser.add_argument("--json", action="store_true", help="one JSON object of every table's rows")
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2, 4], help="world sizes --measure runs")
    parser.add_argument("--model", default="tiny", choices=list(PRESETS), help="the gpt.py preset --measure trains")
    parser.add_argument("--sizes", nargs="+", default=[m[0] for m in SIMULATED], choices=[m[0] for m in SIMULATED],
                        help="models --simulate runs")
    fit = parser.add_argument_group("--fit: the largest model per stage under a real memory cap (on request only)")
    fit.add_argument("--fit", action="store_true", help="search, per stage and dtype, the largest model that trains")
    fit.add_argument("--budget", type=float, default=FIT_BUDGET_MB, help="MB of address space per rank")
    fit.add_argument("--nd", type=int, default=FitSetting.nd, help="data-parallel ranks")
    fit.add_argument("--family", default=FitSetting.family, choices=list(PRESETS),
                     help="the gpt.py preset whose n_layer grows")
    fit.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    fit.add_argument("--batch_size", type=int, default=FitSetting.batch_size, help="sequences per rank per step")
    fit.add_argument("--seq_len", type=int, default=FitSetting.seq_len)
    fit.add_argument("--bucket_numel", type=int, default=FitSetting.bucket_numel, help="C_B (default: train.py's)")
    args = parser.parse_args(argv)
    given = {a.split("=")[0].removeprefix("--") for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
    for name in ("world", "nd", "batch_size", "seq_len", "bucket_numel"):
        values = getattr(args, name)
        for value in values if isinstance(values, list) else [values]:
            if value is not None and value < 1:  # bucket_numel None: train.py's default
                parser.error(f"--{name} must be at least 1 (got {value})")
    if not math.isfinite(args.budget) or args.budget <= 0:   # (nan passes `<= 0`)
        parser.error(f"--budget must be a finite number of MB above 0 (got {args.budget:g})")
    if args.fit and args.seq_len > PRESETS[args.family].block_size:   # else every rank fails in its forward
        block_size = PRESETS[args.family].block_size
        parser.error(f"--seq_len {args.seq_len} exceeds the {args.family} model's block_size {block_size}: "
                     f"use --seq_len {block_size} or less")
    running = [name for name in SECTIONS if getattr(args, name)]
    if not running and not args.fit:   # none given = all but --fit, which trains models for minutes
        running = list(SECTIONS)
    for section, names in SECTION_FLAGS.items():   # a section's flag where it does not run would be ignored
        if section in running or (section == "fit" and args.fit):
            continue
        for name in names:
            if name in given:
                parser.error(f"--{name} is a --{section} flag: add --{section}, or leave --{name} out")
    if "measure" in running:   # a model the machine cannot hold: each rank would end in an allocator error
        # stage 0, fp32 AdamW: 16Ψ of model states, 16Ψ more in the snapshot that finds what backward changes,
        # and the activations, kept and snapshotted (the small preset: 39.8Ψ peak measured)
        need = max(args.world) * 40 * num_params(PRESETS[args.model])
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")   # (the machine's memory)
        if need > have:
            parser.error(f"--measure --model {args.model} would hold about {need / 1e9:.0f} GB on this machine "
                         f"({max(args.world)} rank(s) x 40Ψ bytes at stage 0), more than its {have / 1e9:.0f} GB: "
                         f"use --simulate for the paper's sizes (meta tensors, no memory), or a smaller --model")
    chosen = [SECTIONS[name] for name in running]
    tables = {}
    for section in chosen + ([fit_section] if args.fit else []):
        tables.update(section(args))
    if args.json:
        print(json.dumps({key: dict(heading=t["heading"], rows=t["rows"]) for key, t in tables.items()},
                         ensure_ascii=False))
    else:
        for t in tables.values():
            print(f"\n{t['heading']}\n{'=' * len(t['heading'])}\n{t['text']}")
    return tables


if __name__ == "__main__":
    main()
