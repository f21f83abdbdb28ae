"""Shard-only initialisation: a model built on the meta device and initialised by zero.initialize
one module at a time is, bit for bit, the model built whole; at stage 3 no rank ever holds more
than its shard plus about one unit while it starts.

    python -m pytest -n 2 test_init.py
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero
from gpt import GPT, GPTConfig, make_mesh
from helpers import missed_errors

CONFIG = GPTConfig(block_size=16, vocab_size=64, n_layer=4, n_head=4, n_embd=32)


def build(stage, meta, dp_group=None, tp_group=None, **kwargs):
    """GPT at `stage`, built whole (every rank starts from rank 0's weights) or on meta."""
    module = GPT(CONFIG, tp_group, seed=5, device="meta" if meta else None)
    return zero.initialize(module, torch.optim.AdamW, stage=stage, group=dp_group, bucket_numel=1000,
                           stage3_units=module.h, init_fn=module.init_weights if meta else None, lr=1e-2, **kwargs)


def states_after_steps(stage, meta, dp_group=None, tp_group=None, **kwargs):
    """Every full state (parameters, AdamW's state) after initialize and after each of 2 steps."""
    model, opt = build(stage, meta, dp_group, tp_group, **kwargs)
    states = [zero.full_state_dict(model)]
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank(dp_group))
        x, y = torch.randint(0, 64, (3, 16), generator=g), torch.randint(0, 64, (3, 16), generator=g)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        states.append({**zero.full_state_dict(model),
                       **{f"{name}.{key}": t for name, s in zero.full_optimizer_state(model).items()
                          for key, t in s.items()}})
    return states


def on_rank_meta_equals_whole(stage, dp, tp, kwargs):
    dp_group, tp_group = make_mesh(dp=dp, tp=tp) if tp > 1 else (None, None)
    whole = states_after_steps(stage, False, dp_group, tp_group, **kwargs)
    meta = states_after_steps(stage, True, dp_group, tp_group, **kwargs)
    return [f"step {i} {k}" for i, (w, m) in enumerate(zip(whole, meta, strict=True))
            for k in w.keys() | m.keys() if k not in w or k not in m or not torch.equal(w[k], m[k])]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("nd", [pytest.param(nd, marks=pytest.mark.xdist_group(f"world{nd}")) for nd in (2, 4)])
def test_meta_init_equals_the_whole_build_bit_for_bit(world, stage, nd):
    assert world(nd).run(on_rank_meta_equals_whole, stage, nd, 1, {}) == [[]] * nd


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 3])
def test_meta_init_with_bf16_and_fp32_master_equals_the_whole_build(world, stage):
    """The fp32 master takes the full-precision values before any cast to bf16, in both builds."""
    assert world(2).run(on_rank_meta_equals_whole, stage, 2, 1, {"param_dtype": torch.bfloat16}) == [[]] * 2


@pytest.mark.xdist_group("world4")
@pytest.mark.parametrize("stage", [1, 3])
def test_meta_init_equals_the_whole_build_at_tp2_x_dp2(world, stage):
    """Each tp rank draws the full weight and keeps its slice, then shards it over dp."""
    assert world(4).run(on_rank_meta_equals_whole, stage, 2, 2, {}) == [[]] * 4


def on_rank_peak_while_initializing():
    """Live bytes (every tensor alive on the CPU) sampled after each module is initialised and
    once initialize returns, beyond what was alive before the model was built."""
    before = zero.live_storages()  # held: no new storage can take one of their ids
    new_bytes = lambda: sum(s.nbytes() for k, s in zero.live_storages().items() if k not in before)
    module = GPT(CONFIG, seed=5, device="meta")
    samples = [new_bytes()]

    def init_fn(m):
        module.init_weights(m)
        samples.append(new_bytes())

    model, opt = zero.initialize(module, torch.optim.AdamW, stage=3, bucket_numel=1000, stage3_units=module.h,
                                 init_fn=init_fn, lr=1e-2)
    held = new_bytes()  # the shard and its reduced gradient: what stage 3 keeps
    unit = max(sum(p.numel() for p in block.parameters()) for block in module.h) * 4
    psi = sum(p.numel() for p in module.parameters())
    return max(samples + [held]), held, unit, psi


@pytest.mark.xdist_group("world2")
def test_stage3_meta_init_holds_no_more_than_the_shard_and_one_unit(world):
    for peak, held, unit, psi in world(2).run(on_rank_peak_while_initializing):
        bucket = 1000 * 4  # the bucket of starting values being filled
        print(f"peak {peak} B = held {held} + {peak - held} (one unit: {unit} B, one bucket: {bucket} B); "
              f"a whole build holds the model, {4 * psi} B, beyond what it keeps")
        assert peak <= held + unit + bucket
        assert 4 * psi > unit + bucket  # the bound leaves no room for a whole model


class LinearWithBuffer(nn.Linear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("scale", torch.ones(1, device=kwargs.get("device")))

    def reset_parameters(self):
        super().reset_parameters()
        if hasattr(self, "scale"):
            self.scale.fill_(1.0)


def on_rank_peak_with_buffers():
    before = zero.live_storages()
    new_bytes = lambda: sum(s.nbytes() for k, s in zero.live_storages().items() if k not in before)
    torch.manual_seed(0)
    module = nn.Sequential(*[LinearWithBuffer(256, 256, bias=False, device="meta") for _ in range(8)])
    samples = []

    def init_fn(m):
        m.reset_parameters()
        samples.append(new_bytes())

    model, opt = zero.initialize(module, torch.optim.SGD, stage=3, bucket_numel=2**16, init_fn=init_fn, lr=0.1)
    return max(samples), new_bytes(), 256 * 256 * 4


@pytest.mark.xdist_group("world4")
def test_stage3_meta_init_of_modules_with_buffers_holds_the_shard_and_one_module(world):
    """A module that holds a buffer is initialised with its parameters, bucket by bucket, not all
    at once when the buffers are made (8 such layers, 2 MB, would otherwise all be whole at once;
    a rank at Nd 4 keeps 1 MB)."""
    for peak, held, module in world(4).run(on_rank_peak_with_buffers):
        print(f"peak {peak} B = held {held} + {peak - held} (one module: {module} B)")
        assert peak <= held + module + 2**16 * 4


def on_rank_peak_with_frozen_biases(stage):
    before = zero.live_storages()
    new_bytes = lambda: sum(s.nbytes() for k, s in zero.live_storages().items() if k not in before)
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(256, 256, device="meta") for _ in range(8)])
    for m in module:
        m.bias.requires_grad_(False)  # (a LoRA base's are frozen so)
    samples = []

    def init_fn(m):
        m.reset_parameters()
        samples.append(new_bytes())

    model, opt = zero.initialize(module, torch.optim.SGD, stage=stage, bucket_numel=2**14, init_fn=init_fn, lr=0.1)
    return max(samples), new_bytes(), sum(p.numel() for p in module.parameters()) * 4


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 2])
def test_meta_init_with_frozen_parameters_frees_each_parameter_once_copied_out(world, stage):
    """Stages 0-2 lay the frozen parameters out after every trainable one, so a module with a frozen bias
    was done only once the frozen buckets came, each weight kept till then: the whole fp32 model alive at
    once (2.1 MB beyond what is kept, for a 2.1 MB model). Each parameter is freed after its own last
    bucket: a module and two buckets at most."""
    for peak, held, model in world(2).run(on_rank_peak_with_frozen_biases, stage):
        module, bucket = (256 * 256 + 256) * 4, 2**14 * 4
        print(f"peak {peak} B = held {held} + {peak - held} (the model: {model} B; a module {module}, a bucket {bucket})")
        assert peak <= held + module + 2 * bucket


def on_rank_meta_bad_inputs():
    def half_meta():
        module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
        zero.initialize(module, torch.optim.AdamW, stage=3, init_fn=lambda m: m.reset_parameters())
    def forgets_a_bias(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight)

    def replaces_parameters(m):  # (the module ends filled, but with Parameters zero never laid out)
        m.weight, m.bias = nn.Parameter(torch.ones(m.weight.shape)), nn.Parameter(torch.zeros(m.bias.shape))

    def sets_a_sentinel(m):  # a "best so far" buffer set to its type's largest value on purpose
        m.reset_parameters()
        m.mask.copy_(torch.ones(6, 6, dtype=torch.bool).tril())
        m.cache.fill_(torch.iinfo(torch.int64).max)
        m.table.zero_()
    cases = {
        "init_fn left ['bias'] of 0 (Linear) unset: init_fn(m) must fill every parameter": lambda: zero.initialize(
            nn.Sequential(nn.Linear(4, 4, device="meta")), torch.optim.AdamW, stage=1, init_fn=forgets_a_bias),
        "init_fn left ['in_proj_weight', 'in_proj_bias'] of the root module (MultiheadAttention) unset": lambda: zero.initialize(
            nn.MultiheadAttention(8, 2, device="meta"), torch.optim.AdamW, stage=3,
            init_fn=lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None),
        "on the meta device: pass init_fn": lambda: zero.initialize(
            nn.Linear(4, 4, device="meta"), torch.optim.AdamW, stage=3),
        "build the whole module on meta": half_meta,
        "init_fn replaced ['weight', 'bias'] of the root module (Linear) with new Parameters, but zero.initialize "
        "has laid out those it made: fill them in place": lambda: zero.initialize(
            nn.Linear(2, 2, device="meta"), torch.optim.SGD, stage=1, init_fn=replaces_parameters, lr=0.1),
        "init_fn left ['cache'] of the root module (WithBuffers) unset": lambda: zero.initialize(
            WithBuffers(meta=True), torch.optim.AdamW, stage=1, init_fn=sets_a_sentinel),
        "A value set on purpose that reads as unset (NaN, an integer type's largest) cannot be told apart: register "
        "that buffer on a real device in __init__": lambda: zero.initialize(
            WithBuffers(meta=True), torch.optim.AdamW, stage=1, init_fn=sets_a_sentinel),
        "already initialised: drop init_fn": lambda: zero.initialize(
            nn.Linear(4, 4), torch.optim.AdamW, stage=3, init_fn=lambda m: m.reset_parameters()),
    }
    for what, dtype in (("left ['cache', 'table'] of the root module (WithBuffers) unset", torch.int64),
                        ("init_fn left ['cache', 'table'] of the root module (WithBuffers)", torch.complex64)):
        cases[what] = lambda dtype=dtype: zero.initialize(  # buffers from __init__ that init_fn does not refill
            WithBuffers(meta=True, dtype=dtype), torch.optim.AdamW, stage=1, init_fn=lambda m: m.reset_parameters())
    return missed_errors(cases, ValueError)


class RegistersItsCache(nn.Linear):
    """Computes a non-persistent cache by registering it (as Hugging Face's RoPE _set_cos_sin_cache does),
    in __init__ and again in init_fn."""

    def __init__(self, device=None):
        super().__init__(4, 4, device=device)
        self.set_cache(device)

    def set_cache(self, device):
        self.register_buffer("cos", torch.arange(16.0, device=device).cos(), persistent=False)


def on_rank_buffer_registered_anew():
    torch.manual_seed(0)
    whole = RegistersItsCache()
    torch.manual_seed(0)
    meta = RegistersItsCache(device="meta")
    zero.initialize(meta, torch.optim.SGD, stage=1, lr=0.1, init_fn=lambda m: (m.reset_parameters(), m.set_cache("cpu")))
    return torch.equal(meta.cos, whole.cos) and torch.equal(zero.full_state_dict(meta)["weight"], whole.weight)


@pytest.mark.xdist_group("world2")
def test_a_buffer_init_fn_registers_anew_is_taken_as_filled(world):
    """A buffer init_fn registers again (a new tensor, not the one zero made) was reported left unset."""
    assert world(2).run(on_rank_buffer_registered_anew) == [True, True]


class WithBuffers(nn.Linear):
    """Buffers computed in __init__, as a causal mask, position ids or a RoPE cache are: on meta
    they have no values, and init_fn must compute them again (fill_buffers). `kept` is made on the
    CPU even under the meta device, and keeps its values."""

    def __init__(self, meta=False, dtype=torch.int64):
        super().__init__(6, 6, device="meta" if meta else None)
        self.register_buffer("mask", torch.ones(6, 6, dtype=torch.bool, device=self.weight.device).tril())
        self.register_buffer("cache", torch.arange(6, device=self.weight.device).to(dtype))
        self.register_buffer("table", torch.arange(6.0, device=self.weight.device).mul(0.37).sin())
        self.register_buffer("kept", torch.arange(6, device="cpu"))

    def fill_buffers(self):
        self.mask.copy_(torch.ones(6, 6, dtype=torch.bool).tril())
        self.cache.copy_(torch.arange(6).to(self.cache.dtype))
        self.table.copy_(torch.arange(6.0)).mul_(0.37).sin_()


def on_rank_meta_buffers(stage):
    """Every buffer after initialize, built whole and on meta, bf16 compute over an fp32 master."""
    result = []
    for meta in (False, True):
        torch.manual_seed(0)
        init_fn = lambda m: (m.reset_parameters(), m.fill_buffers())
        model, opt = zero.initialize(WithBuffers(meta, torch.complex64), torch.optim.AdamW, stage=stage, lr=1e-2,
                                     param_dtype=torch.bfloat16, init_fn=init_fn if meta else None)
        result.append({name: b.clone() for name, b in model.named_buffers()})
    return result


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 3])
def test_meta_init_fills_buffers_of_every_dtype_as_the_whole_build(world, stage):
    """A bool mask, a complex cache and a float table computed again by init_fn, and a buffer made
    on the CPU, equal the whole build's, the float one cast to bf16 once (init_fn fills it in its
    own dtype); an integer or complex buffer init_fn leaves unset is an error (see above), where it
    was memory left as it was, different on each rank."""
    for whole, meta in world(2).run(on_rank_meta_buffers, stage):
        print({name: (b.dtype, torch.equal(b, meta[name])) for name, b in whole.items()})
        assert set(whole) == set(meta) and all(torch.equal(b, meta[name]) for name, b in whole.items())


@pytest.mark.xdist_group("world1")
def test_meta_bad_inputs_get_errors_that_name_the_fix(world):
    assert world(1).run(on_rank_meta_bad_inputs) == [[]]


def on_rank_torch_layers_init_from_meta():
    """A plain torch model with reset_parameters as init_fn: every rank draws from the same
    global seed in the same order, so the ranks agree and training runs."""
    torch.manual_seed(0)
    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    model, opt = zero.initialize(module, torch.optim.AdamW, stage=3, bucket_numel=50,
                                 init_fn=lambda m: m.reset_parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = zero.full_state_dict(model)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, state)
    return all(torch.equal(state[k], other[k]) for other in everyone for k in state)


@pytest.mark.xdist_group("world2")
def test_torch_layers_initialise_from_meta_with_reset_parameters(world):
    assert world(2).run(on_rank_torch_layers_init_from_meta) == [True, True]


class TiedWithBias(nn.Module):
    """The output layer's weight is the embedding's, and the output layer has a bias of its own."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 11)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.mid(self.emb(x)))


def on_rank_tied_weight_in_a_module_with_its_own_bias(stage, bucket_numel):
    with torch.device("meta"):
        module = TiedWithBias()
    fills = {module.emb: 1.0, module.mid: 2.0, module.head: 3.0}

    @torch.no_grad()
    def init_fn(m):
        for p in m.parameters(recurse=False):
            p.fill_(fills[m])

    model, opt = zero.initialize(module, torch.optim.SGD, stage=stage, bucket_numel=bucket_numel, init_fn=init_fn,
                                 lr=0.1)
    before = {name: t.unique().tolist() for name, t in zero.full_state_dict(model).items()}
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    return before


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage, bucket_numel", [(1, 8), (3, None)])
def test_tied_weight_keeps_its_first_modules_init_when_the_second_module_has_its_own_parameters(
        world, stage, bucket_numel):
    """init_fn(head) fills head's bias and would write the tied weight too: the weight keeps the
    embedding's values (as when the tie is made after building both), and the embedding's
    storage, freed once its bucket is copied out, is never written."""
    expected = {"emb.weight": [1.0], "mid.weight": [2.0], "mid.bias": [2.0], "head.weight": [1.0], "head.bias": [3.0]}
    assert world(2).run(on_rank_tied_weight_in_a_module_with_its_own_bias, stage, bucket_numel) == [expected] * 2


class SharedMask(nn.Module):
    """Two layers holding one mask buffer (made once, handed to both), as a causal mask shared by
    every block is."""

    def __init__(self):
        super().__init__()
        mask = torch.arange(6.0).lt(4).float()  # (6,): 1 1 1 1 0 0
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        for layer in (self.a, self.b):
            layer.register_buffer("mask", mask)

    def forward(self, x):
        return self.b(self.a(x) * self.a.mask) * self.b.mask


def on_rank_shared_buffer(stage):
    """Buffers and one step's weights, built whole and on meta: (names, one tensor?, state)."""
    result = []
    for meta in (False, True):
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            module = SharedMask()

        def init_fn(m):
            m.reset_parameters()
            m.mask.copy_(torch.arange(6.0).lt(4).float())

        model, opt = zero.initialize(module, torch.optim.SGD, stage=stage, lr=0.1, init_fn=init_fn if meta else None)
        model(torch.ones(2, 6)).sum().backward()
        opt.step()
        result.append(([n for n, _ in model.named_buffers()], model.a.mask is model.b.mask, zero.full_state_dict(model)))
    return result


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 3])
def test_a_buffer_shared_by_two_modules_stays_one_tensor_from_meta(world, stage):
    """On meta the shared buffer is made once, as the whole build holds it (not one tensor per
    module: twice the memory, and an in-place update to one not seen by the other)."""
    for (names, one, state), (meta_names, meta_one, meta_state) in world(2).run(on_rank_shared_buffer, stage):
        print(names, one, meta_names, meta_one)
        assert (meta_names, meta_one) == (names, one) == (["a.mask"], True)
        assert state.keys() == meta_state.keys() and all(torch.equal(state[k], meta_state[k]) for k in state)


class EmptyWithTable(nn.Module):
    """A module whose only parameter has no elements (a zero-rank adapter) and which holds a
    buffer computed in __init__: on meta, its init_fn must still run, to compute the buffer."""

    def __init__(self):
        super().__init__()
        self.adapter = nn.Parameter(torch.empty(0, 4))
        self.register_buffer("table", torch.arange(4.0).mul(0.37).sin())

    def reset_parameters(self):
        self.table.copy_(torch.arange(4.0)).mul_(0.37).sin_()


def on_rank_empty_parameter_with_buffer(stage):
    """The buffers built whole and on meta."""
    result = []
    for meta in (False, True):
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            module = nn.Sequential(nn.Linear(4, 4), EmptyWithTable())
        model, opt = zero.initialize(module, torch.optim.SGD, stage=stage, lr=0.1,
                                     init_fn=(lambda m: m.reset_parameters()) if meta else None)
        result.append({name: b.clone() for name, b in model.named_buffers()})
    return result


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 3])
def test_a_module_whose_parameters_are_empty_still_initialises_its_buffers_from_meta(world, stage):
    for whole, meta in world(2).run(on_rank_empty_parameter_with_buffer, stage):
        assert set(whole) == set(meta) == {"1.table"} and torch.equal(whole["1.table"], meta["1.table"]), (whole, meta)


def shuffled_rows(m):
    """The same values on every rank, rows in another order on rank 1 (a table read through a set, say)."""
    rows = torch.arange(m.weight.numel(), dtype=torch.float32).view_as(m.weight)
    with torch.no_grad():
        m.weight.copy_(rows.flip(0) if dist.get_rank() == 1 else rows)
        m.bias.zero_()


def on_rank_meta_init_that_differs_by_rank(stage, how):
    with torch.random.fork_rng():
        torch.manual_seed(dist.get_rank())  # each rank its own draws: init_fn gives the ranks different values
        with torch.device("meta"):
            module = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        try:
            zero.initialize(module, torch.optim.SGD, stage=stage, lr=0.1,  # (shuffled: within one bucket)
                            bucket_numel=50 if how == "seeded" else None,
                            init_fn=shuffled_rows if how == "shuffled" else lambda m: m.reset_parameters())
        except ValueError as e:
            return str(e)
    return None


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("how", ["seeded", "shuffled"])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_meta_init_that_gives_the_ranks_different_values_is_refused(world, stage, how):
    """Each rank computes the values itself: from per-rank seeds, stage 0's replicas would train apart
    (full_state_dict differed by rank after 3 steps) and at stages 1-3 each shard would hold its own
    rank's draws. Every rank raises, naming the first parameter whose values differ. The same values in
    another order on one rank too: the check weighs each element's bits by its place (a plain sum of the
    bits let it through)."""
    errors = world(2).run(on_rank_meta_init_that_differs_by_rank, stage, how)
    print(errors)
    assert all(e and "init_fn gave the ranks different values (first in ['0.weight'" in e for e in errors), errors
