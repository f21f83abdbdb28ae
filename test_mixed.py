"""Mixed precision, fp16 loss scaling, gradient accumulation and clipping, bit for bit.

    python -m pytest -n 2 test_mixed.py

The reference is written here on torch's DDP: a 16-bit model whose gradients DDP averages
(with the pairwise comm hook at world size 3+, see helpers.pairwise_hook), and an fp32
master copy of its weights updated by torch.optim.AdamW after torch.nn.utils.clip_grad_norm_.
Accumulation semantics, the same on both sides: each micro-batch's gradient is averaged over
ranks on its own (in the reduction dtype), and the averages are summed in micro-batch order.
fp16: the fp32 loss times the loss scale is backpropagated; the summed gradient, cast to fp32,
is checked for inf/nan (on any rank), unscaled as GradScaler does (times the scale's reciprocal),
clipped, then stepped.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zero
from helpers import VOCAB, compare, make_model, pairwise_hook, pairwise_sum, usage
from ranks import settled

STEPS, MICRO, MAX_NORM = 5, 4, 0.05  # MAX_NORM: below every step's gradient norm, so clipping acts
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OVERFLOW_STEP = 2  # fp16: an inf in one element of one rank's gradient, in this step's second micro-batch
OPTIM = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def micro_batch(step, m):
    g = torch.Generator().manual_seed(10_000 * step + 100 * m + dist.get_rank())
    return torch.randint(0, VOCAB, (2, 5), generator=g), torch.randint(0, VOCAB, (2, 5), generator=g)


def groups(params):
    return [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2],
                                                              "weight_decay": 0.0}]


def loss_of(model, step, m):
    x, y = micro_batch(step, m)
    logits = model(x, *usage(step * MICRO + m, dist.get_rank(), symmetric=True))
    return F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1)) / MICRO


def inject_overflow(model, dtype_name, step, m):
    """fp16: a hook that makes one gradient element inf on rank 0 only; None when not this micro-batch."""
    if dtype_name == "fp16" and step == OVERFLOW_STEP and m == 1 and dist.get_rank() == 0:
        return model.fc1.weight.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                                    torch.tensor(float("inf"), dtype=g.dtype)))
    return None


def reduce_fp32_by_hand(model, trainable):
    """What DDP cannot do for reduce_dtype=fp32 (its hook's result is written back into the
    16-bit gradient): each rank's 16-bit gradient cast to fp32 and divided by Nd, gathered, summed
    in zero's order (helpers.pairwise_sum), as fp32; None for a parameter no rank used
    (find_unused_parameters)."""
    nd = dist.get_world_size()
    used = torch.tensor([p.grad is not None for p, w in trainable], dtype=torch.int32)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    reduced = []
    for (p, w), u in zip(trainable, used.tolist()):
        g = (p.grad.float() if p.grad is not None else torch.zeros(p.shape)) / nd
        parts = [torch.empty_like(g) for _ in range(nd)]
        dist.all_gather(parts, g)
        reduced.append(pairwise_sum(parts) if u else None)
    return reduced  # fp32, in trainable's order


def reference(dtype_name, fp16_scale, reduce32=False):
    dtype = DTYPES[dtype_name]
    model = make_model()
    for p in model.parameters():
        dist.broadcast(p.data, src=0)  # rank 0's fp32 weights, as zero and DDP both start from
    names = [n for n, p in model.named_parameters()]
    name_of = {p: n for n, p in model.named_parameters()}
    masters = [p.detach().clone() for p in model.parameters()]  # fp32, frozen ones too
    trainable = [(p, w) for p, w in zip(model.parameters(), masters) if p.requires_grad]
    model.to(dtype)
    ddp = DDP(model, find_unused_parameters=True) if not reduce32 else model
    if dist.get_world_size() >= 3 and not reduce32:
        ddp.register_comm_hook(None, pairwise_hook)
    opt = torch.optim.AdamW(groups([w for p, w in trainable]), **OPTIM)
    scale, clean = fp16_scale, 0
    trajectory = []
    for step in range(STEPS):
        summed, losses = [None] * len(trainable), []
        for m in range(MICRO):
            if reduce32:  # DDP's buffer broadcast, by hand
                dist.broadcast(model.seen, src=0)
            loss = loss_of(ddp, step, m)
            handle = inject_overflow(model, dtype_name, step, m)
            (loss * scale if scale else loss).backward()
            if handle:
                handle.remove()
            reduced = reduce_fp32_by_hand(model, trainable) if reduce32 else [p.grad for p, w in trainable]
            for j, (p, w) in enumerate(trainable):
                if reduced[j] is not None:
                    summed[j] = reduced[j] if summed[j] is None else summed[j] + reduced[j]
                p.grad = None
            losses.append(loss.detach())
        grads = [None if g is None else g.float() for g in summed]
        stepped, norm = True, None
        if scale:
            overflow = any(not g.isfinite().all() for g in grads if g is not None)
            inv = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()  # as GradScaler.unscale_
            grads = [None if g is None else g * inv for g in grads]
            if overflow:
                scale, clean, stepped = scale * 0.5, 0, False
            else:
                clean += 1
        if stepped:
            for (p, w), g in zip(trainable, grads):
                w.grad = None if g is None else g.view(w.shape)
            norm = torch.nn.utils.clip_grad_norm_([w for p, w in trainable], MAX_NORM)
            opt.step()
            with torch.no_grad():
                for p, w in trainable:
                    p.copy_(w)  # fp32 master -> 16-bit parameter
        state = {n: w.clone() for n, w in zip(names, masters)}
        state["head.weight"] = state["emb.weight"]
        seen = model.seen.detach().clone()
        dist.broadcast(seen, src=0)
        state["seen"] = seen.float()
        optim = {name_of[p]: {k: v.clone() for k, v in opt.state[w].items()} for p, w in trainable if w in opt.state}
        trajectory.append((losses, stepped, norm, scale, state, optim))
    return trajectory


def on_rank_mixed_matches_reference(stage, dtype_name, reduce32=False):
    fp16_scale = 2.0**10 if dtype_name == "fp16" else None
    ref = reference(dtype_name, fp16_scale, reduce32)
    module = make_model()
    loss_scale = zero.DynamicLossScale(init_scale=fp16_scale) if fp16_scale else None
    model, opt = zero.initialize(module, torch.optim.AdamW, stage=stage, param_groups=groups(
        [p for p in module.parameters() if p.requires_grad]), param_dtype=DTYPES[dtype_name],
        loss_scale=loss_scale, bucket_numel=64, reduce_dtype=torch.float32 if reduce32 else None, **OPTIM)
    mismatches = []
    for step, (ref_losses, ref_stepped, ref_norm, ref_scale, ref_state, ref_optim) in enumerate(ref):
        for m in range(MICRO):
            loss = loss_of(model, step, m)
            handle = inject_overflow(model, dtype_name, step, m)
            opt.backward(loss)
            if handle:
                handle.remove()
            mismatches += compare(f"step {step} micro {m} loss", loss.detach(), ref_losses[m])
        norm = opt.clip_grad_norm_(MAX_NORM)  # inf or nan after an overflow; the step is skipped then
        stepped = opt.step()
        opt.zero_grad()
        if stepped != ref_stepped or opt.loss_scale != (ref_scale or 1.0):
            mismatches.append(f"step {step}: stepped {stepped} vs {ref_stepped}, scale {opt.loss_scale} vs {ref_scale}")
        if ref_norm is not None:
            mismatches += compare(f"step {step} clip norm", norm, ref_norm)
            if not ref_norm > MAX_NORM:
                mismatches.append(f"step {step}: norm {ref_norm} does not exceed {MAX_NORM}: clipping idle")
        mismatches += compare(f"step {step} state", zero.full_state_dict(model), ref_state)
        mismatches += compare(f"step {step} optimizer", zero.full_optimizer_state(model), ref_optim)
    if dtype_name == "fp16" and ref[OVERFLOW_STEP][1]:
        mismatches.append("the forced overflow did not skip a step")
    return mismatches


CASES = [pytest.param(nd, marks=pytest.mark.xdist_group(f"world{nd}")) for nd in (2, 4)]


@pytest.mark.parametrize("nd", CASES)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_accumulation_clipping_match_reference_bitwise(world, stage, dtype_name, nd):
    """4 micro-batches a step, clipping active on every step, bf16, and fp16 with a forced
    overflow on one rank that every rank skips: losses, clip norms, loss scale, fp32 master
    weights and optimizer states torch.equal to the DDP-based reference."""
    assert world(nd).run(on_rank_mixed_matches_reference, stage, dtype_name) == [[]] * nd


@pytest.mark.xdist_group("world4")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_with_fp32_reduction_matches_a_hand_written_reference_bitwise(world, stage):
    """reduce_dtype=torch.float32 with bf16 parameters: the rank-order sum in fp32."""
    assert world(4).run(on_rank_mixed_matches_reference, stage, "bf16", True) == [[]] * 4


def on_rank_loss_scale_schedule(stage):
    """Three clean steps, four that overflow, one clean: the loss scale after each, whether each
    stepped, and whether the weight moved."""
    torch.manual_seed(0)
    scaler = zero.DynamicLossScale(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2,
                                   min_scale=2.0)
    model, opt = zero.initialize(torch.nn.Linear(4, 4), torch.optim.SGD, stage=stage, param_dtype=torch.float16,
                                 loss_scale=scaler, lr=0.1)
    scales, stepped, moved = [], [], []
    for overflow in (False, False, False, True, True, True, True, False):
        before = zero.full_state_dict(model)["weight"]
        loss = model(torch.ones(2, 4, dtype=torch.float16)).float().sum()
        opt.backward(loss * float("inf") if overflow else loss)
        stepped.append(opt.step())
        opt.zero_grad()
        scales.append(opt.loss_scale)
        moved.append(not torch.equal(zero.full_state_dict(model)["weight"], before))
    return scales, stepped, moved


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 3])
def test_dynamic_loss_scale_grows_backs_off_and_stops_at_min_scale(world, stage):
    """DynamicLossScale's rule: times growth_factor after growth_interval clean steps (here 2),
    times backoff_factor on an overflow, whose step is skipped on every rank with the weights
    untouched, and never below min_scale: 8, 16, 16, then 8, 4, 2, 2, then 2."""
    for scales, stepped, moved in world(2).run(on_rank_loss_scale_schedule, stage):
        assert scales == [8.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0, 2.0], scales
        assert stepped == moved == [True, True, True, False, False, False, False, True], (stepped, moved)


def on_rank_growing_scale_unscales_by_the_scale_of_the_backward(stage):
    """fp16, SGD with lr 0.25, the loss scale grown after every clean step; loss = sum(w . 1) from
    w = 0, so each gradient is exactly 1: each step's update, read from the fp32 master."""
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    scaler = zero.DynamicLossScale(init_scale=8.0, growth_interval=1)
    model, opt = zero.initialize(model, torch.optim.SGD, stage=stage, param_dtype=torch.float16, loss_scale=scaler,
                                 lr=0.25)
    updates, scales = [], []
    for step in range(4):
        before = zero.full_state_dict(model)["weight"]
        opt.backward(model(torch.ones(1, 4, dtype=torch.float16)).float().sum())
        opt.step()
        opt.zero_grad()
        updates.append(before - zero.full_state_dict(model)["weight"])
        scales.append(opt.loss_scale)
    return updates, scales


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [0, 3])
def test_a_growing_loss_scale_unscales_the_step_it_grows_in(world, stage):
    """The scale grows after the step has unscaled its gradients by the scale their backward was
    scaled with (as torch's GradScaler.update after step), so a step that grows it updates by
    lr x the gradient, not half of it: 0.25 each step, exactly, while the scale goes 16, 32, 64, 128."""
    for updates, scales in world(2).run(on_rank_growing_scale_unscales_by_the_scale_of_the_backward, stage):
        print("updates", [u.tolist() for u in updates], "scales", scales)
        assert all(torch.equal(u, torch.full((1, 4), 0.25)) for u in updates), updates
        assert scales == [16.0, 32.0, 64.0, 128.0], scales


def on_rank_unscale_like_grad_scaler(scale):
    """fp16 over an fp32 master with a static loss scale, SGD lr 1, one step: zero's weights, and
    torch's: the same fp16 model's gradient as an fp32 master's, through GradScaler.unscale_."""
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(64, 16, bias=False), torch.randn(32, 64)
    start = linear.weight.detach().clone()
    model, opt = zero.initialize(linear, torch.optim.SGD, stage=0, param_dtype=torch.float16, loss_scale=scale, lr=1.0)
    opt.backward(model(x.half()).float().square().mean())
    assert opt.step()
    ref16 = torch.nn.Linear(64, 16, bias=False).half()
    ref16.weight.data.copy_(start.half())
    master = start.clone().requires_grad_(True)
    sgd, scaler = torch.optim.SGD([master], lr=1.0), torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(ref16(x.half()).float().square().mean()).backward()
    master.grad = ref16.weight.grad.float()
    scaler.unscale_(sgd)
    scaler.step(sgd)
    return zero.full_state_dict(model)["weight"], master.detach()


@pytest.mark.xdist_group("world1")
@pytest.mark.parametrize("scale", [1024.0, 1000.0, 3.0])
def test_unscaling_is_grad_scalers_bit_for_bit(world, scale):
    """GradScaler multiplies by the reciprocal of its fp32 scale (computed in fp64), which for a
    scale that is not a power of 2 differs from dividing by it in the last bit of some elements."""
    got, want = world(1).run(on_rank_unscale_like_grad_scaler, scale)[0]
    print(f"scale {scale}: {(got != want).sum().item()} of {got.numel()} elements differ")
    assert torch.equal(got, want)


def on_rank_fp16_gradients_average_as_ddp(reduction):
    """fp16 parameters, a loss scale of 1, an MLP whose fp16 gradients include values below fp16's
    smallest normal (2^-14), where halving rounds: zero's averaged gradient (stage 0 holds it whole)
    against DDP's, element by element, and how many of DDP's are that small."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).half()
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 64, generator=g).half(), torch.randint(0, 10, (32,), generator=g)
    ddp_module = net()
    ddp = DDP(ddp_module)  # (kept: its reducer averages in backward)
    F.cross_entropy(ddp(x).float(), y).backward()
    want = torch.cat([p.grad.reshape(-1) for p in ddp_module.parameters()])
    model, opt = zero.initialize(net(), torch.optim.SGD, stage=0, param_dtype=torch.float16, loss_scale=1.0,
                                 reduction=reduction, lr=0.1)
    opt.backward(F.cross_entropy(model(x).float(), y))
    opt._reduce()
    part = opt.partition
    got = torch.cat([opt.gradients.reduced[a:a + p.numel()] for p, a in zip(part.params, part.offsets)])
    return (got != want).sum().item(), ((want != 0) & (want.abs() < 2.0**-14)).sum().item(), want.numel()


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("reduction", ["exact", "native"])
def test_fp16_gradients_average_to_ddps_bits(world, reduction):
    """Each rank divides its gradients by Nd before they are summed, as DDP does: at Nd 2 the mean
    is DDP's bit for bit even where fp16 halves a value with rounding (dividing the sum instead
    differed in 40 of these 19,210 elements)."""
    for differ, small, n in world(2).run(on_rank_fp16_gradients_average_as_ddp, reduction):
        print(f"{differ} of {n} averaged gradient elements differ from DDP's; {small} of DDP's are subnormal")
        assert small > 100 and differ == 0


def on_rank_padding_is_not_an_overflow(stage):
    """Two steps with a static loss scale, every new tensor made during backward first filled
    with NaN (what uninitialised memory may hold, on a GPU especially): whether each stepped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    model, opt = zero.initialize(model, torch.optim.SGD, stage=stage, bucket_numel=20, loss_scale=1024.0, lr=0.1)
    real, stepped = torch.empty, []

    def garbage(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    for step in range(2):
        loss = model(torch.randn(4, 5)).square().mean()
        torch.empty = garbage
        try:
            opt.backward(loss)
        finally:
            torch.empty = real
        stepped.append(opt.step())
        opt.zero_grad()
    return stepped


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_buckets_padding_is_zero_not_an_overflow(world, stage):
    """A bucket made during backward is empty memory; its padding (a run's last bucket rounds up
    to whole chunks) is zeroed, else garbage there is summed and read as an overflow."""
    assert world(2).run(on_rank_padding_is_not_an_overflow, stage) == [[True, True]] * 2


# -----------------------------------------------------------------------------------------
# K = 12: bytes alive after backward, bf16 parameters and gradients, fp32 master + Adam states
# -----------------------------------------------------------------------------------------
def on_rank_bf16_model_state_bytes(stage):
    before = zero.live_storages()
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(128, 257), torch.nn.GELU(), torch.nn.Linear(257, 131),
                              torch.nn.GELU(), torch.nn.Linear(131, 7))
    model, opt = zero.initialize(mlp, torch.optim.AdamW, stage=stage, param_dtype=torch.bfloat16,
                                 bucket_numel=5000, lr=1e-3)
    for step in range(2):
        x, y = torch.randn(8, 128, dtype=torch.bfloat16), torch.randn(8, 7)
        loss = F.mse_loss(model(x).float(), y)
        opt.backward(loss)
        if step == 0:
            opt.step()
            opt.zero_grad()
    del loss
    dist.barrier()  # every earlier collective done, on every rank
    inputs = {x.untyped_storage()._cdata, y.untyped_storage()._cdata}
    measured = settled(lambda: sum(s.nbytes() for ptr, s in zero.live_storages().items()
                                   if ptr not in before and ptr not in inputs))
    return measured, sum(p.numel() for p in mlp.parameters()), len(list(mlp.parameters()))


@pytest.mark.parametrize("nd", CASES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_model_state_bytes_match_paper_formula_k12(world, stage, nd):
    """Section 5 with K = 12 (fp32 master 4 + momentum 4 + variance 4 bytes per parameter):
    baseline 2Ψ + 2Ψ + 12Ψ; P_os 2Ψ + 2Ψ + 12Ψ/Nd; P_os+g 2Ψ + 14Ψ/Nd; P_os+g+p 16Ψ/Nd.
    Up to padding (each chunk a multiple of zero.ALIGN elements: fewer than ALIGN x Nd padding
    elements per run of buckets, at most 16 bytes each, and no optimizer state on them; a run
    per Linear at stage 3) and AdamW's 4-byte step counter per parameter piece (a piece per
    parameter and bucket it lies in: at most 2 x parameters + Ψ / bucket)."""
    for measured, psi, n_params in world(nd).run(on_rank_bf16_model_state_bytes, stage):
        formula = {0: 16 * psi, 1: 2 * psi + 2 * psi + 12 * psi / nd,
                   2: 2 * psi + 14 * psi / nd, 3: 16 * psi / nd}[stage]
        padding = zero.ALIGN * nd * n_params  # elements, at most
        slack = 16 * padding + 4 * (2 * n_params + psi // (5000 // nd // zero.ALIGN * zero.ALIGN * nd))
        assert formula - 8 * padding <= measured <= formula + slack, (stage, nd, measured, formula, measured / formula)


def on_rank_bytes_after_the_step(stage, dtype):
    """(model_state_bytes, bytes of every live storage made since before the model) after the
    second backward and after the second step; and the error of a step() repeated without zero_grad."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
    x = torch.randn(16, 64, dtype=dtype)
    before = zero.live_storages()
    model, opt = zero.initialize(net, torch.optim.AdamW, stage=stage, bucket_numel=2**12, lr=1e-3, param_dtype=dtype)
    held = {}
    for step in range(2):
        opt.backward(model(x).float().square().mean())
        dist.barrier()  # every collective's buffers let go
        if step == 1:
            used = opt.gradients.used_flags[0][1].untyped_storage()._cdata  # read by the step
            held["backward"] = zero.model_state_bytes(model), settled(lambda: sum(
                s.nbytes() for k, s in zero.live_storages().items() if k not in before and k != used))
        opt.clip_grad_norm_(1.0)
        opt.step()
        if step == 1:
            held["step"] = zero.model_state_bytes(model), settled(lambda: sum(
                s.nbytes() for k, s in zero.live_storages().items() if k not in before))
            try:
                opt.step()
                again = None
            except RuntimeError as e:
                again = str(e)
        opt.zero_grad()
    return held, again


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_step_frees_its_gradient_copy(world, stage, dtype):
    """The step reads the gradient in the optimizer's dtype, a copy in bf16 training and at stage
    1 (its chunks gathered out of the full gradient), a window at a time. Once step() returns a
    rank holds what it held after backward, Section 5's model states, and model_state_bytes
    counts every byte there is."""
    for held, again in world(2).run(on_rank_bytes_after_the_step, stage, dtype):
        print(held)
        assert held["step"][0] == held["step"][1] == held["backward"][0] == held["backward"][1], held
        assert again and "call optimizer.zero_grad()" in again, again  # the gradients are gone


def on_rank_step_temporaries(stage, dtype, bucket_numel):
    """The most bytes clip_grad_norm_, then step(), hold at once in tensors they make (memory_table's
    PeakNewBytes), in the second step; SGD with momentum, which makes none of its own."""
    from memory_table import PeakNewBytes
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(16)])  # Ψ = 16 x 272
    x = torch.randn(8, 16, dtype=dtype)
    model, opt = zero.initialize(net, torch.optim.SGD, stage=stage, bucket_numel=bucket_numel, lr=1e-2,
                                 momentum=0.9, param_dtype=dtype)
    for step in range(2):
        opt.backward(model(x).float().square().mean())
        with PeakNewBytes() as clip:
            opt.clip_grad_norm_(1.0)
        with PeakNewBytes() as update:
            opt.step()
        opt.zero_grad()
    return clip.peak, update.peak


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_step_converts_one_bucket_of_gradient_at_a_time(world, stage, dtype):
    """C_B for the step (Section 6.2): the gradient in the optimizer's dtype (converted, unscaled,
    clipped) never exists for the whole shard at once. Ψ = 4352 over 2 ranks in buckets of 512
    elements. step() runs the optimizer a window at a time and holds at most one bucket in fp32
    (2 KB; fp16 16 B more: the scale's reciprocal, taken in fp64), none where the reduced shard is
    fp32 already (stage 1 keeps its chunks in the full gradient, out of own-space order).
    clip_grad_norm_ holds less than the shard in fp32 (8.7 KB; stage 0 owns everything: 17.4 KB):
    whole gradients of a bucket's worth of parameters and its round buffers; under fp16 it first
    checks for overflow, a reduced chunk at a time (over the whole reduced gradient at once, that
    check held 5 bytes an element: 21.8 KB at stages 0-1)."""
    bucket_numel, psi = 512, 16 * 272
    shard = psi if stage == 0 else psi / 2
    scale = 16 if dtype == torch.float16 else 0
    for clip, update in world(2).run(on_rank_step_temporaries, stage, dtype, bucket_numel):
        print(f"stage {stage} {dtype}: temporaries held at most by clip_grad_norm_ {clip} B, by step() {update} B")
        assert clip < 4 * shard and update <= 4 * bucket_numel + scale, (clip, update)
        if dtype == torch.float32 and stage != 1:  # the reduced shard is unscaled and clipped in place
            assert update == 0, update


def on_rank_written_bf16_parameters(stage):
    """WGAN's weight clipping between steps, over model.parameters() (which waits for the
    all-gather in flight), with bf16 parameters: the errors of the steps and full_state_dicts."""
    torch.manual_seed(0)
    model, opt = zero.initialize(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)),
                                 torch.optim.SGD, stage=stage, param_dtype=torch.bfloat16, lr=0.5)
    errors = []
    for step in range(2):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).bfloat16()).float().square().mean().backward()
        try:
            opt.step()
        except RuntimeError as e:
            errors.append(str(e))
        opt.zero_grad()
        if stage < 3:  # (at stage 3 it raises inside torch: its stand-in holds one element for all)
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.1, 0.1)
            try:  # (it would hand back the fp32 master without the write)
                zero.full_state_dict(model)
            except RuntimeError as e:
                errors.append(str(e))
    return errors


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_write_into_bf16_parameters_that_the_fp32_master_would_undo_names_the_fix(world, stage):
    """With bf16 parameters the optimizer steps the fp32 master (Section 3.1) and copies it over
    the parameters: a write into them between steps would be undone by the next step, so that
    step raises, naming the fix, on every rank, and so does full_state_dict before it."""
    for errors in world(2).run(on_rank_written_bf16_parameters, stage):
        assert len(errors) == 3 and all("fp32 master" in e and "without param_dtype" in e for e in errors), errors


def on_rank_autocast_training(stage, recipe, settings=None):
    """torch.autocast over fp32 parameters, 6 steps of AdamW with clipping, DDP (stage None) or
    zero. "bf16": no scaler. "fp16": DDP with torch.amp.GradScaler (unscale_, clip, step,
    update), zero with loss_scale=DynamicLossScale of the same settings and optimizer.backward;
    the scale starts high enough to overflow, and an inf on rank 0 in step 3. Per step: the scale
    after it and the clip's norm; then the weights. settings: the scalers' (init_scale, factors)."""
    model = make_model()
    settings = settings or dict(init_scale=2.0**16, growth_interval=2)
    if stage is None:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        run, opt = DDP(model, find_unused_parameters=True), torch.optim.AdamW(model.parameters(), **OPTIM)
        scaler = torch.amp.GradScaler("cpu", **settings) if recipe == "fp16" else None
    else:
        loss_scale = zero.DynamicLossScale(**settings, min_scale=0.0) if recipe == "fp16" else None  # (no floor)
        run, opt = zero.initialize(model, torch.optim.AdamW, stage=stage, **OPTIM, loss_scale=loss_scale)
    log = []
    for step in range(6):
        x, y = micro_batch(step, 0)
        with torch.autocast("cpu", dtype=DTYPES[recipe]):
            logits = run(x, *usage(step, dist.get_rank(), symmetric=True))
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1))
        inf = step == 3 and dist.get_rank() == 0 and recipe == "fp16"
        handle = model.fc1.weight.register_hook(lambda g: g * float("inf")) if inf else None
        if stage is not None:  # zero: its own loss scaling and clip
            opt.backward(loss)
            norm = opt.clip_grad_norm_(MAX_NORM)
            opt.step()
        elif scaler:  # torch's recipe: unscale_, clip, step, update
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
        if handle:
            handle.remove()
        opt.zero_grad()
        scale = (scaler.get_scale() if stage is None else opt.loss_scale) if recipe == "fp16" else None
        log.append((scale, norm.item()))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()} if stage is None else \
        {n: t for n, t in zero.full_state_dict(run).items() if n in dict(model.named_parameters())}
    return log, weights


def on_rank_autocast_against_ddp(stage, recipe, settings=None):
    (want_log, want), (got_log, got) = [on_rank_autocast_training(s, recipe, settings) for s in (None, stage)]
    return want_log, got_log, [n for n in want if not torch.equal(want[n], got[n])]


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_autocast_and_grad_scalers_recipe_give_ddps_bits(world, stage, recipe):
    """torch's mixed precision recipe carried over: torch.autocast over fp32 parameters gives
    DDP's bits at every stage; for fp16, zero's loss_scale=DynamicLossScale in place of
    torch.amp.GradScaler gives GradScaler's scales, skipped steps and clip norms, and the same
    weights (both multiply by the fp32 scale's reciprocal and check the averaged gradients)."""
    for want_log, got_log, differ in world(2).run(on_rank_autocast_against_ddp, stage, recipe):
        print("DDP (scale, norm) per step:", want_log)
        assert got_log == want_log, got_log
        assert not differ, differ
    if recipe == "fp16":  # the recipe's overflows happened: the scale backed off
        assert min(s for s, n in want_log) < 2.0**16 and any(n == float("inf") for s, n in want_log), want_log


@pytest.mark.xdist_group("world2")
def test_a_loss_scale_of_any_factors_is_grad_scalers_fp32_value(world):
    """GradScaler holds its scale in fp32, each backoff and growth rounded to it: DynamicLossScale does too.
    Kept as a Python float, a backoff of 0.7 gave 45875.2 where GradScaler has 45875.19921875, and the
    weights differed after the first step the scale unscaled."""
    settings = dict(init_scale=2.0**16, growth_interval=2, backoff_factor=0.7, growth_factor=1.3)
    for want_log, got_log, differ in world(2).run(on_rank_autocast_against_ddp, 2, "fp16", settings):
        print("DDP + GradScaler (scale, norm) per step:", want_log)
        assert got_log == want_log, got_log
        assert not differ, differ
        assert len({s for s, n in want_log}) > 2, want_log  # backed off and grown


def on_rank_scales_growing_past_fp32():
    """Three clean steps (the loss times 0) from a scale of 2^127, growing every step: GradScaler's scales
    (fp32 model, SGD), then zero's."""
    scales = []
    for system in ("GradScaler", "zero"):
        model = make_model()
        if system == "GradScaler":
            opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", 2.0**127,
                                                                                          growth_interval=1)
        else:
            model, opt = zero.initialize(model, torch.optim.SGD, stage=1, lr=0.1, loss_scale=zero.DynamicLossScale(
                2.0**127, growth_interval=1))
        for step in range(3):
            loss = loss_of(model, step, 0) * 0.0
            if system == "GradScaler":
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                opt.backward(loss)
                opt.step()
            opt.zero_grad()
            scales.append(scaler.get_scale() if system == "GradScaler" else opt.loss_scale)
    return scales[:3], scales[3:]


@pytest.mark.xdist_group("world2")
def test_a_loss_scale_does_not_grow_past_fp32(world):
    """A growth past fp32's largest value is refused, as GradScaler refuses it: the scale stays 2^127 (as a
    Python float it grew to 2^128, 2^129, ..., inf in the fp32 loss)."""
    for want, got in world(2).run(on_rank_scales_growing_past_fp32):
        print("GradScaler:", want, "zero:", got)
        assert got == want == [2.0**127] * 3, (want, got)


def on_rank_grad_scaler(stage, unscale_first):
    model, opt = zero.initialize(make_model(), torch.optim.AdamW, stage=stage, **OPTIM)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_of(model, 0, 0)
    scaler.scale(loss).backward()
    if unscale_first:  # (to clip: it finds no gradient to unscale)
        scaler.unscale_(opt)
    try:
        scaler.step(opt)
    except RuntimeError as e:
        error = str(e)
    else:
        return None, None
    opt.zero_grad()  # then a step without GradScaler
    loss_of(model, 0, 0).backward()
    return error, opt.step()


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_-then-step"])
@pytest.mark.parametrize("stage", [0, 3])
def test_grad_scaler_names_zeros_loss_scale(world, stage, unscale_first):
    """torch.amp.GradScaler reads p.grad, which zero leaves None: scaler.step(optimizer) raises,
    naming loss_scale=zero.DynamicLossScale and optimizer.backward (not torch's "No inf checks
    were recorded for this optimizer"); the refusal leaves nothing behind: a step without
    GradScaler after it goes through."""
    for error, stepped in world(2).run(on_rank_grad_scaler, stage, unscale_first):
        assert error and "DynamicLossScale" in error and "optimizer.backward(loss)" in error, error
        assert stepped is True, stepped


def on_rank_stage3_under_autocast(param_dtype, stage):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    model, opt = zero.initialize(net, torch.optim.SGD, stage=stage, param_dtype=param_dtype, lr=0.1)
    hooks = zero.MemoryHooks(model, every_module=False)
    kept = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for autocast in (False, True, True):  # (warned once)
            hooks.records, hooks.recording = [], True
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                x = torch.randn(8, 64, dtype=param_dtype or torch.float32, requires_grad=True)
                loss = model(x).float().sum()  # (x needs a gradient: every layer's weight is saved)
            kept[autocast] = hooks.kept_by_forward()
            hooks.recording = False
            loss.backward()
            opt.zero_grad()
    weights_bf16 = sum(p.numel() for p in net.parameters() if p.dim() == 2) * 2
    return [str(w.message) for w in caught], kept, weights_bf16


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("param_dtype, stage", [(None, 3), (torch.bfloat16, 3), (None, 2)],
                         ids=["stage3-fp32", "stage3-bf16", "stage2-fp32"])
def test_stage3_under_autocast_warns_of_its_16_bit_copies(world, param_dtype, stage):
    """Under torch.autocast each weight's bf16 copy is saved for backward, so a stage-3 forward
    keeps the whole model in bf16 (at least the 4 weights' bf16 bytes) where without
    autocast it keeps less than that (the activations): stage 3 warns once, naming param_dtype. With
    param_dtype=torch.bfloat16 nothing is cast; at stages 0-2 the parameters are whole anyway."""
    for messages, kept, weights_bf16 in world(2).run(on_rank_stage3_under_autocast, param_dtype, stage):
        print(f"kept by forward: {kept[False]} B without autocast, {kept[True]} B with; bf16 weights {weights_bf16} B")
        if param_dtype is None and stage == 3:
            assert len(messages) == 1 and "param_dtype=torch.bfloat16" in messages[0], messages
            assert kept[True] >= weights_bf16 > kept[False], kept
        else:
            assert not messages, messages


def on_rank_fp16_gan_step(freeze):
    torch.manual_seed(0)
    G, opt_g = zero.initialize(torch.nn.Linear(4, 6), torch.optim.Adam, stage=1, param_dtype=torch.float16, lr=1e-2)
    D, _ = zero.initialize(torch.nn.Linear(6, 1), torch.optim.Adam, stage=1, param_dtype=torch.float16, lr=1e-2)
    D.requires_grad_(not freeze)
    try:
        opt_g.backward(D(G(torch.randn(3, 4).half())).float().mean())  # the generator's loss, through D
    except RuntimeError as e:
        return str(e)
    return opt_g.step()


@pytest.mark.xdist_group("world2")
def test_another_fp16_models_backward_through_this_one_names_the_freeze(world):
    """D's gradients from G's optimizer.backward(loss) would carry G's loss scale, not D's: D
    raises, naming the fix (freeze D for G's step), and with D frozen G's step goes on."""
    for error in world(2).run(on_rank_fp16_gan_step, False):
        assert "another model's optimizer.backward(loss) reaching Linear's parameters" in error \
            and "requires_grad_(False)" in error, error
    assert world(2).run(on_rank_fp16_gan_step, True) == [True, True]
