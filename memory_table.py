"""
memory_table.py -- the paper's memory tables, recomputed from its formulas and set beside the
published numbers.

ZeRO (Rajbhandari et al. 2020) sizes every stage of ZeRO-DP by one formula per stage (Section 5,
Figure 1). This file evaluates those formulas for the paper's Table 1 (per-device model-state
memory) and Table 2 (largest model that fits on 32 GB devices), prints our value next to the
published one, and marks where they agree.

    python memory_table.py                      # every section
    python memory_table.py --formula            # Tables 1 and 2 by formula
    python memory_table.py --formula --json     # the same rows as one JSON object
    .venv/bin/python -m pytest -q test_memory_table.py

    python memory_table.py --simulate           # zero.py itself at 7.5B / Nd 64 and 128B / Nd 256
    python memory_table.py --simulate --sizes 1t   # 1T at Nd 1024 (slow: minutes per stage)

--measure and --comm (with --world and --model) are placeholders for later sections.
GB means 10^9 bytes throughout, as in the paper.
"""
import argparse
import json
import time
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

from tabulate import tabulate

STAGES = ["baseline", "P_os", "P_os+g", "P_os+g+p"]   # stage 0 (plain DP), 1, 2, 3
GB = 1e9                                              # bytes; the paper's GB

# ---------------------------------------------------------------------------
# Section 5 / Figure 1 -- model states per device, by stage
# Mixed-precision Adam: fp16 parameters 2Ψ, fp16 gradients 2Ψ, optimizer states KΨ (K = 12:
# fp32 master parameters, momentum, variance). Each stage divides one more term by Nd:
#   baseline (2 + 2 + K)Ψ,  P_os 2Ψ + 2Ψ + KΨ/Nd,  P_os+g 2Ψ + (2 + K)Ψ/Nd,  P_os+g+p (2 + 2 + K)Ψ/Nd
# ---------------------------------------------------------------------------

def model_state_bytes(psi, nd, stage, K=12, param_bytes=2, grad_bytes=2):
    """Bytes of model states on one device: psi parameters, data-parallel degree nd, ZeRO stage."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (got {stage!r})")
    if nd < 1:
        raise ValueError(f"nd must be a positive data-parallel degree (got {nd!r})")
    params = param_bytes * psi / (nd if stage >= 3 else 1)   # fp16 parameters: split at P_os+g+p
    grads = grad_bytes * psi / (nd if stage >= 2 else 1)     # fp16 gradients: split from P_os+g
    optim = K * psi / (nd if stage >= 1 else 1)              # optimizer states: split from P_os
    return params + grads + optim


def agrees(ours, published_text):
    """Does our number agree with a published cell, as printed?

    The cell has d decimals; ours agrees if rounding it to d decimals (half up) or truncating it
    to d decimals gives the cell (the paper truncates some: 4187.5 -> 4187, 513.5 -> 513). A B or
    T suffix ("7.6B", "0.5T") means ours is a parameter count, divided by 1e9 or 1e12 first.
    """
    text = published_text.strip()
    scale = {"B": 1e9, "T": 1e12}.get(text[-1:], 1)
    number = Decimal(text.rstrip("BT"))
    value = Decimal(repr(ours / scale))                # repr: the shortest decimal of the float
    step = Decimal(1).scaleb(number.as_tuple().exponent)   # 1, 0.1, 0.01 for d = 0, 1, 2
    return number in (value.quantize(step, ROUND_HALF_UP), value.quantize(step, ROUND_DOWN))


def _fmt(x):
    """The float's shortest exact decimal, without a trailing .0: 120, 0.1171875, 30.087890625."""
    return repr(float(x)).removesuffix(".0")


# ---------------------------------------------------------------------------
# Table 1 (Section 5) -- per-device model-state memory in GB, K = 12
# ---------------------------------------------------------------------------

TABLE1_PSI = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}    # the paper's round Ψ, not gpt.py's
TABLE1_ND = [1, 4, 16, 64, 256, 1024]
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
        for nd in TABLE1_ND:
            for stage in (1, 2, 3):
                gb = model_state_bytes(psi, nd, stage) / GB
                published = TABLE1_PUBLISHED[model][nd][stage - 1]
                rows.append(dict(model=model, psi=psi, nd=nd, stage=stage, name=STAGES[stage],
                                 gb=gb, published=published, agrees=agrees(gb, published)))
    return rows


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


# ---------------------------------------------------------------------------
# Sections: each returns {key: {"heading", "rows", "text"}}; main prints text or JSON.
# ---------------------------------------------------------------------------

def _cell(ours, published, ok):
    return f"{ours} | {published} {'✓' if ok else '✗'}"


def table1_text(rows):
    """Pivot the 54 cells back to the paper's shape: one line per (Ψ, Nd), one column per stage."""
    lines = {}
    for r in rows:
        lines.setdefault((r["model"], r["nd"]), []).append(_cell(_fmt(r["gb"]), r["published"], r["agrees"]))
    table = [[model, nd, *cells] for (model, nd), cells in lines.items()]
    headers = ["Ψ", "Nd"] + [f"{s}: ours | paper" for s in STAGES[1:]]
    return tabulate(table, headers, disable_numparse=True) + "\n" + AGREEMENT_RULE


def table2_text(rows):
    """One line per MP; ours in the published cell's unit (B or T), then the measured columns."""
    lines = {}
    for r in rows:
        unit = r["published"][-1]                                 # "B" or "T"
        ours = f"{r['psi'] / {'B': 1e9, 'T': 1e12}[unit]:.5g}{unit}"
        lines.setdefault(r["mp"], []).append(_cell(ours, r["published"], r["agrees"]))
    table = [[mp, mp * TABLE2_ND, *cells, *TABLE2_PUBLISHED[mp][4:]] for mp, cells in lines.items()]
    headers = ["MP", "GPUs", *STAGES, "measured: baseline", "measured: P_os"]
    return "each cell: ours | paper\n" + tabulate(table, headers, disable_numparse=True) + "\n" + TABLE2_NOTE


def formula_section(args):
    """Sections 1-2 of issue 5: Tables 1 and 2 by formula."""
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
# running zero.py's own code as rank 0: initialize, one forward and backward, one step. The
# bytes are counted from the tensors then alive (meta tensors have sizes, not data).
# ---------------------------------------------------------------------------

SIMULATED = [("7.5b", "7.5B", 64), ("128b", "128B", 256), ("1t", "1T", 1024)]


def meta_model_state_bytes():
    """Bytes of every meta tensor alive (and of its .grad), each storage once."""
    import gc
    import torch
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "meta":
            for t in (obj, obj.grad):
                if t is not None:
                    storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(storages.values())


def simulate(preset, nd, stage):
    """Per-rank model-state bytes of zero.py at `stage` for a meta GPT on a fake world of nd."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import zero
    from gpt import GPT, PRESETS
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=nd)
    before = meta_model_state_bytes()  # what an earlier simulation may have left, not yet collected
    try:
        module = GPT(PRESETS[preset], device="meta")
        psi = sum(p.numel() for p in module.parameters())
        model, optimizer = zero.initialize(module, torch.optim.AdamW, stage=stage, param_dtype=torch.bfloat16,
                                           bucket_numel=2**28, stage3_units=module.h, lr=1e-4)
        idx = torch.zeros(1, 8, dtype=torch.long, device="meta")
        optimizer.backward(model(idx, idx)[1])
        optimizer.step()  # the optimizer states exist from here on
        optimizer.zero_grad()
        optimizer.backward(model(idx, idx)[1])  # after backward, as in the paper's accounting
        measured = meta_model_state_bytes() - before - idx.numel() * idx.element_size()
        del model, optimizer, module
        return psi, measured
    finally:
        dist.destroy_process_group()


def simulate_section(args):
    rows = []
    for preset, paper_model, nd in [m for m in SIMULATED if m[0] in args.sizes]:
        for stage in (1, 2, 3):
            t0 = time.perf_counter()
            psi, measured = simulate(preset, nd, stage)
            formula = model_state_bytes(psi, nd, stage)
            rows.append(dict(model=preset, psi=psi, nd=nd, stage=stage, name=STAGES[stage], measured_gb=measured / GB,
                             formula_gb=formula / GB, ratio=measured / formula,
                             published_gb=TABLE1_PUBLISHED[paper_model][nd][stage - 1],
                             seconds=time.perf_counter() - t0))
    table = [[r["model"], f"{r['psi'] / 1e9:.2f}B", r["nd"], r["name"], f"{r['measured_gb']:.4f}",
              f"{r['formula_gb']:.4f}", f"{r['ratio']:.5f}", r["published_gb"], f"{r['seconds']:.1f}"] for r in rows]
    headers = ["model", "Ψ", "Nd", "stage", "measured GB/rank", "formula GB", "ratio", "Table 1 (Ψ rounded)", "s"]
    text = (tabulate(table, headers, disable_numparse=True) +
            "\nmeasured: bytes of the meta tensors alive after backward on rank 0 of a fake world of Nd ranks,\n"
            "zero.py's real partitioning (bf16 parameters and gradients, fp32 master + Adam: K = 12); formula:\n"
            "Section 5 for gpt.py's exact Ψ; Table 1's cell is for the paper's round Ψ.")
    return {"simulate": dict(heading="Simulated at the paper's scale: zero.py on meta models in a fake world",
                             rows=rows, text=text)}


def not_implemented(name):
    """TODO(issue 5, sections 3-5): replace each stub in SECTIONS with its real section."""
    def section(args):
        return {name: dict(heading=f"--{name}", rows=[], text=f"--{name}: not implemented yet")}
    return section


SECTIONS = {  # flag -> section, in the order they print
    "formula": formula_section,
    "measure": not_implemented("measure"),
    "simulate": simulate_section,
    "comm": not_implemented("comm"),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description="ZeRO's memory tables by formula, beside the paper's.")
    for name in SECTIONS:
        parser.add_argument(f"--{name}", action="store_true", help=f"print the {name} section")
    parser.add_argument("--json", action="store_true", help="one JSON object of every table's rows")
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2, 4], help="world sizes (later sections)")
    parser.add_argument("--model", default="tiny", help="a gpt.py preset (later sections)")
    parser.add_argument("--sizes", nargs="+", default=["7.5b", "128b"], choices=[m[0] for m in SIMULATED],
                        help="models --simulate runs (1t at Nd 1024 takes about 5 minutes a stage here)")
    args = parser.parse_args(argv)
    chosen = [name for name in SECTIONS if getattr(args, name)] or list(SECTIONS)   # none given = all
    tables = {}
    for name in chosen:
        tables.update(SECTIONS[name](args))
    if args.json:
        print(json.dumps({key: dict(heading=t["heading"], rows=t["rows"]) for key, t in tables.items()},
                         ensure_ascii=False))
    else:
        for t in tables.values():
            print(f"\n{t['heading']}\n{'=' * len(t['heading'])}\n{t['text']}")
    return tables


if __name__ == "__main__":
    main()
