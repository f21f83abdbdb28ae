"""The CUDA path: NCCL, the CUDA allocator, train.py on every GPU. Skipped, with the reason, on
a machine without GPUs (CI has none).

    python -m pytest test_cuda.py          # on a machine with one or more GPUs
"""
import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import memory_table as mt
import zero
from helpers import pairwise_sum
from ranks import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU here: the NCCL and CUDA-allocator paths run only on one")
NGPU = torch.cuda.device_count()
HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun_train(*flags, **env):
    """train.py with `flags` on NGPU ranks, one per GPU (on the CPU with CUDA_VISIBLE_DEVICES=""):
    its finished process, which must have succeeded."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NGPU}",
           os.path.join(HERE, "train.py"), *flags]
    env = {**{k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}, **env}  # (train.py sets it)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=HERE, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_train(tmp_path, *flags):
    out = tmp_path / f"log{'_'.join(flags).replace('-', '')}.json"
    torchrun_train("--steps", "20", "--eval_every", "10", "--out", str(out), *flags)
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_train_runs_on_every_gpu(tmp_path, stage):
    log = run_train(tmp_path, "--stage", str(stage))
    losses = [row["loss"] for row in log["log"]]
    print(f"stage {stage} on {NGPU} GPUs: losses {losses[0]:.4f} -> {losses[-1]:.4f}, sample {log['sample'][:40]!r}")
    assert log["backend"] == "nccl" and losses[-1] < losses[0] and log["sample"].startswith("def ")


def test_stages_give_the_same_losses_under_deterministic_algorithms(tmp_path):
    curves = {s: [row["loss"] for row in run_train(tmp_path, "--stage", str(s), "--deterministic")["log"]]
              for s in (0, 1, 2, 3)}
    assert curves[0] == curves[1] == curves[2] == curves[3], curves


def test_the_memory_line_counts_what_the_forward_keeps_not_cublas_workspaces():
    """train.py's "activations kept at the end of forward" on the GPUs against the same run's live
    tensors on the CPU (CUDA_VISIBLE_DEVICES empty), within 10%. A thread's first matmul makes its
    cuBLAS workspace (32 MiB on Hopper), which the first forward counted as kept: 54.60 MB against
    20.00 on one H200; from the second step 20.92 (the allocator rounds each block up to 512 B)."""
    def kept(**env):
        line = re.search(r"memory at step (\d) \((.+?)\): activations kept at the end of forward ([\d.]+) MB",
                         torchrun_train("--steps", "2", "--eval_every", "2", **env).stdout)
        print(line.group(0))
        return line.group(2), float(line.group(3))
    (gpu_source, gpu), (cpu_source, cpu) = kept(), kept(CUDA_VISIBLE_DEVICES="")
    assert (gpu_source, cpu_source) == ("CUDA allocator", "live tensors")
    assert abs(gpu - cpu) <= 0.1 * cpu, (gpu, cpu)


def on_rank_exact_reduction(numel):
    """zero's exact reduce-scatter of one bucket on NCCL, and the pairwise sum of every rank's
    bucket computed here from an all-gather of them."""
    device = torch.device("cuda", torch.cuda.current_device())
    nd, rank = dist.get_world_size(), dist.get_rank()
    param = torch.nn.Parameter(torch.empty(numel, device=device))
    part = zero.FlatPartition([param], [([param], True)], None, numel, "exact", device, {param: "w"})
    chunk = part.buckets[0].chunk
    g = torch.Generator(device=device).manual_seed(rank)
    bucket = torch.randn(chunk * nd, device=device, generator=g)
    everyone = [torch.empty_like(bucket) for _ in range(nd)]
    dist.all_gather(everyone, bucket)
    want = pairwise_sum([b[rank * chunk:(rank + 1) * chunk] / nd for b in everyone])
    got = torch.empty(chunk, device=device)
    part.finish_reduce(part.reduce_scatter(bucket, 0), got, add=False)
    return bool(torch.equal(got, want))


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs or more for a reduction across ranks")
def test_exact_reduction_on_nccl_equals_the_pairwise_sum():
    assert run_on_ranks(NGPU, on_rank_exact_reduction, 1_000_003, backend="nccl") == [True] * NGPU


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cuda_memory_after_backward_is_section_5(stage):
    """The CUDA allocator after the second backward, beyond what was there before the model:
    Section 5's model states (fp32 AdamW, K = 8), up to padding and the step counters."""
    for psi, split, activations, allocated in run_on_ranks(NGPU, mt.measure_on_rank, stage, "fp32", "tiny",
                                                           backend="nccl"):
        formula = sum(mt.model_state_terms(psi, NGPU, stage, 8, 4, 4))
        print(f"stage {stage}: allocator {allocated} B, live tensors {sum(split)} B, formula {formula:.0f} B")
        assert 0.99 * formula <= allocated <= 1.02 * formula + 8 * zero.ALIGN * NGPU * 100


def test_memory_table_measure_runs_on_nccl():
    out = subprocess.run([sys.executable, "memory_table.py", "--measure", "--world", str(NGPU)],
                         capture_output=True, text=True, timeout=600, cwd=HERE)
    assert out.returncode == 0 and "NCCL ranks, one GPU each" in out.stdout, out.stderr[-2000:]
    print(out.stdout)


@pytest.mark.parametrize("mode", [dict(), dict(cpu=True), dict(cpu=True, contiguous=True)], ids=["full", "cpu", "cpu+M_D"])
def test_checkpointing_recomputes_dropout_with_the_gpus_random_state(mode):
    """The kept input of P_a+cpu is in CPU memory; checkpoint must still save and restore the
    GPU's RNG, or dropout draws another mask in the recomputation: gradients torch.equal."""
    def grads(checkpointed):
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5))
                                     for _ in range(3)).cuda()
        if checkpointed:
            zero.checkpoint_activations(blocks, **mode)
        x = torch.randn(8, 64, device="cuda", requires_grad=True)
        for b in blocks:
            x = b(x)
        x.pow(2).sum().backward()
        return [p.grad for p in blocks.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads(True), grads(False), strict=True))


def on_rank_clip_norm(stage, device_type="cuda"):
    """zero's clip_grad_norm_ and torch.nn.utils.clip_grad_norm_ on the same gradient: every rank
    takes the same batch, so the rank average is the gradient itself (exact when Nd is a power of
    2); the first layer's weight (524,288 elements) spans many chunks of CUDA's foreach kernels."""
    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else 0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 7)).to(device)
    plain = copy.deepcopy(net)
    model, opt = zero.initialize(net, torch.optim.SGD, stage=stage, lr=0.1, bucket_numel=2**16)
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(1)).to(device)
    model(x).square().mean().backward()
    got = opt.clip_grad_norm_(1.0)
    plain(x).square().mean().backward()
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    return bool(torch.equal(got, want)), got.item(), want.item()


@pytest.mark.skipif(NGPU & (NGPU - 1) != 0, reason="needs a power-of-2 number of GPUs: the mean of Nd equal "
                                                   "gradients is then exactly the gradient")
@pytest.mark.parametrize("stage", [0, 3])
def test_clip_norm_on_cuda_is_torchs(stage):
    """clip_grad_norm_'s bits on CUDA: each gradient's norm by the kernel torch's clip takes it with
    there (torch._foreach_norm), whole on one rank."""
    for equal, got, want in run_on_ranks(NGPU, on_rank_clip_norm, stage, backend="nccl"):
        print(f"stage {stage}: zero {got!r}, torch {want!r}")
        assert equal, (got, want)
