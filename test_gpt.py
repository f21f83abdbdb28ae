"""Tests for gpt.py: Megatron's parallel layers against torch's own, and the tp=T GPT against tp=1.

    .venv/bin/python -m pytest -q test_gpt.py

A test at tp=T runs its rank function on the T ranks of conftest's world(T); at tp=1 it runs here,
with no process group at all. Every rank draws the same full tensors from the same seed, so
the reference (nn.Linear, nn.Embedding, F.cross_entropy, the tp=1 GPT) is computed on every rank
and each rank checks its own slice.
"""
import copy
import gc
import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from gpt import (GPT, PRESETS, ColumnParallelLinear, GPTConfig, RowParallelLinear,
                 VocabParallelEmbedding, load_full_, make_mesh, num_params, vocab_parallel_cross_entropy)


def _tp(n, *more):
    """A parameter set for tp=n; at n > 1 it runs in world(n), one xdist worker per world size."""
    marks = [pytest.mark.xdist_group(f"world{n}")] if n > 1 else []
    return pytest.param(n, *more, id=f"tp{n}" + (f"-{more[0].__name__.strip('_')}" if more else ""), marks=marks)


TP_SIZES = [_tp(1), _tp(2), _tp(4)]


def _on_ranks(world, tp, fn, *args):
    """fn(tp, *args) on every rank of world(tp), or here with no process group at tp=1."""
    return [fn(tp, *args)] if tp == 1 else world(tp).run(fn, tp, *args)


def _group_and_rank(tp):
    return (None, 0) if tp == 1 else (dist.group.WORLD, dist.get_rank())


def _check(ok, what, got, expected):
    if not ok:
        diff = (got.double() - expected.double()).abs().max().item()
        raise AssertionError(f"rank {dist.get_rank() if dist.is_initialized() else 0}: {what} "
                             f"differs, max |diff| = {diff:.3g}")


def _equal(what, got, expected):
    _check(torch.equal(got, expected), what, got, expected)


def _close(what, got, expected, rtol, atol):
    _check(torch.allclose(got, expected, rtol=rtol, atol=atol), what, got, expected)


# ---------------------------------------------------------------------------
# ColumnParallelLinear and RowParallelLinear against nn.Linear holding the full weight
# ---------------------------------------------------------------------------

def _linear_case(in_features, out_features):
    torch.manual_seed(0)  # the same full layer, input and output gradient on every rank
    full = nn.Linear(in_features, out_features)
    x = torch.randn(2, 8, in_features, requires_grad=True)
    dy = torch.randn(2, 8, out_features)
    y = full(x)
    y.backward(dy)
    return full, x, y, dy


def _column_parallel_matches_linear(tp):
    group, r = _group_and_rank(tp)
    full, x, y, dy = _linear_case(64, 96)
    col = ColumnParallelLinear(64, 96, group)
    load_full_(col.weight, full.weight.detach(), group)
    load_full_(col.bias, full.bias.detach(), group)
    x_r = x.detach().clone().requires_grad_()
    y_r = col(x_r)                                             # (2, 8, 96/tp), left split
    y_r.backward(dy.chunk(tp, -1)[r].contiguous())
    # output column j is the same dot product over all 64 inputs as in the full layer
    _equal("output", y_r, y.chunk(tp, -1)[r])
    _equal("weight grad", col.weight.grad, full.weight.grad.chunk(tp, 0)[r])
    # dX = sum over tp ranks of dY_r A_r (f's all-reduce): the 96-term sum is split into tp partial
    # sums added in another order, so it agrees to rounding: |dX| <= 2.7, ulp 2.4e-7, seen 4 ulp
    if tp == 1:
        _equal("input grad", x_r.grad, x.grad)
        _equal("bias grad", col.bias.grad, full.bias.grad)
    else:
        _close("input grad", x_r.grad, x.grad, rtol=0, atol=2e-6)
        # the bias grad sums dY over 16 tokens per column, but torch's column-sum kernel vectorises
        # by the row width (96/tp here, 96 in nn.Linear): |db| <= 12, ulp 9.5e-7, seen 1.5 ulp
        _close("bias grad", col.bias.grad, full.bias.grad.chunk(tp, 0)[r], rtol=0, atol=2e-6)


def _row_parallel_matches_linear(tp):
    group, r = _group_and_rank(tp)
    full, x, y, dy = _linear_case(96, 64)
    row = RowParallelLinear(96, 64, group)
    load_full_(row.weight, full.weight.detach(), group)
    load_full_(row.bias, full.bias.detach(), group)
    x_r = x.detach().chunk(tp, -1)[r].clone().requires_grad_()  # the input arrives split
    y_full = row(x_r)                                           # (2, 8, 64) on every rank
    y_full.backward(dy)
    # the forward's 96-term dot product is split into tp partial sums added by g's all-reduce:
    # |y| <= 2.5, ulp 2.4e-7, seen 4 ulp. At tp=1 it is the same arithmetic as nn.Linear
    if tp == 1:
        _equal("output", y_full, y)
    else:
        _close("output", y_full, y, rtol=0, atol=2e-6)
    _equal("weight grad", row.weight.grad, full.weight.grad.chunk(tp, 1)[r])
    _equal("bias grad", row.bias.grad, full.bias.grad)
    _equal("input grad", x_r.grad, x.grad.chunk(tp, -1)[r])


@pytest.mark.parametrize("tp", TP_SIZES)
def test_column_parallel_linear_matches_nn_linear(world, tp):
    _on_ranks(world, tp, _column_parallel_matches_linear)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_row_parallel_linear_matches_nn_linear(world, tp):
    _on_ranks(world, tp, _row_parallel_matches_linear)


# ---------------------------------------------------------------------------
# VocabParallelEmbedding and the vocab-parallel cross entropy
# ---------------------------------------------------------------------------

def _vocab_parallel_embedding_matches_embedding(tp):
    group, r = _group_and_rank(tp)
    torch.manual_seed(0)
    full = nn.Embedding(64, 16)
    idx = torch.randint(0, 64, (4, 10))
    dy = torch.randn(4, 10, 16)
    y = full(idx)
    y.backward(dy)
    emb = VocabParallelEmbedding(64, 16, group)
    load_full_(emb.weight, full.weight.detach(), group)
    y_r = emb(idx)
    y_r.backward(dy)
    # one rank holds each row and the others add exact zeros: no rounding anywhere
    _equal("embedding", y_r, y)
    _equal("weight grad", emb.weight.grad, full.weight.grad.chunk(tp, 0)[r])


def _vocab_parallel_cross_entropy_matches_torch(tp):
    group, r = _group_and_rank(tp)
    torch.manual_seed(0)
    logits = (3 * torch.randn(40, 64)).requires_grad_()        # (N, V), roomy spread of logits
    target = torch.randint(0, 64, (40,))
    target[::7] = -1                                           # ignored positions
    loss = F.cross_entropy(logits, target, ignore_index=-1)
    loss.backward()
    logits_r = logits.detach().chunk(tp, -1)[r].clone().requires_grad_()  # (N, V/tp)
    loss_r = vocab_parallel_cross_entropy(logits_r, target, r * 64 // tp, group)
    loss_r.backward()
    # the sum of exp over V runs in tp partial sums, and even at tp=1 in another order than torch's
    # log_softmax kernel: loss ~8.4, seen 1 ulp (1.1e-7 relative); |grad| <= 0.03, seen 4 ulp
    _close("loss", loss_r, loss, rtol=3e-7, atol=0)
    _close("logits grad", logits_r.grad, logits.grad.chunk(tp, -1)[r], rtol=0, atol=1.5e-8)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_vocab_parallel_embedding_matches_nn_embedding(world, tp):
    _on_ranks(world, tp, _vocab_parallel_embedding_matches_embedding)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(world, tp):
    _on_ranks(world, tp, _vocab_parallel_cross_entropy_matches_torch)


# ---------------------------------------------------------------------------
# The whole GPT at tp = 2 and 4 against the tp=1 GPT with the same seed
# ---------------------------------------------------------------------------

def _expected_slice(name, full, tp, r):
    """This rank's slice of a tp=1 tensor, by Megatron's layout (written out here, not imported)."""
    if name == "wte.weight" or ".mlp.c_fc." in name:
        return full.chunk(tp, 0)[r]                                      # rows: vocab / MLP features
    if ".attn.c_attn." in name:
        q, k, v = full.chunk(3, 0)                                       # whole heads of q, k and v
        return torch.cat([q.chunk(tp, 0)[r], k.chunk(tp, 0)[r], v.chunk(tp, 0)[r]], 0)
    if name.endswith("c_proj.weight"):
        return full.chunk(tp, 1)[r]                                      # input columns
    return full                                                          # replicated


def _batch():
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (2, 32), generator=gen)
    targets = torch.randint(0, 256, (2, 32), generator=gen)
    return idx, targets


def _gpt_weights_are_slices_of_tp1(tp):
    group, r = _group_and_rank(tp)
    ref, model = GPT(PRESETS["tiny"], seed=3), GPT(PRESETS["tiny"], tp_group=group, seed=3)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        _equal(name, p, _expected_slice(name, ref_params[name].detach(), tp, r))


def _gpt_loss_and_grads_match_tp1(tp, bias):
    group, r = _group_and_rank(tp)
    config = GPTConfig(n_layer=4, n_head=4, n_embd=128, bias=bias)
    ref, model = GPT(config), GPT(config, tp_group=group)
    idx, targets = _batch()
    _, ref_loss = ref(idx, targets)
    ref_loss.backward()
    _, loss = model(idx, targets)
    loss.backward()
    # every all-reduce (g after each RowParallelLinear, f's in backward, the cross entropy's sums)
    # splits a sum into tp partial sums, so tp=T agrees with tp=1 to fp32 rounding: loss ~5.6,
    # seen 2 ulp; the largest gradients are ~0.25 (ulp 3e-8), seen 1.4e-7 off
    _close("loss", loss, ref_loss, rtol=3e-7, atol=0)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        _close(f"{name}.grad", p.grad, _expected_slice(name, ref_params[name].grad, tp, r), rtol=0, atol=3e-7)
    return {name: p.grad for name, p in model.named_parameters() if not hasattr(p, "tensor_model_parallel")}


def _gpt_generates(tp):
    group, rank = _group_and_rank(tp)
    model = GPT(PRESETS["tiny"], tp_group=group)
    prompt = torch.tensor([[72, 101, 108, 108, 111]])  # "Hello"
    greedy = model.generate(prompt, 8, temperature=0)
    # seeded by rank, as a script seeding each process would: tp rank 0 draws, the others follow
    sampled = model.generate(prompt, 8, top_k=20, generator=torch.Generator().manual_seed(rank))
    return greedy, sampled


@pytest.mark.parametrize("tp", TP_SIZES[1:])
def test_gpt_weights_at_tp_are_slices_of_the_tp1_weights(world, tp):
    _on_ranks(world, tp, _gpt_weights_are_slices_of_tp1)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("tp", TP_SIZES[1:])
def test_gpt_loss_and_grads_at_tp_match_tp1(world, tp, bias):
    replicated_grads = _on_ranks(world, tp, _gpt_loss_and_grads_match_tp1, bias)
    # LayerNorms, positions and row biases see the same bits on every rank: they stay in step
    for r, grads in enumerate(replicated_grads[1:], start=1):
        for name, grad in grads.items():
            assert torch.equal(grad, replicated_grads[0][name]), f"{name}.grad differs on tp rank {r}"


@pytest.mark.parametrize("tp", TP_SIZES[1:])
def test_gpt_generates_the_same_tokens_on_every_tp_rank_as_tp1(world, tp):
    ref_greedy, ref_sampled = _gpt_generates(1)  # (rank 0's generator, seeded 0: tp rank 0's draws)
    results = _on_ranks(world, tp, _gpt_generates)
    for r, (greedy, sampled) in enumerate(results):
        assert torch.equal(greedy, ref_greedy), f"rank {r} greedy {greedy.tolist()} vs tp=1 {ref_greedy.tolist()}"
        assert torch.equal(sampled, ref_sampled), f"rank {r} sampled {sampled.tolist()} vs tp=1 {ref_sampled.tolist()}"


def _zero_at_tp_clips_by_the_whole_models_norm(tp, stage, norm_type=2.0):
    dp_group, tp_group = make_mesh(dp=1, tp=tp)
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64)
    ref = GPT(config, seed=3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, opt = zero.initialize(GPT(config, tp_group=tp_group, seed=3), torch.optim.AdamW, stage=stage,
                                 group=dp_group, tp_group=tp_group, lr=1e-2)
    idx, targets = _batch()
    norms = []
    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            m(idx, targets)[1].backward()
            norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type) if m is ref
                         else o.clip_grad_norm_(0.05, norm_type))
            o.step()
            o.zero_grad()
    print(f"rank {dist.get_rank()}: norms {[f'{n.item():.7f}' for n in norms]} (tp=1, tp={tp}) by step")
    # the first step's gradients agree with tp=1 to 3e-7 (test above); their 2-norm sums slices'
    # squares in another order: seen 1 ulp of ~2.9 (the +-inf-norm is the largest or smallest of them)
    _close("first step's norm", norms[1], norms[0], rtol=5e-7, atol=0)
    # later steps start from weights that tp=1 rounded otherwise, a difference AdamW's division by sqrt(v)
    # grows: seen 2e-6 relative by step 3; a slice's norm alone (the fault this catches) is off by far more
    _close("later steps' norms", torch.stack(norms[3::2]), torch.stack(norms[2::2]), rtol=1e-5, atol=0)
    state = zero.full_state_dict(model)
    return norms[1::2], {n: state[n] for n, p in model.named_parameters() if not hasattr(p, "tensor_model_parallel")}


def _a_nan_gradient_on_one_tp_rank(tp, where, norm_type):
    """A split weight whose gradient holds a NaN on tp rank `where` only: the clip's error, or its norm."""
    dp_group, tp_group = make_mesh(dp=1, tp=tp)
    torch.manual_seed(0)
    net = nn.Linear(8, 8)
    net.weight.tensor_model_parallel = True  # each tp rank's own slice
    model, opt = zero.initialize(net, torch.optim.SGD, stage=1, group=dp_group, tp_group=tp_group, lr=0.1)
    loss = model(torch.randn(3, 8, generator=torch.Generator().manual_seed(1))).square().sum()
    if dist.get_rank(tp_group) == where:
        loss = loss + model.weight[0, 0] * math.nan
    loss.backward()
    try:
        return opt.clip_grad_norm_(0.1, norm_type, error_if_nonfinite=True).item()
    except RuntimeError as e:
        return str(e)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, -math.inf], ids=["l2", "inf", "-inf"])
def test_a_nan_gradient_on_any_tp_rank_makes_the_norm_nan(world, norm_type):
    """torch's norm of gradients holding a NaN is NaN, by any norm_type. Over tp slices the +-inf-norm is a max
    (min) all-reduce, which gloo takes past a NaN from tp rank 1: the NaN travels as a flag beside it, so
    error_if_nonfinite raises on every rank, wherever the NaN is."""
    for where in (0, 1):
        for got in _on_ranks(world, 2, _a_nan_gradient_on_one_tp_rank, where, norm_type):
            print(f"NaN on tp rank {where}: {got}")
            assert isinstance(got, str) and f"The total norm of order {norm_type} for gradients" in got, got


@pytest.mark.parametrize("stage, norm_type", [(1, 2.0), (3, 2.0), (3, math.inf), (3, -math.inf)],
                         ids=["1-l2", "3-l2", "3-inf", "3--inf"])
def test_zero_at_tp_clips_by_the_whole_models_norm(world, stage, norm_type):
    """Each tp rank holds a slice of the split weights: clipping by the slice's norm alone
    would scale each tp rank's step differently, and the replicated weights would drift apart.
    The inf-norm is the largest over every tp rank's slices (an all-reduce of the max), the
    -inf-norm (the smallest parameter norm) the smallest."""
    results = _on_ranks(world, 2, _zero_at_tp_clips_by_the_whole_models_norm, stage, norm_type)
    (norms0, replicated0), (norms1, replicated1) = results
    assert all(torch.equal(a, b) for a, b in zip(norms0, norms1, strict=True)), f"norms differ: {norms0} vs {norms1}"
    for name, value in replicated0.items():
        assert torch.equal(value, replicated1[name]), f"{name} differs between the tp ranks after 3 clipped steps"



def _replicated_model_at_tp_clips_by_its_norm_once(tp, norm_type):
    dp_group, tp_group = make_mesh(dp=1, tp=tp)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model, opt = zero.initialize(copy.deepcopy(ref), torch.optim.SGD, stage=1, group=dp_group, tp_group=tp_group, lr=0.1)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    ref(x).square().sum().backward()
    model(x).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type)
    return opt.clip_grad_norm_(0.1, norm_type), expected


@pytest.mark.parametrize("norm_type", [2.0, -1.0, math.inf, -math.inf], ids=["l2", "l-1", "inf", "-inf"])
def test_a_tp_rank_with_no_split_parameter_adds_nothing_to_the_norm(world, norm_type):
    """No parameter is split, so every one is counted on tp rank 0 alone: tp rank 1 adds nothing
    (no term to a p-norm's sum, the identity to the largest or smallest norm), and the total is
    torch's norm of the one model. The largest and smallest norm are taken exactly (torch.equal);
    a p-norm is (sum of |norm| ** p) ** (1 / p) across tp ranks, where torch takes vector_norm of
    the norms: other arithmetic, so within 1 ulp of fp32 (rtol 1.2e-7)."""
    for rank, (total, expected) in enumerate(_on_ranks(world, 2, _replicated_model_at_tp_clips_by_its_norm_once,
                                                       norm_type)):
        print(f"tp rank {rank}: norm {total.item():.9g}, torch's {expected.item():.9g}")
        if math.isfinite(norm_type):
            torch.testing.assert_close(total, expected, rtol=1.2e-7, atol=0)
        else:
            assert torch.equal(total, expected), (rank, total, expected)


def _fp16_overflow_on_one_tp_rank(tp):
    dp_group, tp_group = make_mesh(dp=1, tp=tp)
    torch.manual_seed(0)
    model, opt = zero.initialize(nn.Linear(8, 8), torch.optim.SGD, stage=1, group=dp_group, tp_group=tp_group,
                                 param_dtype=torch.float16, loss_scale=1024.0, lr=0.1)
    loss = model(torch.ones(2, 8, dtype=torch.float16)).float().sum()
    opt.backward(loss * (math.inf if dist.get_rank(tp_group) == 1 else 1.0))  # only tp rank 1 overflows
    return opt.step()


def test_fp16_overflow_on_one_tp_rank_skips_the_step_on_every_tp_rank(world):
    stepped = _on_ranks(world, 2, _fp16_overflow_on_one_tp_rank)
    assert stepped == [False, False], f"step() returned {stepped} on the tp ranks"


def _clip_by_norm_0_at_tp(tp):
    dp_group, tp_group = make_mesh(dp=1, tp=tp)
    model, opt = zero.initialize(nn.Linear(8, 8), torch.optim.SGD, stage=1, group=dp_group, tp_group=tp_group, lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    with pytest.raises(ValueError, match="norm_type=0.*clip by norm_type 2") as e:
        opt.clip_grad_norm_(1.0, norm_type=0)
    return str(e.value)


def test_clip_by_norm_0_at_tp_is_refused(world):
    """norm 0 counts parameters: a split parameter's slices on two tp ranks would count twice."""
    print(_on_ranks(world, 2, _clip_by_norm_0_at_tp)[0])


def _data_parallel_group_holding_tp_ranks(tp):
    """tp_group given, group left at its default (the world, which holds both tp ranks): zero would
    start tp rank 1 from tp rank 0's slices and average the two slices' gradients, silently."""
    group, _ = _group_and_rank(tp)
    errors = []
    for kwargs in ({}, {"group": group}):
        try:
            zero.initialize(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32),
                                tp_group=group), torch.optim.SGD, stage=1, tp_group=group, lr=0.1, **kwargs)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_a_data_parallel_group_that_holds_tp_ranks_is_refused(world):
    for errors in _on_ranks(world, 2, _data_parallel_group_holding_tp_ranks):
        for error in errors:
            assert error is not None and "share ranks [0, 1]" in error and "make_mesh" in error, error

# ---------------------------------------------------------------------------
# One process, meta builds and parameter counts
# ---------------------------------------------------------------------------

def test_tp1_gpt_runs_without_a_process_group():
    assert not dist.is_initialized()
    model = GPT(PRESETS["tiny"])
    idx, targets = _batch()
    logits, loss = model(idx, targets)
    loss.backward()
    assert logits.shape == (2, 32, 256)
    # GPT-2's init gives near-uniform predictions: loss ~ ln V
    assert abs(loss.item() - math.log(256)) < 0.1, f"initial loss {loss.item():.3f}, expected ~ln 256 = 5.545"
    assert all(p.grad is not None for p in model.parameters())
    assert model.generate(idx[:1, :5], 4, top_k=5).shape == (1, 9)


def test_tp1_gpt_is_causal():
    model = GPT(PRESETS["tiny"])
    idx, _ = _batch()
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    with torch.no_grad():
        before, after = model(idx, idx)[0], model(changed, idx)[0]
    assert torch.equal(before[:, :20], after[:, :20]), "a later token changed an earlier position's logits"
    assert not torch.equal(before[:, 20:], after[:, 20:])


def test_a_replaced_parameter_is_freed():
    """The model keeps no reference to its parameters beside the modules' own: a wrapper that
    replaces them (FSDP2's fully_shard does) frees the originals. Measured: before gpt.py keyed
    its names by id, FSDP2 held a whole 4Ψ copy beside its shards."""
    import weakref
    model = GPT(PRESETS["tiny"])
    olds = [weakref.ref(p) for p in model.parameters()]
    for m in model.modules():
        for name in [name for name, _ in m.named_parameters(recurse=False)]:
            setattr(m, name, torch.nn.Parameter(getattr(m, name).detach().clone()))
    gc.collect()
    alive = [r() for r in olds if r() is not None]
    print(f"{len(alive)} of {len(olds)} replaced parameters still alive")
    assert alive == []


def test_meta_build_of_7_5b_allocates_nothing():
    model = GPT(PRESETS["7.5b"], device="meta")
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("preset", list(PRESETS))
def test_num_params_equals_the_built_model(preset):
    model = GPT(PRESETS[preset], device="meta")
    assert num_params(PRESETS[preset]) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset, psi", [("gpt2-1.5b", 1.5e9), ("7.5b", 7.5e9), ("128b", 128e9), ("1t", 1e12)])
def test_presets_have_the_paper_sizes_within_4_percent(preset, psi):
    # independent of num_params: 12 L C^2 (blocks) + V C (embedding), the usual estimate
    c = PRESETS[preset]
    assert abs(12 * c.n_layer * c.n_embd ** 2 + c.vocab_size * c.n_embd - psi) / psi < 0.04
    assert abs(num_params(c) - psi) / psi < 0.04


def _params_per_rank(tp, config):
    group, _ = _group_and_rank(tp)
    return sum(p.numel() for p in GPT(config, tp_group=group, device="meta").parameters())


@pytest.mark.parametrize("tp", TP_SIZES[1:])
def test_num_params_per_tp_rank_equals_the_built_model(world, tp):
    for config in (PRESETS["tiny"], GPTConfig(n_layer=2, n_embd=64, bias=False)):
        assert _on_ranks(world, tp, _params_per_rank, config) == [num_params(config, tp)] * tp


def _mesh_ranks(tp):
    dp_group, tp_group = make_mesh(dp=2, tp=2)
    return dist.get_process_group_ranks(dp_group), dist.get_process_group_ranks(tp_group)


@pytest.mark.xdist_group("world4")
def test_make_mesh_puts_tp_groups_on_consecutive_ranks(world):
    got = world(4).run(_mesh_ranks, 4)
    assert got == [([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]), ([1, 3], [2, 3])]


# ---------------------------------------------------------------------------
# Bad input: a ValueError that names the fix and the value seen
# ---------------------------------------------------------------------------

def _value_error(tp, build):
    group, _ = _group_and_rank(tp)
    try:
        build(group)
    except ValueError as e:
        return str(e)
    return None


def _gpt_n_head_6(group):
    GPT(GPTConfig(n_head=6, n_embd=384), tp_group=group, device="meta")


def _gpt_vocab_50257(group):
    GPT(GPTConfig(vocab_size=50257), tp_group=group, device="meta")


def _gpt_n_embd_100_n_head_3(group):
    GPT(GPTConfig(n_head=3, n_embd=100), tp_group=group, device="meta")


def _column_out_6(group):
    ColumnParallelLinear(8, 6, group)


def _row_in_6(group):
    RowParallelLinear(6, 8, group)


def _gpt_too_long(group):
    GPT(PRESETS["tiny"], tp_group=group)(torch.zeros(1, 129, dtype=torch.long))


def _gpt_negative_temperature(group):
    GPT(PRESETS["tiny"], tp_group=group).generate(torch.zeros(1, 1, dtype=torch.long), 1, temperature=-1.0)


def _gpt_top_k_0(group):
    GPT(PRESETS["tiny"], tp_group=group).generate(torch.zeros(1, 1, dtype=torch.long), 1, top_k=0)


@pytest.mark.parametrize("tp, build, message", [
    _tp(1, _gpt_n_embd_100_n_head_3, "n_embd=100 is not divisible by n_head=3: choose n_head in {1, 2, 4, 5, 10, 20, 25, 50, 100}"),
    _tp(1, _gpt_too_long, "sequence length T=129 exceeds block_size=128: crop the input to its last 128 tokens"),
    _tp(4, _gpt_n_head_6, "n_head=6 is not divisible by tp=4: choose tp in {1, 2, 3, 6}"),
    _tp(2, _gpt_vocab_50257, "vocab_size=50257 is not divisible by tp=2: pad the vocabulary, e.g. vocab_size=50304"),
    _tp(4, _column_out_6, "out_features=6 is not divisible by tp=4: choose tp in {1, 2, 3, 6}"),
    _tp(4, _row_in_6, "in_features=6 is not divisible by tp=4: choose tp in {1, 2, 3, 6}"),
    _tp(2, _gpt_negative_temperature, "temperature=-1.0 must be >= 0 (0: greedy)"),
    _tp(1, _gpt_top_k_0, "top_k=0 must be at least 1, or None to sample from every token"),
])
def test_bad_input_raises_value_error_naming_the_fix(world, tp, build, message):
    for got in _on_ranks(world, tp, _value_error, build):
        assert got is not None and message in got, f"expected a ValueError containing {message!r}, got {got!r}"


def _vocab_edges(tp):
    """At tp > 1 no rank's vocabulary slice holds an id outside [0, V): F.embedding and
    F.cross_entropy raise on one at tp = 1, and so must the parallel layers, not embed it to zeros
    or train it as a target whose logit is 0. A batch whose targets are all ignored (-1) has a
    loss of 0/0 = nan, as F.cross_entropy's, and gradients of zero, not nan."""
    group, _ = _group_and_rank(tp)
    model = GPT(PRESETS["nano"], tp_group=group)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    errors = []
    for what, x, y in [("target -100", idx, idx.masked_fill(idx > 100, -100)), ("target 256", idx, idx.clamp(max=0) + 256),
                       ("token id 256", idx.clamp(max=0) + 256, idx)]:
        try:
            model(x, y)
            errors.append(f"{what}: no error")
        except (RuntimeError, IndexError) as e:  # torch's words at tp 1, gpt.py's at tp > 1; not any other error
            if not re.search(r"Target -?\d+ is out of bounds|index out of range|outside \[0, vocab_size\)", str(e)):
                errors.append(f"{what}: another error: {e}")
    loss = model(idx, torch.full_like(idx, -1))[1]
    loss.backward()
    bad = [n for n, p in model.named_parameters() if not torch.equal(p.grad, torch.zeros_like(p.grad))]
    return errors + ([f"loss {loss.item()}"] if not loss.isnan() else []) + [f"{n}.grad not zero" for n in bad]


@pytest.mark.parametrize("tp", TP_SIZES[:2])
def test_gpt_vocabulary_edges_behave_as_torchs_layers(world, tp):
    assert _on_ranks(world, tp, _vocab_edges) == [[]] * tp


def test_init_weights_after_to_empty_equals_a_direct_build():
    """A meta-built GPT made real by to_empty (FSDP2's idiom) gets new Parameter objects, which
    may reuse freed ones' ids: init_weights finds each parameter's name by its module and
    attribute, so every parameter gets its own seed and init (to_empty unties lm_head; its
    values are wte's all the same)."""
    direct = GPT(PRESETS["nano"], seed=0)
    model = GPT(PRESETS["nano"], seed=0, device="meta")
    model.to_empty(device="cpu")
    for m in model.modules():
        model.init_weights(m)
    built = dict(model.named_parameters(remove_duplicate=False))
    assert all(torch.equal(p, built[n]) for n, p in direct.named_parameters(remove_duplicate=False))


def test_init_weights_draws_on_the_cpu_under_any_default_device():
    """init_weights draws each weight on the CPU, where its generator is, whatever the default device:
    a GPT built under `with torch.device("meta")` onto the CPU equals a plain build (before: its draws were
    on meta, "Cannot copy out of meta tensor"; on a CUDA default device, a CPU generator for a CUDA tensor)."""
    direct = GPT(PRESETS["nano"], seed=0)
    with torch.device("meta"):
        model = GPT(PRESETS["nano"], seed=0, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(direct.parameters(), model.parameters(), strict=True))


def test_init_weights_seeds_each_parameter_by_its_full_name():
    """Each parameter's seed is its full name: two blocks' same-named weights differ, and so do
    two tables of the same shape."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8), seed=0)
    assert not torch.equal(model.h[0].attn.c_attn.weight, model.h[1].attn.c_attn.weight)
    assert not torch.equal(model.h[0].mlp.c_fc.weight, model.h[1].mlp.c_fc.weight)
    assert not torch.equal(model.wte.weight[:8], model.wpe.weight)


@pytest.mark.parametrize("temperature, top_k", [(0.5, 10), (2.0, 3), (1.0, None)])
def test_generate_draws_from_the_tempered_top_k_distribution(temperature, top_k):
    """A sampled token is torch.multinomial's draw from softmax of the top_k logits divided by
    the temperature (nanoGPT's rule), draw for draw with the same generator."""
    vocab = 32
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=vocab, block_size=8), seed=0)
    logits = torch.randn(1, 1, vocab, generator=torch.Generator().manual_seed(1)) * 3
    model.forward = lambda idx: (logits.clone(), None)  # fixed logits (B, T, V) for every call
    for seed in range(30):
        got = model.generate(torch.zeros(1, 1, dtype=torch.long), 1, temperature=temperature, top_k=top_k,
                             generator=torch.Generator().manual_seed(seed))[0, -1]
        tempered = logits[0, -1] / temperature
        if top_k is not None:
            tempered[tempered < torch.topk(tempered, top_k).values[-1]] = -math.inf
        want = torch.multinomial(F.softmax(tempered, -1), 1, generator=torch.Generator().manual_seed(seed))[0]
        assert got == want, (seed, got, want)


def test_generate_reads_the_last_context_tokens():
    """Each token is drawn from the last `context` tokens (default block_size): train.py passes its
    --seq_len, since a model trained on shorter sequences has never seen a later position (its sample
    read 128 bytes of context at --seq_len 32, where positions 64-127 scored worse than 32 bytes)."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=8), seed=0)
    prompt = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(1))
    for context in (None, 3):
        idx = prompt
        for _ in range(4):  # greedy, by hand: the argmax of the last position's logits
            logits, _ = model(idx[:, -(context or 8):])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(model.generate(prompt, 4, temperature=0, context=context), idx), context
    assert not torch.equal(model.generate(prompt, 4, temperature=0), model.generate(prompt, 4, temperature=0, context=3))
