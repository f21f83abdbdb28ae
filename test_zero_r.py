"""ZeRO-R (paper Section 6): P_a, P_a+cpu, C_B and M_D.

    python -m pytest -n 2 test_zero_r.py
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zero
from gpt import GPT, GPTConfig, make_mesh
from helpers import pairwise_sum
from ranks import settled

CONFIG = GPTConfig(block_size=16, vocab_size=64, n_layer=3, n_head=4, n_embd=32)
B, T = 3, 16
MODES = {"full": dict(), "P_a": dict(partition=True), "P_a+cpu": dict(partition=True, cpu=True),
         "P_a+cpu+M_D": dict(partition=True, cpu=True, contiguous=True)}


def batch(step, dp_group):
    g = torch.Generator().manual_seed(10 * step + dist.get_rank(dp_group))
    return torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)


def train(stage, mode, dp, tp, steps=3):
    dp_group, tp_group = make_mesh(dp=dp, tp=tp)
    model = GPT(CONFIG, tp_group, seed=0)
    if mode is not None:
        zero.checkpoint_activations(model.h, tp_group=tp_group, **MODES[mode])
    model, opt = zero.initialize(model, torch.optim.AdamW, stage=stage, group=dp_group, lr=1e-2)
    losses, states = [], []
    for step in range(steps):
        x, y = batch(step, dp_group)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        states.append(zero.full_state_dict(model))
    return losses, states


def on_rank_checkpointing_is_exact(stage, mode):
    want_losses, want_states = train(stage, None, dp=2, tp=2)
    losses, states = train(stage, mode, dp=2, tp=2)
    bad = [f"loss {i}" for i, (a, b) in enumerate(zip(losses, want_losses, strict=True)) if not torch.equal(a, b)]
    bad += [f"step {i} {k}" for i, (s, w) in enumerate(zip(states, want_states, strict=True)) for k in w if not torch.equal(s[k], w[k])]
    return bad


@pytest.mark.xdist_group("world4")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [0, 3])
def test_checkpointing_gives_the_same_bits_at_tp2_x_dp2(world, stage, mode):
    """Recomputation is deterministic: losses and weights torch.equal to the run without it."""
    assert world(4).run(on_rank_checkpointing_is_exact, stage, mode) == [[]] * 4


# -----------------------------------------------------------------------------------------
# P_a keeps 1/tp of each block's input
# -----------------------------------------------------------------------------------------
def on_rank_activation_bytes_after_forward(mode):
    dp_group, tp_group = make_mesh(dp=1, tp=2)
    model = GPT(CONFIG, tp_group, seed=0)
    if mode != "none":
        zero.checkpoint_activations(model.h, tp_group=tp_group, **MODES[mode])
    model, opt = zero.initialize(model, torch.optim.AdamW, stage=0, group=dp_group, lr=1e-2)
    x, y = batch(0, dp_group)
    before = zero.live_storages()
    loss = model(x, y)[1]
    dist.barrier(group=tp_group)  # what forward keeps for backward, once its all-reduces let go
    kept = settled(lambda: sum(s.nbytes() for ptr, s in zero.live_storages().items() if ptr not in before))
    loss.backward()
    return kept


@pytest.mark.xdist_group("world2")
def test_partitioned_checkpoints_are_one_tp_th_of_full_ones(world):
    """Bytes alive after forward, found by walking every live tensor: full checkpointing keeps
    each block's (B, T, C) input; P_a keeps 1/tp of it, so the difference is exactly
    n_layer x (1 - 1/tp) x B*T*C*4 bytes (tp = 2). Checkpointing itself saves a lot more."""
    kept = {mode: world(2).run(on_rank_activation_bytes_after_forward, mode)[0] for mode in ("none", "full", "P_a")}
    block_input = B * T * CONFIG.n_embd * 4
    assert kept["full"] - kept["P_a"] == CONFIG.n_layer * (block_input - math.ceil(block_input / 2 / 4) * 4)
    assert kept["none"] > 2 * kept["full"], kept



# Without tensor parallelism the modes need no process group: one process, fast.
SINGLE = {"full": dict(), "cpu": dict(cpu=True), "M_D": dict(contiguous=True), "cpu+M_D": dict(cpu=True, contiguous=True)}


def schedule_grads(mode, width, schedule, layout=None):
    """Parameter gradients after running `schedule`, ("F", i): forward of micro-batch i, ("B", i)
    its backward, through 3 checkpointed blocks of `width` (mode None: no checkpointing); the first
    block's input transposed, strided (every other element of a row twice as wide), or sliced (rows 1-3 of a
    batch of 4: a dense tensor starting 5 x width x 4 bytes into its storage). Also, per block, where each
    input its Linear read (the forward's, then the recomputation's) starts past a 64-byte line."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3))
    if mode is not None:
        zero.checkpoint_activations(blocks, **SINGLE[mode])
    offsets = [[] for _ in blocks]
    for b, seen in zip(blocks, offsets):
        b[0].register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0].data_ptr() % 64))
    losses = {}
    for op, i in schedule:
        if op == "F":
            x = torch.randn(3 + (layout == "sliced"), 5, width * (2 if layout == "strided" else 1),
                            generator=torch.Generator().manual_seed(i), requires_grad=True)
            x = x.transpose(0, 1) if layout == "transposed" else x[..., ::2] if layout == "strided" else \
                x[1:] if layout == "sliced" else x
            for b in blocks:
                x = b(x)
            losses[i] = x.pow(2).sum()
        else:
            losses.pop(i).backward()
    return [p.grad for p in blocks.parameters()], offsets


@pytest.mark.parametrize("mode", SINGLE)
@pytest.mark.parametrize("case", ["interleaved", "unaligned", "transposed", "strided", "sliced"])
def test_checkpointing_is_exact_in_any_schedule_width_and_layout(mode, case):
    """interleaved: micro-batches in flight at once, as in a 1F1B pipeline (F0 F1 B0 F2 B1 F3 B2
    B3): an M_D slot is reused only once the graph holding it is gone. unaligned: a width of 7,
    where slot i would start at 3 x 5 x 7 x 4 x i = 420 i bytes; the kernels' bits depend on alignment, so
    every slot starts 64-element aligned. transposed: a block input that is not contiguous is
    recomputed in its own layout. strided: one with gaps between its elements (a slice) too (see
    the next test). sliced: a micro-batch sliced from a batch, starting 5 x 7 x 4 = 140 bytes
    into its storage, 12 past a 64-byte line, is recomputed from a copy starting 12 bytes past one too.
    Gradients torch.equal to no checkpointing. On this CPU the kernels here give the same bits at any
    offset, so the alignment is also asserted directly: each recomputation's input starts where its
    forward's did, relative to a 64-byte line."""
    schedule = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)] \
        if case == "interleaved" else [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    width = 7 if case in ("unaligned", "sliced") else 16
    layout = case if case in ("transposed", "strided", "sliced") else None
    (want, _), (got, offsets) = (schedule_grads(m, width, schedule, layout) for m in (None, mode))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), max((a - b).abs().max().item() for a, b in zip(got, want))
    print(f"offsets past a 64-byte line, per block (forwards, then recomputations): {offsets}")
    assert all(len(seen) == len(schedule) and len(set(seen)) == 1 for seen in offsets), offsets


class RowNormalized(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.w * x / x.sum(-1, keepdim=True)


@pytest.mark.parametrize("mode", SINGLE)
def test_a_block_input_with_gaps_is_computed_and_recomputed_with_them(mode):
    """x = every other element of a row: the block runs on x itself and recomputes on x rebuilt with the same gaps.
    A sum along a row of 1,000 elements adds in another order over a dense copy of x (the last bits of output
    and gradients differ). Output, x.grad and the weight's gradient torch.equal to no checkpointing."""
    def run(checkpointed):
        block = RowNormalized()
        if checkpointed:
            zero.checkpoint_activations([block], **SINGLE[mode])
        x = torch.rand(4, 6, 2000, generator=torch.Generator().manual_seed(1))[..., ::2].requires_grad_()
        y = block(x)
        (y * torch.linspace(0, 1, 1000)).sum().backward()
        return y.detach(), x.grad, block.w.grad

    want, got = run(False), run(True)
    print("weight's gradient", got[2].item(), "without checkpointing", want[2].item())
    assert all(map(torch.equal, got, want))


@pytest.mark.parametrize("mode", SINGLE)
def test_an_empty_block_input_with_gaps_is_recomputed(mode):
    """A slice of no rows and some columns (strides of the whole) has no element: rebuilt as such."""
    block = nn.Linear(3, 3)
    zero.checkpoint_activations([block], **SINGLE[mode])
    x = torch.randn(4, 100, requires_grad=True)[:0, :3]
    block(x).sum().backward()
    assert x.shape == (0, 3) and block.weight.grad is not None and not block.weight.grad.any()


def test_md_keeps_its_buffer_while_a_graph_holds_it():
    """A micro-batch of another shape while one is in flight (a last, shorter batch): its
    checkpoints get copies of their own, and the M_D buffer is replaced only once no graph holds
    it, so there is never more than one."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
    ckpt = zero.checkpoint_activations(blocks, contiguous=True)

    def forward(seq_len):
        x = torch.randn(3, seq_len, 16, requires_grad=True)
        for b in blocks:
            x = b(x)
        return x.pow(2).sum()

    first = forward(5)
    arena = ckpt.arena
    second = forward(6)  # while the first graph holds every slot
    kept_while_held = ckpt.arena is arena
    first.backward()
    second.backward()
    del first, second
    forward(6).backward()  # no graph holds the buffer now: one of the new shape
    assert kept_while_held and ckpt.arena is not arena and ckpt.arena.shape[1] >= 3 * 6 * 16, ckpt.arena.shape


@pytest.mark.parametrize("mode", SINGLE)
def test_checkpointed_blocks_under_no_grad_run_their_plain_forward_and_keep_nothing(mode):
    """An evaluation (torch.no_grad) through checkpointed blocks has no backward to save for: the
    outputs are the blocks' own, torch.equal, and no checkpoint is kept (no M_D buffer, no slot busy)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        want = x
        for b in blocks:
            want = b(want)
        ckpt = zero.checkpoint_activations(blocks, **SINGLE[mode])
        got = x
        for b in blocks:
            got = b(got)
    assert torch.equal(got, want) and not got.requires_grad
    assert ckpt.arena is None and not any(ckpt.busy), (ckpt.arena, ckpt.busy)


def test_checkpointing_takes_blocks_called_with_one_tensor():
    blocks = nn.ModuleList([nn.MultiheadAttention(8, 2)])
    zero.checkpoint_activations(blocks)
    x = torch.randn(3, 2, 8, requires_grad=True)
    with pytest.raises(TypeError, match=r"block\(x\), with one tensor; this one got 2 more argument"):
        blocks[0](x, x, x)
    with pytest.raises(TypeError, match=r"block\(x\), with one tensor; this one got a tuple: checkpoint a module"):
        blocks[0]((x, x))  # (a pipeline's (hidden, mask))
    with pytest.raises(TypeError, match=r"forward\(\) missing 2 required positional arguments: 'key' and 'value'"):
        blocks[0](query=x)  # taken as blocks[0](x): the module's own error (not one naming zero's own argument)
    with pytest.raises(TypeError, match=r"this one got no positional tensor, and keywords \['key', 'query'\]"):
        blocks[0](query=x, key=x)
    with pytest.raises(TypeError, match=r"this one got 0 more argument\(s\) and keywords \['i'\]"):
        blocks[0](x, i=0)  # (a keyword named as one of zero's own arguments)

class Counted(nn.Linear):
    calls = 0

    def forward(self, input):
        self.calls += 1
        return super().forward(input)


def test_a_block_called_with_its_input_by_keyword_is_checkpointed():
    """block(input=x), by the name of forward's one parameter: as block(x), as torch.utils.checkpoint takes it.
    The block runs twice (forward, then the recomputation in backward); output and gradient as without."""
    torch.manual_seed(0)
    block = Counted(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    want = block(x)
    want_grad, = torch.autograd.grad(want.sum(), x)
    zero.checkpoint_activations([block])
    block.calls = 0
    got = block(input=x)
    got.sum().backward()
    assert block.calls == 2 and torch.equal(got, want) and torch.equal(x.grad, want_grad), block.calls


def on_rank_p_a_over_ranks_that_feed_other_inputs(differ):
    """P_a over the world's group, as a data-parallel job would wrongly pass it: each rank its own batch."""
    blocks = nn.ModuleList([nn.Linear(8, 8)])
    zero.checkpoint_activations(blocks, tp_group=dist.group.WORLD, partition=True)
    rank = dist.get_rank()
    rows, seed = (4 + 4 * rank, rank) if differ == "shape" else (4, rank) if differ == "values" else (4, 0)
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    try:
        blocks[0](x).sum().backward()
    except ValueError as e:
        return str(e)
    return x.grad is not None


@pytest.mark.xdist_group("world2")
def test_p_a_refuses_tp_ranks_whose_block_inputs_differ(world):
    """Inputs that differ over tp_group would be rebuilt from every rank's slice: a patchwork of them, silently
    (values), or gloo's abort in backward (shape). Both raise in the first forward, naming the fix."""
    for differ in ("values", "shape"):
        got = world(2).run(on_rank_p_a_over_ranks_that_feed_other_inputs, differ)
        print(got[0])
        fields = "['values']" if differ == "values" else "['shape', 'values']"
        assert all(f"fed block 0 inputs of different {fields}, but P_a needs the same input" in e and
                   "pass the tensor-parallel group" in e for e in got), got
    assert world(2).run(on_rank_p_a_over_ranks_that_feed_other_inputs, None) == [True, True]


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


def on_rank_stage3_gathered_bytes_at_the_end_of_recomputed_backward(units):
    torch.manual_seed(0)
    blocks = nn.ModuleList(Residual() for _ in range(8))
    zero.checkpoint_activations(blocks)
    model, opt = zero.initialize(nn.Sequential(*blocks), torch.optim.SGD, stage=3, bucket_numel=1024,
                                 stage3_units=blocks if units else None, lr=0.1)
    x = torch.randn(4, 64, requires_grad=True)
    seen = []  # when backward reaches the input, every block is done
    x.register_hook(lambda grad: seen.append(zero.model_state_bytes(model)))
    model(x).sum().backward()
    held = zero.model_state_bytes(model)  # once backward ends: the shard and its gradient
    return seen[0] - held, sum(p.numel() for p in blocks[0].parameters()) * 4


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("units", [False, True], ids=["module_by_module", "block_units"])
def test_stage3_recomputation_in_backward_gathers_no_finished_block(world, units):
    """A block recomputed in backward runs its modules' forwards again: they gather what they
    use, and nothing ahead in forward order, which backward has finished. Gathered parameter
    bytes stay within one block of 8, whatever the depth."""
    for extra, block in world(2).run(on_rank_stage3_gathered_bytes_at_the_end_of_recomputed_backward, units):
        print(f"gathered at backward's end: {extra} B (one block: {block} B)")
        assert extra <= block



class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(16, 32), nn.Linear(32, 32)
        self.head = nn.Linear(32, 16, bias=False)
        self.head.weight = self.emb.weight  # a group of its own at stage 3, used by two modules

    def forward(self, idx):
        return self.head(torch.tanh(self.fc(self.emb(idx))))


def on_rank_train_tied(stage, checkpointed):
    """3 SGD steps: the losses, the weights and the bytes held after each step. stage "ddp": torch's
    DDP and SGD, the reference (no bytes measured)."""
    torch.manual_seed(0)
    net = TiedLM()
    if stage == "ddp":
        model, opt = DDP(net), torch.optim.SGD(net.parameters(), lr=0.1)
    else:
        model, opt = zero.initialize(net, torch.optim.SGD, stage=stage, lr=0.1)
    losses, held = [], []
    for step in range(3):
        idx = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        out = torch.utils.checkpoint.checkpoint(model, idx, use_reentrant=False) if checkpointed else model(idx)
        loss = out.logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        held.append(None if stage == "ddp" else zero.model_state_bytes(model))
    return losses, net.state_dict() if stage == "ddp" else zero.full_state_dict(model), held


def on_rank_whole_model_checkpointed(stage):
    want_losses, want_state, _ = on_rank_train_tied("ddp", checkpointed=False)
    losses, state, held = on_rank_train_tied(stage, checkpointed=True)
    _, _, plain_held = on_rank_train_tied(stage, checkpointed=False)
    bad = [f"loss {i}" for i, (a, b) in enumerate(zip(losses, want_losses, strict=True)) if not torch.equal(a, b)]
    bad += [f"keys {sorted(state)}"] if state.keys() != want_state.keys() else \
        [name for name in want_state if not torch.equal(state[name], want_state[name])]
    return bad, held, plain_held, [x.item() for x in losses], [x.item() for x in want_losses]


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [2, 3])
def test_the_whole_model_checkpointed_matches_ddp(world, stage):
    """torch.utils.checkpoint(model, idx) runs the root's forward again in backward, its tied
    weight's group included, and backward still needs that weight for the head: the end of the
    recomputed forward frees nothing (backward frees each group once its gradients are in).
    Losses and weights torch.equal to DDP's without checkpointing (at world size 2 every order of
    summation gives the same bits); after each step the rank holds what it holds without
    checkpointing."""
    for bad, held, plain_held, losses, want_losses in world(2).run(on_rank_whole_model_checkpointed, stage):
        print(f"stage {stage}: losses {losses}, DDP {want_losses}; held after each step {held} B, without "
              f"checkpointing {plain_held} B")
        assert bad == [] and held == plain_held, (bad, held, plain_held)


def on_rank_gathered_groups_in_a_checkpointed_backward(checkpointed):
    """Eight blocks as units between two Linears, the whole model under torch.utils.checkpoint: the most groups
    gathered at once in each step's backward (counted at each gather), and the steps' losses."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)])
    net = nn.Sequential(nn.Linear(4, 32), blocks, nn.Linear(32, 1))
    model, opt = zero.initialize(net, torch.optim.SGD, stage=3, lr=0.1, stage3_units=list(blocks))
    params, gather, peaks, losses = opt.parameters, opt.parameters._gather, [], []

    def counting_gather(gids, prefetch=False):
        gather(gids, prefetch)
        if params.gradients.in_backward:
            peaks[-1] = max(peaks[-1], sum(params._gathered(g) for g in range(len(params.groups))))

    params._gather = counting_gather
    for step in range(3):
        peaks.append(0)
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step + dist.get_rank()))
        loss = (torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False) if checkpointed else model(x))
        loss = loss.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return peaks, torch.stack(losses)


@pytest.mark.xdist_group("world2")
def test_stage3_a_checkpoint_over_several_units_regathers_each_in_its_own_backward(world):
    """The checkpoint's recomputation runs every unit's forward before backward reaches any of them: each unit
    recomputed ahead of its own backward is freed after its forward and gathered again there, so backward holds
    at most one group more than without checkpointing (3 against 2), not all 10 (before); losses torch.equal to
    no checkpointing."""
    without = world(2).run(on_rank_gathered_groups_in_a_checkpointed_backward, False)
    for (peaks, losses), (plain, want) in zip(world(2).run(on_rank_gathered_groups_in_a_checkpointed_backward, True),
                                              without):
        print(f"most groups gathered in backward, per step: checkpointed {peaks}, without {plain}")
        assert max(peaks) <= max(plain) + 1 < 10 and torch.equal(losses, want), (peaks, plain, losses, want)


def on_rank_all_gathers_in_backward(checkpointed):
    """Four Residual blocks (each Linear its own unit) and a head, zero.checkpoint_activations over the blocks or
    not: all-gathers started in each step's backward, and the losses."""
    torch.manual_seed(0)
    net = nn.Sequential(*[Residual() for _ in range(4)], nn.Linear(64, 1))
    if checkpointed:
        zero.checkpoint_activations(list(net)[:4])
    model, opt = zero.initialize(net, torch.optim.SGD, stage=3, lr=0.1)
    part, counts, losses = opt.partition, [], []
    all_gather = part.all_gather

    def counting_all_gather(*args, **kwargs):
        counts[-1] += opt.gradients.in_backward
        return all_gather(*args, **kwargs)

    part.all_gather = counting_all_gather
    for step in range(3):
        counts.append(0)
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step + dist.get_rank()))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return counts, torch.stack(losses)


@pytest.mark.xdist_group("world2")
def test_stage3_a_recomputation_frees_only_what_it_gathered(world):
    """A block's recomputation in backward runs after backward reached the block's last Linear and prefetched the
    one before: neither is freed at the end of its recomputed forward (only a group the recomputation gathered
    itself, ahead of its own backward), so backward starts as many all-gathers as without checkpointing (before
    the fix, 4 more a step: each block's first Linear gathered twice); losses torch.equal."""
    without = world(2).run(on_rank_all_gathers_in_backward, False)
    for (counts, losses), (plain, want) in zip(world(2).run(on_rank_all_gathers_in_backward, True), without):
        print(f"all-gathers in each step's backward: checkpointed {counts}, without {plain}")
        assert counts == plain and torch.equal(losses, want), (counts, plain, losses, want)


def on_rank_stage3_gathered_bytes_after_each_forward():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Residual() for _ in range(4))
    zero.checkpoint_activations(blocks)
    model, opt = zero.initialize(nn.Sequential(*blocks), torch.optim.SGD, stage=3, bucket_numel=1024, lr=0.1)
    shard = zero.model_state_bytes(model)
    held = []
    for step in range(3):
        y = model(torch.randn(4, 64, requires_grad=True))
        held.append(zero.model_state_bytes(model) - shard)  # gathered parameters still held
        y.sum().backward()
        opt.step()
        opt.zero_grad()
    return held


@pytest.mark.xdist_group("world2")
def test_stage3_forward_after_a_recomputed_backward_keeps_only_what_backward_gathers_first(world):
    """torch's checkpoint stops a recomputation early by raising inside the module that made its
    last saved tensor; that module's users must still count down, or its parameters stay
    gathered through every later forward (a Linear of each block, growing by a user a step).
    What a forward holds at its end is what backward gathers first, which the forward keeps for
    it once it knows the modules' order (from the second forward on): the last Linear, and the
    one before it that backward's prefetch takes (its budget: one Linear's elements)."""
    last = 2 * (64 * 64 + 64) * 4  # bytes of the last block's two Linears, fp32
    for held in world(2).run(on_rank_stage3_gathered_bytes_after_each_forward):
        print("gathered after each forward:", held, f"(the last two Linears: {last} B)")
        assert held == [0, last, last], held

# -----------------------------------------------------------------------------------------
# C_B: every buffer zero hands a collective is bounded by the bucket size, whatever Ψ
# -----------------------------------------------------------------------------------------
def on_rank_largest_temporary_buffer(stage, width, bucket_numel):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    model, opt = zero.initialize(mlp, torch.optim.AdamW, stage=stage, bucket_numel=bucket_numel, lr=1e-3)
    persistent = {t.untyped_storage()._cdata for t in opt.parameters.storages() + opt.gradients.storages()}
    largest = []
    real = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather_single", "broadcast")}

    def wrap(name):
        def counted(*tensors, **kwargs):
            largest.extend(t.numel() for t in tensors if torch.is_tensor(t)
                           and t.untyped_storage()._cdata not in persistent)
            return real[name](*tensors, **kwargs)
        return counted

    for name in real:
        setattr(dist, name, wrap(name))
    try:
        for step in range(2):
            F.mse_loss(model(torch.randn(4, width)), torch.randn(4, width)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return max(largest), sum(p.numel() for p in mlp.parameters())


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_temporary_communication_buffers_are_bounded_by_the_bucket(world, stage):
    """Two models whose Ψ differ by over 10x, one bucket size: the largest temporary buffer
    handed to a collective (not a view of the persistent flat buffers) is at most one bucket
    (the all-to-all's receive buffer: every rank's copy of my chunk), for both."""
    bucket_numel = 1000
    small, psi_small = world(2).run(on_rank_largest_temporary_buffer, stage, 16, bucket_numel)[0]
    large, psi_large = world(2).run(on_rank_largest_temporary_buffer, stage, 64, bucket_numel)[0]
    assert psi_large > 10 * psi_small > 10 * bucket_numel
    assert small <= bucket_numel and large <= bucket_numel, (small, large)


def on_rank_export_buffers(stage, bucket_numel):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    model, opt = zero.initialize(mlp, torch.optim.AdamW, stage=stage, bucket_numel=bucket_numel, lr=1e-3)
    F.mse_loss(model(torch.randn(4, 64)), torch.randn(4, 64)).backward()
    opt.step()
    persistent = {t.untyped_storage()._cdata for t in opt.parameters.storages()}
    written, real = [], dist.all_gather_single

    def recorded(out, mine, *args, **kwargs):  # the storages behind each buffer an all-gather writes and sends
        for t in (out, mine):
            if t.untyped_storage()._cdata not in persistent:
                written.append(t.untyped_storage().nbytes() // t.element_size())
        return real(out, mine, *args, **kwargs)

    dist.all_gather_single = recorded
    try:
        zero.full_state_dict(model), zero.full_optimizer_state(model)
    finally:
        dist.all_gather_single = real
    return written, sum(p.numel() for p in mlp.parameters())


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_state_gathers_through_one_bucket(world, stage):
    """full_state_dict and full_optimizer_state gather the whole model into CPU memory a bucket
    at a time: no buffer an all-gather writes into or sends from (the parameters' own storage
    aside) is larger than a bucket, for a model of more than 30 buckets. (full_optimizer_state
    sent each state from a copy of this rank's whole own space: Ψ/Nd, at stage 0 Ψ.)"""
    written, psi = world(2).run(on_rank_export_buffers, stage, 1000)[0]
    print(f"stage {stage}: {len(written)} buffers handed to all-gathers, the largest {max(written)} elements, Ψ = {psi}")
    assert psi > 30 * 1000 and written and max(written) <= 1000, (max(written), psi)


# -----------------------------------------------------------------------------------------
# C_B at any Nd: zero.py's own code as ranks 0, 32 and 63 of a fake world of 64 (torch's
# `fake` process group: collectives take their tensors and move no data). The bucket is
# smaller than a rank's shard, so a design where a bucket lies inside one rank's shard would
# have that rank receive Nd copies of it.
# -----------------------------------------------------------------------------------------
COLLECTIVES = ("all_to_all_single", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
               "reduce_scatter_tensor", "broadcast", "all_reduce", "all_gather", "reduce_scatter", "reduce")


def collectives_at_scale(stage, rank, nd=64, bucket_numel=256, reduction="exact"):
    """[(collective, [numel of each tensor handed to it], numel of what it receives, whether floats)] in two
    training steps (with clipping) of a 33K-parameter MLP, as `rank` of a fake world of nd."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=nd)
    calls, real = [], {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name):
        def recorded(*args, **kwargs):
            tensors = [t for a in list(args) + list(kwargs.values())
                       for t in (a if isinstance(a, list) else [a]) if torch.is_tensor(t)]
            received = tensors[0].numel() if name in ("all_to_all_single", "reduce_scatter_single",
                                                      "reduce_scatter_tensor") else 0
            calls.append((name, [t.numel() for t in tensors], received, any(t.is_floating_point() for t in tensors)))
            return real[name](*args, **kwargs)
        return recorded

    try:
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        model, opt = zero.initialize(mlp, torch.optim.AdamW, stage=stage, bucket_numel=bucket_numel,
                                     reduction=reduction, lr=1e-3)
        for name in COLLECTIVES:
            setattr(dist, name, wrap(name))
        for step in range(2):
            F.mse_loss(model(torch.randn(4, 64)), torch.randn(4, 64)).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        return calls, sum(p.numel() for p in mlp.parameters())
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
        dist.destroy_process_group()


@pytest.mark.parametrize("reduction", ["exact", "native"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_collective_grows_with_nd_at_world_64(stage, reduction):
    """At Nd 64, as ranks 0, 32 and 63: every tensor zero.py hands a collective (send and
    receive buffers alike, and views of the parameters' own storage) is at most 2 x bucket_numel
    elements, no reduction gives a rank more than that to receive, and no gather is a
    broadcast (one per owner); training ran all three collectives ZeRO-DP needs."""
    bucket_numel, nd = 256, 64
    for rank in (0, 32, 63):
        calls, psi = collectives_at_scale(stage, rank, nd, bucket_numel, reduction)
        assert math.ceil(psi / nd) > bucket_numel, "the bucket must be smaller than a shard"
        largest = max(n for name, sizes, received, floats in calls for n in sizes)
        most_received = max(received for name, sizes, received, floats in calls)
        used = {name for name, sizes, received, floats in calls}
        # (one broadcast of bucket indices, int64: the reduction order rank 0's first backward saw)
        gathers_as_broadcasts = [sizes for name, sizes, received, floats in calls if name == "broadcast" and floats]
        print(f"stage {stage} {reduction} rank {rank}: {len(calls)} collectives, largest tensor {largest} "
              f"elements, most received {most_received}, bucket {bucket_numel}, {sorted(used)}")
        assert largest <= 2 * bucket_numel and most_received <= 2 * bucket_numel, (largest, most_received)
        assert not gathers_as_broadcasts, gathers_as_broadcasts
        assert {"all_gather_single", "all_to_all_single" if reduction == "exact" else "reduce_scatter_single"} <= used


class CountAdds(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.adds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.adds += func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("nd", [3, 64, 1000, 1024])
def test_exact_sum_of_a_bucket_is_a_pairwise_tree_of_log2_nd_adds(nd):
    """The exact reduction's sum of one bucket's Nd rows, as rank 0 of a fake world of nd (its
    all-to-all moves no data: the rows are written here): the pairwise sum of helpers.py, bit for
    bit, in ceil(log2 Nd) adds, one per level of the tree, however large Nd (a fold rank by rank
    would launch Nd - 1)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=nd)
    try:
        param = nn.Parameter(torch.empty(nd * 24))
        part = zero.FlatPartition([param], [([param], True)], None, nd * 24, "exact", torch.device("cpu"),
                                   {param: "w"})
        chunk = part.buckets[0].chunk
        pending = part.reduce_scatter(torch.zeros(chunk * nd), 0)
        rows = torch.randn(nd, chunk, generator=torch.Generator().manual_seed(nd))
        pending[2].copy_(rows)  # what rank j's chunk 0 would be, in row j
        out, counter = torch.empty(chunk), CountAdds()
        with counter:
            part.finish_reduce(pending, out, add=False)
    finally:
        dist.destroy_process_group()
    print(f"Nd {nd}: {counter.adds} adds for a bucket of {nd} x {chunk} elements")
    assert torch.equal(out, pairwise_sum(list(rows)))  # (the rows as each rank sends them: divided by Nd)
    assert counter.adds == math.ceil(math.log2(nd)), counter.adds


def test_default_bucket_keeps_every_chunk_at_2_16_elements_or_more():
    """The default C_B is 2^22 elements up to Nd 64 and grows beyond, so that every rank's chunk
    of a full bucket stays at least 2^16 elements: a constant 2^22 would cut each bucket into
    pieces of 4,096 elements at Nd 1024, every collective bound by latency. zero.py's own
    partition of a 134M-parameter model on the meta device, as rank 0 of fake worlds."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    for nd, bucket_numel in ((2, 2**22), (64, 2**22), (256, 2**24), (1024, 2**26)):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=nd)
        try:
            with torch.device("meta"):
                mlp = nn.Sequential(nn.Linear(8192, 8192), nn.Linear(8192, 8192))
            model, opt = zero.initialize(mlp, torch.optim.AdamW, stage=1, init_fn=lambda m: None, device="meta")
            chunks = [b.chunk for b in opt.partition.buckets]
        finally:
            dist.destroy_process_group()
        full = chunks.count(bucket_numel // nd)
        print(f"Nd {nd}: {len(chunks)} buckets, {full} of {bucket_numel // nd} elements a rank, the largest {max(chunks)}")
        assert zero.default_bucket_numel(nd) == bucket_numel and bucket_numel // nd >= 2**16
        assert full >= 2 and max(chunks) == bucket_numel // nd, (nd, chunks)


# -----------------------------------------------------------------------------------------
# M_D: the long-lived tensors are views into pre-allocated contiguous buffers
# -----------------------------------------------------------------------------------------
def on_rank_long_lived_tensors_are_views(stage):
    dp_group, tp_group = make_mesh(dp=1, tp=2)
    model = GPT(CONFIG, tp_group, seed=0)
    ckpt = zero.checkpoint_activations(model.h, tp_group=tp_group, partition=True, contiguous=True)
    model, opt = zero.initialize(model, torch.optim.AdamW, stage=stage, group=dp_group, lr=1e-2)
    problems, grad_storages = [], set()
    for step in range(2):
        x, y = batch(step, dp_group)
        loss = model(x, y)[1]
        arena = ckpt.arena.untyped_storage()._cdata
        part_bytes = math.ceil(B * T * CONFIG.n_embd / 2) * 4
        elsewhere = [s for s in zero.live_storages().values() if s.nbytes() == part_bytes and s._cdata != arena]
        if ckpt.busy != [True] * CONFIG.n_layer or ckpt.arena.shape[0] != CONFIG.n_layer or elsewhere:
            problems.append(f"step {step}: checkpoints not all in one arena of {CONFIG.n_layer} slots")
        loss.backward()
        opt.clip_grad_norm_(1.0)
        read = opt.gradients.own(slice(0, opt.own_numel), torch.float32)  # where step() reads the gradient
        grad_storages |= {read.untyped_storage()._cdata}
        opt.step()
        opt.zero_grad()
    if grad_storages != {opt.gradients.reduced.untyped_storage()._cdata}:
        problems.append(f"the gradient partition is not one persistent buffer: {len(grad_storages)} storages")
    return problems


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [2, 3])
def test_md_long_lived_tensors_are_views_into_contiguous_buffers(world, stage):
    assert world(2).run(on_rank_long_lived_tensors_are_views, stage) == [[], []]
