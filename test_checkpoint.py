"""Sharded checkpoints: resume bit for bit, reshard to another Nd or stage, consolidate to plain
torch, refuse what is broken.

    python -m pytest -n 2 test_checkpoint.py
"""
import argparse
import hashlib
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import helpers
import zero
from ranks import settled
from gpt import GPT, GPTConfig, make_mesh

CONFIG = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)


def decay_groups(module):
    """Weight decay for the matrices, none for the vectors (the biases and LayerNorms)."""
    return [{"params": [p for p in module.parameters() if p.dim() >= 2]},
            {"params": [p for p in module.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def make(stage, bucket_numel=700, config=CONFIG, optimizer=torch.optim.AdamW, groups_swapped=False, seed=1,
         **kwargs):
    module = GPT(config, seed=seed, device="meta")
    groups = decay_groups(module)
    return zero.initialize(module, optimizer, stage=stage, bucket_numel=bucket_numel, stage3_units=module.h,
                           param_groups=groups[::-1] if groups_swapped else groups,
                           init_fn=module.init_weights, lr=1e-2, **kwargs)


def batch(step):
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return torch.randint(0, 64, (3, 16), generator=g), torch.randint(0, 64, (3, 16), generator=g)


def train(model, opt, first, last, clip=True):
    losses = []
    for step in range(first, last):
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)  # a schedule: restored with the param_groups
        x, y = batch(step)
        loss = model(x, y)[1]
        opt.backward(loss)
        if clip:
            opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def full_state(model):
    state = dict(zero.full_state_dict(model))
    for name, keys in zero.full_optimizer_state(model).items():
        state.update({f"{name}:{key}": torch.as_tensor(v) for key, v in keys.items()})
    return state


def differences(a, b):
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


# -----------------------------------------------------------------------------------------
# Resume: saved at step k and resumed, the run is the uninterrupted run, bit for bit
# -----------------------------------------------------------------------------------------
def on_rank_resume(path, stage, kwargs):
    model, opt = make(stage, **kwargs)
    train(model, opt, 0, 3)
    gen = torch.Generator().manual_seed(dist.get_rank())  # a data position to carry over
    zero.save_checkpoint(path, model, opt, step=3, data=gen.get_state())
    torch.manual_seed(1234 + dist.get_rank())  # disturb the RNG: load restores it
    want = train(model, opt, 3, 6)
    want_state, want_scale = full_state(model), (opt.loss_scale, opt.clean_steps)
    model, opt = make(stage, seed=2, **kwargs)  # other weights: the load replaces every one
    extra = zero.load_checkpoint(path, model, opt)
    got = train(model, opt, extra["step"], 6)
    assert torch.equal(extra["data"], gen.get_state())
    assert (opt.loss_scale, opt.clean_steps) == want_scale, ((opt.loss_scale, opt.clean_steps), want_scale)
    return [bool(torch.equal(a, b)) for a, b in zip(want, got, strict=True)], differences(want_state, full_state(model))


RESUME = [pytest.param(nd, stage, {}, marks=pytest.mark.xdist_group(f"world{nd}"))
          for nd, stage in [(1, 3), (2, 0), (2, 1), (2, 2), (2, 3), (3, 1), (4, 3)]]
RESUME += [pytest.param(2, stage, {"param_dtype": dtype}, marks=pytest.mark.xdist_group("world2"))
           for stage in (1, 3) for dtype in (torch.bfloat16, torch.float16)]
# fp16 with a loss scale that grows every 2 clean steps: the resumed run grows it when the whole run does
GROWING = zero.DynamicLossScale(init_scale=2.0**10, growth_interval=2)
RESUME += [pytest.param(2, 2, {"param_dtype": torch.float16, "loss_scale": GROWING},
                        marks=pytest.mark.xdist_group("world2"), id="2-2-fp16-growing")]


@pytest.mark.parametrize("nd, stage, kwargs", RESUME)
def test_resume_continues_bit_for_bit(world, tmp_path, nd, stage, kwargs):
    for same_losses, differing in world(nd).run(on_rank_resume, str(tmp_path / "ckpt"), stage, kwargs):
        assert same_losses == [True] * 3 and differing == []


def on_rank_resume_with_other_loss_scale_settings(path):
    """The scale's settings are zero.initialize's, its state (the scale, the clean steps since the
    last overflow) the checkpoint's. A count at or past a shorter growth_interval used to stop the
    scale from ever growing again (it grew only where the count equalled the interval)."""
    model, opt = make(1, param_dtype=torch.float16, loss_scale=zero.DynamicLossScale(2.0**10, growth_interval=100))
    train(model, opt, 0, 3)
    zero.save_checkpoint(path, model, opt)
    saved = (opt.loss_scale, opt.clean_steps)
    model, opt = make(1, param_dtype=torch.float16, loss_scale=zero.DynamicLossScale(2.0**12, growth_interval=2))
    zero.load_checkpoint(path, model, opt)
    scales = [(opt.loss_scale, opt.clean_steps)]
    train(model, opt, 3, 6)
    scales.append((opt.loss_scale, opt.clean_steps))
    model, opt = make(1, param_dtype=torch.float16, loss_scale=64.0)  # static: the number passed, kept
    zero.load_checkpoint(path, model, opt)
    static = opt.loss_scale
    model, opt = make(1, param_dtype=torch.float16, loss_scale=zero.DynamicLossScale(16.0, growth_interval=0))
    train(model, opt, 0, 3)  # an interval below 1 never grows, as torch.amp.GradScaler's
    return saved, scales, static, opt.loss_scale


@pytest.mark.xdist_group("world1")
def test_a_resumed_loss_scale_grows_under_the_new_settings_and_a_static_one_is_kept(world, tmp_path):
    (saved, scales, static, never), = world(1).run(on_rank_resume_with_other_loss_scale_settings,
                                                   str(tmp_path / "ckpt"))
    print("saved (scale, clean steps):", saved, "resumed, then after 3 steps:", scales, "static:", static)
    assert saved == (2.0**10, 3), saved  # three clean steps under growth_interval=100
    assert scales == [(2.0**10, 3), (2.0**12, 0)], scales  # grown at the first step (4 >= 2), then 2 steps on
    assert static == 64.0 and never == 16.0, (static, never)


def on_rank_option_json_rewrites(path, option):
    """A param_group option JSON cannot hold as it is: a dict with int keys came back with str keys, silently; a set
    or a dtype failed the save with JSON's own error, naming neither the option nor a fix."""
    model, opt = make(1)
    opt.param_groups[0]["tags"] = option
    with pytest.raises(RuntimeError, match="the checkpoint was not written") as refused:
        zero.save_checkpoint(path, model, opt)
    return str(refused.value), os.path.exists(path)


def on_rank_option_nan(path):
    model, opt = make(1)
    opt.param_groups[0]["tags"] = [float("nan"), 1]  # JSON gives NaN back
    zero.save_checkpoint(path, model, opt)
    zero.load_checkpoint(path, model, opt)
    return repr(opt.param_groups[0]["tags"])


@pytest.mark.xdist_group("world1")
def test_a_nan_option_saves_and_loads(world, tmp_path):
    assert world(1).run(on_rank_option_nan, str(tmp_path / "ckpt")) == ["[nan, 1]"]


@pytest.mark.xdist_group("world1")
@pytest.mark.parametrize("option", [{2: "a", 10: "b"}, {1, 2}, torch.float16], ids=["int-keys", "set", "dtype"])
def test_an_option_the_manifest_would_rewrite_is_refused_at_save(world, tmp_path, option):
    (error, saved), = world(1).run(on_rank_option_json_rewrites, str(tmp_path / "ckpt"), option)
    print(error)
    assert f"param_group option tags={option!r} would not load back" in error and not saved, error


def on_rank_resume_with_a_parameter_not_yet_stepped(path, stage):
    """helpers.Net's `rarely` is unused in step 0, so AdamW has no state for it when step 1's
    checkpoint is saved; resumed, its first step must start that state as the uninterrupted run does."""
    symmetric = stage == 3
    def run(model, opt, first, last):
        losses = []
        for step in range(first, last):
            g = torch.Generator().manual_seed(10 * step + dist.get_rank())
            x, y = torch.randint(0, helpers.VOCAB, (4, 5), generator=g), torch.randint(0, helpers.VOCAB, (4, 5), generator=g)
            out = model(x, *helpers.usage(step, dist.get_rank(), symmetric))
            loss = torch.nn.functional.cross_entropy(out.view(-1, helpers.VOCAB), y.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses
    def make_net(seed):
        torch.manual_seed(seed + dist.get_rank())
        return zero.initialize(helpers.Net(), torch.optim.AdamW, stage=stage, lr=1e-2)
    model, opt = make_net(100)
    run(model, opt, 0, 1)
    zero.save_checkpoint(path, model, opt, step=1)
    want = run(model, opt, 1, 3), full_state(model)
    model, opt = make_net(999)  # other weights, the frozen layer's too: the load replaces every one
    zero.load_checkpoint(path, model, opt)
    got = run(model, opt, 1, 3), full_state(model)
    return [bool(torch.equal(a, b)) for a, b in zip(want[0], got[0], strict=True)], differences(want[1], got[1])


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_when_a_parameter_had_no_optimizer_state_yet(world, tmp_path, stage):
    for same_losses, differing in world(2).run(on_rank_resume_with_a_parameter_not_yet_stepped,
                                               str(tmp_path / "ckpt"), stage):
        assert same_losses == [True, True] and differing == []
    # consolidated, the checkpoint holds no state for the parameters AdamW had not stepped, as a
    # torch.optim optimizer holds none (rarely, unused in step 0; frozen, never trained)
    names = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["param_groups"][0]["params"]
    state = zero.consolidate(tmp_path / "ckpt")["optimizer"]["state"]
    assert sorted(names[i] for i in state) == sorted(n for n in names if not n.startswith(("rarely.", "frozen.")))


def on_rank_save_unloadable_extra(path):
    model, opt = make(1)
    errors = []
    for extra in [{"args": argparse.Namespace(lr=1e-2)}, {"step": 1, "schedule": (lambda step: 1.0)}]:
        try:
            zero.save_checkpoint(path, model, opt, **extra)
            errors.append("no error")
        except RuntimeError as e:
            errors.append(str(e))
    return errors


@pytest.mark.xdist_group("world2")
def test_extra_that_cannot_be_loaded_back_is_refused_at_save(world, tmp_path):
    """load_checkpoint reads with torch.load(weights_only=True): an argparse.Namespace in extra
    would save and then never load, and a lambda cannot be saved at all; either is named, and the
    failed save leaves no directory behind, not even path.partial or the directories it made above it."""
    for namespace, function in world(2).run(on_rank_save_unloadable_extra, str(tmp_path / "run" / "tp0" / "ckpt")):
        assert "extra args=Namespace could not be loaded back" in namespace and "vars(args)" in namespace, namespace
        assert "extra schedule=function cannot be saved" in function and "plain values" in function, function
    assert os.listdir(tmp_path) == []


class Counting(torch.nn.Linear):
    """A Linear that counts its forwards in extra state (as an observer, a quantisation scale or a step count
    is kept): in module.state_dict() as "<name>._extra_state"."""

    def __init__(self):
        super().__init__(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        self.calls = state["calls"]


class Scaled(torch.nn.Linear):
    """A Linear whose extra state is an fp16 tensor of a size and value of this rank's."""

    def __init__(self):
        super().__init__(4, 4)
        self.scale = torch.full((dist.get_rank() + 1,), dist.get_rank() + 2.0, dtype=torch.float16)

    def get_extra_state(self):
        return self.scale

    def set_extra_state(self, state):
        self.scale = state


def counting_model():
    counting = Counting()
    return torch.nn.Sequential(counting, counting, Scaled())  # the counter under two names


def on_rank_extra_state(path, stage):
    """Three forwards of a model with extra state, saved; loaded into a fresh one, and into a model without
    it: full_state_dict's entries, the fresh model's after the load, the refusal."""
    torch.manual_seed(0)
    model, opt = zero.initialize(counting_model(), torch.optim.SGD, stage=stage, lr=0.1)
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    full = {k: v for k, v in zero.full_state_dict(model).items() if k.endswith("_extra_state")}
    zero.save_checkpoint(path, model, opt)
    fresh, fresh_opt = zero.initialize(counting_model(), torch.optim.SGD, stage=stage, lr=0.1)
    zero.load_checkpoint(path, fresh, fresh_opt)
    shared = torch.nn.Linear(4, 4)
    plain, plain_opt = zero.initialize(torch.nn.Sequential(shared, shared, torch.nn.Linear(4, 4)),
                                       torch.optim.SGD, stage=stage, lr=0.1)
    with pytest.raises(zero.CheckpointError) as refused:
        zero.load_checkpoint(path, plain, plain_opt)
    return full, (fresh[0].calls, fresh[2].scale), str(refused.value)


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 3])
def test_a_modules_extra_state_is_saved_loaded_and_consolidated(world, tmp_path, stage):
    """A module's get_extra_state() is part of its state_dict: full_state_dict raised TypeError on it (a dict
    is not a tensor), save_checkpoint dropped it and the load left the fresh module's own, and consolidate's
    state_dict failed torch's strict load (a missing key). Now each is rank 0's in all four, whatever it is (a
    tensor's dtype kept), under each name of a module listed twice, and a model without it is refused, naming
    the key."""
    path, rank0 = tmp_path / "ckpt", torch.full((1,), 2.0, dtype=torch.float16)
    for full, (calls, scale), refused in world(2).run(on_rank_extra_state, str(path), stage):
        print("full_state_dict:", full, "| after the load:", calls, scale, "|", refused)
        assert full["0._extra_state"] == full["1._extra_state"] == {"calls": 6} and calls == 6
        assert torch.equal(full["2._extra_state"], rank0) and torch.equal(scale, rank0)
        assert refused.endswith(": another model: 0._extra_state is not in this model; another model: "
                                "1._extra_state is not in this model; another model: 2._extra_state is not in "
                                "this model"), refused
    state = zero.consolidate(path)["model"]
    counting = Counting()
    torch.nn.Sequential(counting, counting, torch.nn.Linear(4, 4)).load_state_dict(state, strict=False)
    assert state["1._extra_state"] == {"calls": 6} and torch.equal(state["2._extra_state"], rank0)
    assert sorted(state) == sorted(f"{i}.{k}" for i in range(3) for k in ("weight", "bias", "_extra_state"))


def on_rank_save_with_extra(path):
    model, opt = zero.initialize(counting_model(), torch.optim.SGD, stage=1, lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    zero.save_checkpoint(path, model, opt, data=torch.arange(1000.0))


def on_rank_load_then_delete(path):
    """Loads, then deletes the checkpoint as a rotation would: the extra state set, the extra returned, and the
    lines of /proc/self/maps that still map one of its files."""
    model, opt = zero.initialize(counting_model(), torch.optim.SGD, stage=1, lr=0.1)
    extra = zero.load_checkpoint(path, model, opt)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)
    dist.barrier()
    with open("/proc/self/maps") as maps:
        mapped = [line.strip() for line in maps if str(path) in line]
    return model[2].scale, extra["data"], mapped


@pytest.mark.xdist_group("world2")
def test_a_checkpoint_saved_on_a_gpu_loads_on_a_cpu_and_holds_no_file_open(world, tmp_path):
    """The rank files' small parts (buffers, extra states, the extra) were torch.load'ed where they were saved: a
    checkpoint saved on a GPU could neither load nor consolidate on a machine without one, and every rank would have
    put rank 0's buffers on rank 0's GPU. They are mapped into CPU memory now. (Simulated: the files rewritten as
    torch.save tags tensors on cuda:0.) What a load gave back was a view of those mapped files, so deleting an old
    checkpoint kept its rank file's pages mapped while the extra lived; now it is copied out."""
    path = tmp_path / "ckpt"
    world(2).run(on_rank_save_with_extra, str(path))
    manifest, tag = json.loads((path / "manifest.json").read_text()), torch.serialization.location_tag
    for name in ["rank0.rest.pt", "rank1.rest.pt", "scalars.pt"]:
        small = torch.load(path / name, weights_only=True)
        torch.serialization.location_tag = lambda storage: "cuda:0"  # as torch.save tags a tensor on cuda:0
        try:
            torch.save(small, path / name)
        finally:
            torch.serialization.location_tag = tag
        with open(path / name, "rb") as f:
            manifest["files"][name] = [os.path.getsize(f.name), hashlib.file_digest(f, "sha256").hexdigest()]
    manifest["sha256"] = zero._manifest_digest(manifest)  # sealed again, as a save writing those files would
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match="CUDA"):  # (what the files hold now, read as torch.load reads them)
        torch.load(path / "rank0.rest.pt", weights_only=True)
    consolidated = zero.consolidate(path)["model"]
    assert torch.equal(consolidated["2._extra_state"], torch.full((1,), 2.0, dtype=torch.float16))
    for rank, (scale, data, mapped) in enumerate(world(2).run(on_rank_load_then_delete, str(path))):
        print(f"rank {rank}: extra state {scale}, extra {data.device} {data.numel()}, still mapped: {mapped}")
        assert torch.equal(scale, torch.full((1,), 2.0, dtype=torch.float16))  # (rank 0's, as saved)
        assert torch.equal(data, torch.arange(1000.0)) and mapped == [], mapped


def on_rank_load_into_counting_model(path, stage):
    model, opt = zero.initialize(counting_model(), torch.optim.SGD, stage=stage, lr=0.1)
    zero.load_checkpoint(path, model, opt)
    return model[0].calls


@pytest.mark.xdist_group("world2")
def test_a_checkpoint_saved_before_extra_states_were_loads_and_keeps_the_models_own(world, tmp_path):
    """A checkpoint whose rank files hold no extra states (saved before zero saved them) loads into a model
    with extra state, which keeps its own, as such a load did then; it is not refused as another model."""
    path = tmp_path / "ckpt"
    world(2).run(on_rank_extra_state, str(path), 1)
    manifest = json.loads((path / "manifest.json").read_text())
    for r in range(2):
        rest = path / f"rank{r}.rest.pt"
        torch.save({k: v for k, v in torch.load(rest, weights_only=True).items() if k != "extra_states"}, rest)
        with open(rest, "rb") as f:
            manifest["files"][rest.name] = [os.path.getsize(f.name), hashlib.file_digest(f, "sha256").hexdigest()]
    manifest["sha256"] = zero._manifest_digest(manifest)  # sealed again, as the older save did
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert world(2).run(on_rank_load_into_counting_model, str(path), 1) == [0, 0]


def on_rank_backward_through_a_graph_saved_before_a_load(path, stage):
    """A step, saved; a forward, a load, then its backward: torch's error (stage None: the plain model and
    load_state_dict), or zero's."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model, opt = (net, torch.optim.SGD(net.parameters(), lr=0.5)) if stage is None else \
        zero.initialize(net, torch.optim.SGD, stage=stage, lr=0.5)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    saved = {k: v.clone() for k, v in net.state_dict().items()} if stage is None else \
        zero.save_checkpoint(path, model, opt)
    loss = model(x).sum()
    if stage is None:
        net.load_state_dict(saved)
    else:
        zero.load_checkpoint(path, model, opt)
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e).partition("[")[0]
    return None


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_backward_through_a_graph_saved_before_a_load_raises_as_torchs_does(world, tmp_path, stage):
    """torch's load_state_dict copies into the parameters, so autograd refuses a backward through a graph saved
    before it; load_checkpoint wrote through zero's buffers, and that backward took the gradient of a forward
    of the old weights at the loaded ones, with no error. It now counts as the same write."""
    want = world(2).run(on_rank_backward_through_a_graph_saved_before_a_load, None, None)
    got = world(2).run(on_rank_backward_through_a_graph_saved_before_a_load, str(tmp_path / "ckpt"), stage)
    print("torch:", want[0], "| zero:", got)
    assert want[0] is not None and "modified by an inplace operation" in want[0]
    assert got == want, got


def on_rank_rng_is_restored(path):
    model, opt = make(3)
    torch.manual_seed(7 + dist.get_rank())
    zero.save_checkpoint(path, model, opt)
    want = torch.rand(3)
    torch.manual_seed(99)
    zero.load_checkpoint(path, model, opt)
    return bool(torch.equal(torch.rand(3), want))


@pytest.mark.xdist_group("world2")
def test_each_rank_gets_its_own_rng_state_back(world, tmp_path):
    assert world(2).run(on_rank_rng_is_restored, str(tmp_path / "ckpt")) == [True, True]


# -----------------------------------------------------------------------------------------
# Reshard: another Nd, stage or bucket size restores the same full state, and trains on
# -----------------------------------------------------------------------------------------
def on_rank_save_full_state(path, stage, bucket_numel, kwargs):
    model, opt = make(stage, bucket_numel, **kwargs)
    train(model, opt, 0, 2)
    zero.save_checkpoint(path, model, opt)
    return full_state(model)


def on_rank_load_full_state(path, stage, bucket_numel, kwargs):
    model, opt = make(stage, bucket_numel, **kwargs)
    zero.load_checkpoint(path, model, opt)
    state = full_state(model)
    losses = train(model, opt, 2, 3)  # training goes on (its bits depend on the new Nd's reduction)
    return state, bool(torch.isfinite(losses[0]))


RESHARD = [(4, 3, 700, 2, 1, 700), (2, 2, 700, 3, 3, 700), (2, 1, 700, 1, 0, 700), (3, 3, 700, 4, 2, 333),
           (1, 0, 5000, 2, 3, 64)]


@pytest.mark.parametrize("save_nd, save_stage, save_bucket, load_nd, load_stage, load_bucket", RESHARD)
def test_reshard_to_another_world_size_and_stage(world, tmp_path, save_nd, save_stage, save_bucket,
                                                  load_nd, load_stage, load_bucket):
    path = str(tmp_path / "ckpt")
    saved = world(save_nd).run(on_rank_save_full_state, path, save_stage, save_bucket, {})[0]
    for state, trained in world(load_nd).run(on_rank_load_full_state, path, load_stage, load_bucket, {}):
        assert differences(saved, state) == [] and trained
    print(f"{save_nd} ranks stage {save_stage} -> {load_nd} ranks stage {load_stage}: {len(saved)} full tensors equal")


# -----------------------------------------------------------------------------------------
# Consolidate: plain torch takes the checkpoint and steps to zero's next bits
# -----------------------------------------------------------------------------------------
def on_rank_zero_next_step(path, stage):
    model, opt = make(stage)
    train(model, opt, 0, 2, clip=False)
    zero.save_checkpoint(path, model, opt)
    train(model, opt, 2, 3, clip=False)
    return zero.full_state_dict(model)


def plain_next_step(path, nd):
    """An unsharded GPT and torch's AdamW from the consolidated checkpoint, one step on the
    batches of nd ranks: each rank's gradient divided by nd, then summed (zero's exact reduction;
    at nd 1-2 every order of the sum gives the same bits), so the bits are zero's."""
    state = zero.consolidate(path, pathlib.Path(path).parent / "plain.pt")
    module = GPT(CONFIG, seed=0)
    module.load_state_dict(state["model"])
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    opt.load_state_dict(state["optimizer"])
    grads = []
    for rank in range(nd):
        g = torch.Generator().manual_seed(10 * 2 + rank)
        x, y = torch.randint(0, 64, (3, 16), generator=g), torch.randint(0, 64, (3, 16), generator=g)
        module.zero_grad()
        module(x, y)[1].backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    for i, p in enumerate(module.parameters()):
        total = grads[0][i] / nd
        for rank in range(1, nd):
            total = total + grads[rank][i] / nd
        p.grad = total
    for group in opt.param_groups:
        group["lr"] = 1e-2 / 3
    opt.step()
    return module.state_dict()


@pytest.mark.parametrize("nd, stage", [pytest.param(1, 3, marks=pytest.mark.xdist_group("world1")),
                                       pytest.param(2, 2, marks=pytest.mark.xdist_group("world2"))])
def test_consolidated_checkpoint_steps_like_zero_in_plain_torch(world, tmp_path, nd, stage):
    path = str(tmp_path / "ckpt")
    want = world(nd).run(on_rank_zero_next_step, path, stage)[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks: a sum's bits depend on how many threads split it
    try:
        got = plain_next_step(path, nd)
    finally:
        torch.set_num_threads(threads)
    assert "lm_head.weight" in zero.consolidate(path)["model"]  # the tied weight under both names
    assert differences(want, {k: v.float() for k, v in got.items()}) == []


class WithAux(torch.nn.Module):
    """A branch an evaluation leaves out, a non-persistent buffer (like a RoPE cache), and a
    persistent one, registered under two names (a state_dict holds both)."""

    def __init__(self):
        super().__init__()
        self.lin, self.aux = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.register_buffer("scale", torch.full((64,), 1 / 3))
        self.lin.register_buffer("scale", self.scale)
        self.register_buffer("cache", torch.arange(64.0), persistent=False)

    def forward(self, x, aux=True):
        x = self.lin(x) * self.scale + self.cache
        return self.aux(x) if aux else x


def on_rank_evaluate_then_load(path, stage):
    torch.manual_seed(0)
    model, opt = zero.initialize(WithAux(), torch.optim.AdamW, stage=stage, lr=torch.tensor(0.01),  # tensor options
                                 betas=(torch.tensor(0.9), torch.tensor(0.999)), foreach=False)
    step = lambda: (model(torch.randn(2, 64)).pow(2).mean().backward(), opt.step(), opt.zero_grad())
    step()
    zero.save_checkpoint(path, model, opt)
    want = zero.full_state_dict(model)
    step()
    held = zero.model_state_bytes(model)
    with torch.no_grad():
        model(torch.randn(2, 64), aux=False)  # stage 3: aux was prefetched, and is not used
    left = zero.model_state_bytes(model) - held
    opt.param_groups[0]["lr"] = torch.tensor(0.5)
    zero.load_checkpoint(path, model, opt)
    plain = WithAux()
    consolidated = zero.consolidate(path)
    plain.load_state_dict(consolidated["model"])  # strict: no non-persistent buffer in it
    with torch.no_grad():  # the loaded weights, not a copy gathered before the load
        same = torch.equal(model(torch.ones(2, 64)), plain(torch.ones(2, 64)))
    options = [{k: g[k] for k in ("lr", "betas")} for g in (opt.param_groups[0], consolidated["optimizer"]["param_groups"][0])]
    return left, same, differences(want, plain.state_dict()), options


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 3])
def test_load_after_an_evaluation_that_skipped_a_module(world, tmp_path, stage):
    for left, same, differ, options in world(2).run(on_rank_evaluate_then_load, str(tmp_path / "ckpt"), stage):
        assert left == 0, f"{left} B still gathered after an evaluation that skipped a module"
        assert differ == [], f"consolidated state differs from the saved model's: {differ}"
        assert same, "the forward after load_checkpoint used other weights than the checkpoint's"
        for where, o in zip(("after load_checkpoint", "consolidated"), options):  # tensors, as given (a float lr
            # would step to other bits than the tensor's)
            assert torch.is_tensor(o["lr"]) and torch.equal(o["lr"], torch.tensor(0.01)), f"lr {where}: {o['lr']!r}"
            assert all(torch.is_tensor(b) for b in o["betas"]), f"betas {where}: {o['betas']!r}"
        assert isinstance(options[0]["betas"], tuple), options[0]["betas"]


def on_rank_keys_per_group(path, stage):
    """Adam with amsgrad=True in one group only: its parameters have max_exp_avg_sq, the others not."""
    module = GPT(CONFIG, seed=1, device="meta")
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    model, opt = zero.initialize(module, torch.optim.Adam, stage=stage, bucket_numel=700, init_fn=module.init_weights,
                                 param_groups=[{"params": decay, "amsgrad": True}, {"params": rest}], lr=1e-2)
    train(model, opt, 0, 1)
    zero.save_checkpoint(path, model, opt)
    zero.load_checkpoint(path, model, opt)
    names = {id(w): opt.names[opt.partition.params[p.index]] for w, p in zip(opt.weights, opt.pieces)}
    loaded = {names[id(w)]: sorted(opt.optim.state[w]) for w in opt.weights if w in opt.optim.state}
    full = {name: sorted(state) for name, state in zero.full_optimizer_state(model).items()}
    order = [n for n, p in model.named_parameters() if p.dim() >= 2] + [n for n, p in model.named_parameters()
                                                                        if p.dim() < 2]
    consolidated = {order[i]: sorted(state) for i, state in zero.consolidate(path)["optimizer"]["state"].items()}
    return loaded, full, consolidated


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 3])
def test_each_parameter_keeps_the_state_keys_of_its_group(world, tmp_path, stage):
    want = lambda name: ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if "weight" in name and "ln" not in name
                                                      else []) + ["step"]
    for loaded, full, consolidated in world(2).run(on_rank_keys_per_group, str(tmp_path / "ckpt"), stage):
        print({name: len(keys) for name, keys in full.items()})
        assert full and all(keys == want(name) for name, keys in full.items()), full
        assert consolidated == full, consolidated
        assert loaded and all(keys == want(name) for name, keys in loaded.items()), loaded


# -----------------------------------------------------------------------------------------
# Refuse what is broken: a clear error, and the live model untouched
# -----------------------------------------------------------------------------------------
def on_rank_scalar_state_bytes():
    """The uint8 elements (pickles) _all_states hands collectives, as save_checkpoint and full_optimizer_state gather
    the scalar states; and the size of one pickle of what it gathered."""
    import torch.distributed.distributed_c10d as c10d  # (dist.all_gather_object calls its all_gather from here)
    model, opt = make(3)
    train(model, opt, 0, 1)
    handed, names = [], ("broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce")
    real = {(m, n): getattr(m, n) for m in (dist, c10d) for n in names}

    def recording(fn):
        def recorded(*args, **kwargs):
            handed.extend(t.numel() for a in list(args) + list(kwargs.values())
                          for t in (a if isinstance(a, list) else [a]) if torch.is_tensor(t) and t.dtype == torch.uint8)
            return fn(*args, **kwargs)
        return recorded

    for (module, name), fn in real.items():
        setattr(module, name, recording(fn))
    try:
        keys, scalars, keys_of = opt._all_states()
    finally:
        for (module, name), fn in real.items():
            setattr(module, name, fn)
    return handed, len(pickle.dumps((scalars, keys_of)))


@pytest.mark.xdist_group("world2")
def test_the_scalar_states_are_gathered_without_padding(world):
    """At stage 3 rank 0 speaks for the first parameters of every unit (those whose first element it holds), so the
    ranks' shares of the scalar states differ in size; each rank receives what they hold together, not Nd times
    the largest share (dist.all_gather_object's padding: 1T at Nd 1024 would receive 123 MiB a rank)."""
    for handed, together in world(2).run(on_rank_scalar_state_bytes):
        print(f"pickles handed to collectives {handed} (elements), one pickle of all of it {together}")
        assert len(handed) == 2 and sum(handed) <= 1.05 * together, (handed, together)


def on_rank_save(path, stage):
    model, opt = make(stage)
    train(model, opt, 0, 1)
    zero.save_checkpoint(path, model, opt)


def on_rank_save_syncing(path, directories_refused=False):
    """The paths save_checkpoint fsyncs, in order (os.fsync recorded through /proc's name of each descriptor);
    directories_refused: fsync of a directory raises EINVAL, as on file systems that cannot sync one."""
    import errno
    synced, fsync = [], os.fsync

    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        if directories_refused and os.path.isdir(synced[-1]):
            raise OSError(errno.EINVAL, "Invalid argument")
        fsync(fd)

    model, opt = make(1)
    train(model, opt, 0, 1)
    os.fsync = recording
    try:
        zero.save_checkpoint(path, model, opt)
    finally:
        os.fsync = fsync
    return synced


@pytest.mark.xdist_group("world1")
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fd through /proc (Linux)")
def test_a_saved_checkpoint_is_on_disk_when_save_returns(world, tmp_path):
    """Every file, the directory's entries, the rename into place and the directories the save made above it
    (train.py's first save into a new --save_dir) are fsynced: a power loss after the return cannot leave a
    checkpoint directory without its manifest or with empty files. Where a file system cannot sync a directory
    (EINVAL), the save goes on."""
    path = tmp_path / "run" / "ckpt"
    synced, = world(1).run(on_rank_save_syncing, str(path))
    print(synced)
    partial = f"{path}.partial"
    files = {f"{partial}/{name}" for name in ["rank0.weights.bin", "rank0.exp_avg.bin", "rank0.exp_avg_sq.bin",
                                              "rank0.rest.pt", "scalars.pt", "manifest.json"]}
    assert files <= set(synced)
    assert synced[-4:] == [f"{partial}/manifest.json", partial, str(path.parent), str(tmp_path)], synced
    assert sorted(os.listdir(path)) == sorted(pathlib.Path(f).name for f in files)
    world(1).run(on_rank_save_syncing, str(tmp_path / "other"), True)
    assert (tmp_path / "other" / "manifest.json").is_file()


def damage(path, how):
    path = pathlib.Path(path)
    target = path / "rank1.weights.bin"
    if how == "truncated":
        target.write_bytes(target.read_bytes()[:-100])
    elif how == "flipped byte":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 1
        target.write_bytes(bytes(data))
    elif how == "missing rank file":
        target.unlink()
    elif how == "missing manifest":
        (path / "manifest.json").unlink()
    elif how == "damaged manifest":  # no longer JSON
        (path / "manifest.json").write_text((path / "manifest.json").read_text()[:-20])
    elif how == "edited manifest":  # JSON still, one digit of an offset changed: its sha256 catches it
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["params"][1]["offset"] += 1
        (path / "manifest.json").write_text(json.dumps(manifest))
    elif how == "another format":
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**manifest, "format": 99}))
    elif how == "unreadable rest file":  # intact by its checksum, but torch.load(weights_only=True) refuses it
        torch.save({"extra": argparse.Namespace(step=1)}, path / "rank1.rest.pt")
        manifest = json.loads((path / "manifest.json").read_text())
        with open(path / "rank1.rest.pt", "rb") as f:
            manifest["files"]["rank1.rest.pt"] = [os.path.getsize(f.name), hashlib.file_digest(f, "sha256").hexdigest()]
        manifest["sha256"] = zero._manifest_digest(manifest)  # sealed again, as a save writing that file would
        (path / "manifest.json").write_text(json.dumps(manifest))
    return str(path)


def on_rank_load_refused(path, make_kwargs):
    model, opt = make(**make_kwargs)
    before = full_state(model)
    try:
        zero.load_checkpoint(path, model, opt)
        return "no error", None
    except zero.CheckpointError as e:
        return str(e), differences(before, full_state(model))


BROKEN = {
    "truncated": ({"stage": 3}, "truncated"), "flipped byte": ({"stage": 3}, "checksum mismatch"),
    "missing rank file": ({"stage": 3}, "missing"), "missing manifest": ({"stage": 3}, "not a checkpoint"),
    "damaged manifest": ({"stage": 3}, "manifest.json cannot be read"),
    "edited manifest": ({"stage": 3}, "manifest.json was changed or damaged"),
    "another format": ({"stage": 3}, "has format 99; this zero.py reads formats 2 and 3: load it with"),
    "another model": ({"stage": 3, "config": GPTConfig(block_size=16, vocab_size=64, n_layer=3, n_head=4,
                                                        n_embd=32)}, "another model: h.2.ln_1.weight"),
    "another dtype": ({"stage": 3, "param_dtype": torch.bfloat16}, "another dtype"),
    "another optimizer": ({"stage": 3, "optimizer": torch.optim.Adam}, "another optimizer: AdamW saved, Adam here: pass"),
    "other param_groups": ({"stage": 3, "groups_swapped": True}, "other param_groups"),
    "unreadable rest file": ({"stage": 3}, "rank1.rest.pt, rank0.rest.pt or scalars.pt cannot be read"),
}


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("how", BROKEN)
def test_broken_checkpoints_are_refused_before_anything_is_loaded(world, tmp_path, how):
    path = str(tmp_path / "ckpt")
    world(2).run(on_rank_save, path, 3)
    make_kwargs, message = BROKEN[how]
    for error, changed in world(2).run(on_rank_load_refused, damage(path, how), make_kwargs):
        print(error)
        assert message in error and changed == []
    if how in ("truncated", "flipped byte", "missing rank file", "another format"):  # consolidate checks them too
        with pytest.raises(zero.CheckpointError) as refused:
            zero.consolidate(path)
        print(refused.value)
        assert message in str(refused.value)


def on_rank_load_where_reading_raises_without_a_message(path):
    def unreadable(self, rank):
        raise EOFError()  # (an unpickler's error with no message)
    rest = zero.CheckpointReader.rest
    if dist.get_rank() == 1:
        zero.CheckpointReader.rest = unreadable
    try:
        return on_rank_load_refused(path, {"stage": 3})
    finally:  # (the ranks live on for the next test)
        zero.CheckpointReader.rest = rest


@pytest.mark.xdist_group("world2")
def test_a_file_that_fails_to_load_without_a_message_is_refused_on_every_rank(world, tmp_path):
    """Rank 1's rest file raises an error with no message as it is read: both ranks refuse the load, naming
    the files (before, rank 1 raised IndexError taking the message's first line, and rank 0 waited for it)."""
    path = str(tmp_path / "ckpt")
    world(2).run(on_rank_save, path, 3)
    for error, changed in world(2).run(on_rank_load_where_reading_raises_without_a_message, path, timeout=60):
        print(error)
        assert "rank1.rest.pt, rank0.rest.pt or scalars.pt cannot be read: EOFError: " in error and changed == []


@pytest.mark.xdist_group("world2")
def test_a_directory_that_is_not_a_checkpoint_is_refused(world, tmp_path):
    (tmp_path / "empty").mkdir()
    for where, why in [("empty", "no manifest.json"), ("nowhere", "does not exist")]:
        for error, changed in world(2).run(on_rank_load_refused, str(tmp_path / where), {"stage": 1}):
            assert why in error and changed == []


def on_rank_save_twice(path):
    model, opt = make(1)
    zero.save_checkpoint(path, model, opt)
    try:
        zero.save_checkpoint(path, model, opt)
        return "no error"
    except FileExistsError as e:
        return str(e)


@pytest.mark.xdist_group("world2")
def test_saving_into_an_existing_checkpoint_is_refused(world, tmp_path):
    path = str(tmp_path / "ckpt")
    for error in world(2).run(on_rank_save_twice, path):
        assert error == f"{path} exists: save each checkpoint into a new directory (e.g. step_000100)", error


def on_rank_another_models_optimizer(path):
    """Two models in one process: each checkpoint call given the other model's optimizer."""
    (model, opt), (other, other_opt) = make(1), make(3)
    errors = []
    for call in (lambda: zero.save_checkpoint(path, model, other_opt),
                 lambda: zero.load_checkpoint(path, model, other_opt)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return errors, os.path.exists(path)


@pytest.mark.xdist_group("world2")
def test_another_models_optimizer_is_refused(world, tmp_path):
    """save_checkpoint and load_checkpoint read the optimizer zero.initialize returned with the
    model: another one passed beside it (a second model's) raises instead of going unnoticed,
    and nothing is written."""
    for errors, written in world(2).run(on_rank_another_models_optimizer, str(tmp_path / "ckpt")):
        assert len(errors) == 2 and all("not the one zero.initialize returned" in e for e in errors), errors
        assert not written


def on_rank_load_with_a_tensor_lr(path):
    """Saved with lr a number, loaded into groups whose lr is a tensor (as for a compiled step):
    the saved value comes back in the live group's form, a tensor of its dtype."""
    model, opt = make(1)
    for group in opt.param_groups:
        group["lr"] = torch.tensor(0.5, dtype=torch.float64)
    zero.load_checkpoint(path, model, opt)
    return [group["lr"] for group in opt.param_groups]


@pytest.mark.xdist_group("world2")
def test_a_number_saved_for_a_tensor_option_loads_as_a_tensor(world, tmp_path):
    path = str(tmp_path / "ckpt")
    world(2).run(on_rank_save, path, 1)  # lr 1e-2 in both groups after step 0
    for lrs in world(2).run(on_rank_load_with_a_tensor_lr, path):
        assert all(torch.equal(lr, torch.tensor(1e-2, dtype=torch.float64)) for lr in lrs), lrs


@pytest.mark.xdist_group("world1")
def test_python_zero_py_consolidate_writes_what_consolidate_returns(world, tmp_path):
    path, out = tmp_path / "ckpt", tmp_path / "plain.pt"
    world(1).run(on_rank_save, str(path), 1)
    run = subprocess.run([sys.executable, "zero.py", "consolidate", str(path), str(out)], capture_output=True,
                         text=True, cwd=pathlib.Path(zero.__file__).parent)
    print(run.stdout, run.stderr)
    assert run.returncode == 0 and run.stdout.startswith(f"wrote {out}"), run.stderr
    got, want = torch.load(out, weights_only=True), zero.consolidate(path)
    assert got["model"].keys() == want["model"].keys()
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    usage = subprocess.run([sys.executable, "zero.py", "consolidate", str(path)], capture_output=True, text=True,
                           cwd=pathlib.Path(zero.__file__).parent)
    assert usage.returncode == 1 and "usage: python zero.py consolidate CHECKPOINT_DIR OUT.pt" in usage.stderr
    # the step directory of a tensor-parallel run holds a checkpoint per slice: the error names one, not a
    # traceback saying the save never completed
    (tmp_path / "step" / "tp0").mkdir(parents=True)
    (tmp_path / "step" / "tp1").mkdir()
    for t in (0, 1):
        (tmp_path / "step" / f"tp{t}" / "manifest.json").write_text((path / "manifest.json").read_text())
    tp = subprocess.run([sys.executable, "zero.py", "consolidate", str(tmp_path / "step"), str(out)],
                        capture_output=True, text=True, cwd=pathlib.Path(zero.__file__).parent)
    print(tp.stderr)
    assert tp.returncode == 1 and tp.stderr == (f"python zero.py consolidate: {tmp_path / 'step'} holds the tensor-"
                                                f"parallel slices ['tp0', 'tp1'], each a checkpoint of its own: give "
                                                f"one, {tmp_path / 'step' / 'tp0'}\n"), tp.stderr


def on_rank_load_another_tp_slice(path):
    """dp 1 x tp 2: each tp rank saves its slice of the model as a checkpoint of its own. The
    slices have the same names and shapes, so only the manifest can tell tp 1's from tp 0's."""
    dp_group, tp_group = make_mesh(dp=1, tp=2)
    tp = dist.get_rank(tp_group)
    module = GPT(CONFIG, tp_group=tp_group, seed=1)
    model, opt = zero.initialize(module, torch.optim.AdamW, stage=1, group=dp_group, tp_group=tp_group, lr=1e-2)
    zero.save_checkpoint(f"{path}/tp{tp}", model, opt)
    dist.barrier()  # both slices saved (each over a dp group of its own)
    before = full_state(model)
    try:
        zero.load_checkpoint(f"{path}/tp{1 - tp}", model, opt)  # the other tp rank's slice
        return "no error", differences(before, full_state(model))
    except zero.CheckpointError as e:
        return str(e), differences(before, full_state(model))


@pytest.mark.xdist_group("world2")
def test_another_tensor_parallel_slice_is_refused(world, tmp_path):
    for tp, (error, changed) in enumerate(world(2).run(on_rank_load_another_tp_slice, str(tmp_path / "ckpt"))):
        assert f"another tensor-parallel slice: saved by tp rank {1 - tp} of 2, this is tp rank {tp}" in error, error
        assert changed == [], changed


def on_rank_save_every_tp_slice_into_one_path(path):
    """dp 1 x tp 2, both tp ranks saving into the same directory: each dp group (one per tp slice)
    ran its own save there, racing: one emptied the other's path.partial, or found the other's
    renamed checkpoint and said 'exists: save each checkpoint into a new directory'."""
    dp_group, tp_group = make_mesh(dp=1, tp=2)
    module = GPT(CONFIG, tp_group=tp_group, seed=1)
    model, opt = zero.initialize(module, torch.optim.AdamW, stage=1, group=dp_group, tp_group=tp_group, lr=1e-2)
    try:
        zero.save_checkpoint(path, model, opt)
        error = "no error"
    except ValueError as e:
        error = str(e)
    dist.barrier()
    return error, os.path.exists(path) or os.path.exists(path + ".partial")


@pytest.mark.xdist_group("world2")
def test_tp_slices_saved_into_one_directory_are_refused(world, tmp_path):
    for error, written in world(2).run(on_rank_save_every_tp_slice_into_one_path, str(tmp_path / "ckpt")):
        assert "every tensor-parallel slice into" in error and "tp{tp_rank}" in error, error
        assert not written


class WithBuffers(torch.nn.Module):
    def __init__(self, count=2, cache=4):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.arange(float(count)))
        self.register_buffer("cache", torch.zeros(cache), persistent=False)  # not in a state_dict


def on_rank_buffers(path, count, cache):
    model, opt = zero.initialize(WithBuffers(), torch.optim.SGD, stage=1, lr=0.1)
    zero.save_checkpoint(path, model, opt)
    torch.manual_seed(1)
    other, opt = zero.initialize(WithBuffers(count, cache), torch.optim.SGD, stage=1, lr=0.1)
    before = full_state(other)
    try:
        zero.load_checkpoint(path, other, opt)
        return "loaded", differences(before, full_state(other))
    except zero.CheckpointError as e:
        return str(e), differences(before, full_state(other))


@pytest.mark.xdist_group("world2")
def test_buffers_are_checked_before_loading_and_a_non_persistent_one_is_left_alone(world, tmp_path):
    for result, changed in world(2).run(on_rank_buffers, str(tmp_path / "a"), 2, 8):  # another cache size
        assert result == "loaded" and changed == ["fc.bias", "fc.weight"], (result, changed)
    for result, changed in world(2).run(on_rank_buffers, str(tmp_path / "b"), 3, 4):
        assert "another model: buffer count is [3] here, [2] saved" in result and changed == [], (result, changed)


def on_rank_save_fails_on_rank_0(path, where):
    model, opt = make(2)
    train(model, opt, 0, 1)
    real = pathlib.Path.write_text
    if where == "manifest" and dist.get_rank() == 0:  # a full disk when the manifest is written
        pathlib.Path.write_text = lambda self, *a, **k: 1 / 0 if self.name == "manifest.json" else real(self, *a, **k)
    try:
        zero.save_checkpoint(path, model, opt)
        return "no error"
    except RuntimeError as e:
        return str(e)
    finally:
        pathlib.Path.write_text = real


@pytest.mark.xdist_group("world2")
def test_a_save_that_fails_on_rank_0_alone_fails_on_every_rank(world, tmp_path):
    """Rank 0 alone makes the directory and writes the manifest: when either fails, every rank
    raises rather than wait for rank 0 in a collective, and no directory the save made is left."""
    (tmp_path / "a_file").write_text("")
    for where, path, why in [("directory", tmp_path / "a_file" / "ckpt", "rank 0: NotADirectoryError"),
                             # a name that fits, with ".partial" one too long: made "deep", then failed
                             ("directory", tmp_path / "deep" / ("x" * 250), "File name too long"),
                             ("manifest", tmp_path / "run" / "ckpt", "rank 0: ZeroDivisionError")]:
        for error in world(2).run(on_rank_save_fails_on_rank_0, str(path), where, timeout=60):
            assert "the checkpoint was not written" in error and why in error, error
        assert not pathlib.Path(f"{path}.partial").exists()  # (every rank's files were in it)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]  # nor the directories made for it ("deep", "run")


def on_rank_checkpoint_calls_out_of_step(path, stage):
    """Rank 1 comes to a save 2 s after rank 0 (check_timeout 1 s): rank 0 is warned, naming the fix, and the
    save goes on. Then rank 0 saves while rank 1 gathers its full state (stage 3: runs a forward): both raise
    at once, where before they waited for the process group's timeout (30 min)."""
    model, opt = make(stage, check_timeout=1)
    train(model, opt, 0, 1)
    if dist.get_rank() == 1:
        time.sleep(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero.save_checkpoint(path, model, opt)
    warned = [str(w.message) for w in caught]
    start = time.perf_counter()
    try:
        if dist.get_rank() == 0:
            zero.save_checkpoint(path + "2", model, opt)
        elif stage == 3:
            model(*batch(1))
        else:
            zero.full_state_dict(model)
        error = None
    except RuntimeError as e:
        error = str(e)
    return warned, error, time.perf_counter() - start, os.path.isdir(path)


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_call_some_ranks_skip_is_named_not_a_silent_wait(world, tmp_path, stage):
    (warned0, error0, seconds0, saved), (warned1, error1, seconds1, _) = world(2).run(
        on_rank_checkpoint_calls_out_of_step, str(tmp_path / "ckpt"), stage)
    print(f"rank 0 warned: {warned0}\nrank 0 after {seconds0:.2f} s: {error0}\nrank 1 after {seconds1:.2f} s: {error1}")
    fix = "zero.save_checkpoint is a collective: call it on every rank at the same point"
    assert saved and warned1 == [] and len(warned0) == 1, (warned0, warned1)
    assert "rank 0 calls zero.save_checkpoint, but not every rank came to a stage-3 gather or a zero collective " \
           "call within 1 s" in warned0[0], warned0
    assert "only late, after work of its own, needs no change" in warned0[0], warned0
    assert fix in warned0[0] and "not under `if rank == 0:`" in warned0[0], warned0
    other = "gathers parameters (stage 3" if stage == 3 else "calls zero.full_state_dict"
    assert f"rank 0 calls zero.save_checkpoint while another rank {other}" in error0 and fix in error0, error0
    if stage == 3:
        assert "stage 3: rank 1 gathers wte while another rank calls zero.save_checkpoint" in error1, error1
    else:
        assert "rank 1 calls zero.full_state_dict while another rank calls zero.save_checkpoint" in error1, error1
    assert fix.replace("save_checkpoint", "save_checkpoint" if stage == 3 else "full_state_dict") in error1, error1
    assert seconds0 < 1 and seconds1 < 1, (seconds0, seconds1)


def on_rank_one_rank_refuses(path, stage, tp):
    """Each collective call refused by rank 1 alone: a weight given storage outside zero's buffers (save_checkpoint,
    full_state_dict), a checkpoint missing from its disk (load_checkpoint); at stage 3, a save into a path that
    exists while rank 0 runs a forward. Rank 1 raises its own error; every other rank at once too (at tp 2 those
    of the other dp group, through the tp group), where before they went on into the call's first collective and
    waited for rank 1 until the process group's timeout (30 min on gloo). Returns (call, error, seconds) per call."""
    dp_group, tp_group = make_mesh(dp=dist.get_world_size() // tp, tp=tp)

    def make_here():
        module = GPT(CONFIG, tp_group=tp_group, seed=1, device="meta")
        return zero.initialize(module, torch.optim.AdamW, stage=stage, bucket_numel=700, group=dp_group,
                               tp_group=tp_group, stage3_units=module.h, init_fn=module.init_weights, lr=1e-2)
    path = f"{path}/tp{dist.get_rank(tp_group)}"
    model, opt = make_here()
    train(model, opt, 0, 1)
    zero.save_checkpoint(path, model, opt)
    one = dist.get_rank() == 1
    cases = [("save_checkpoint", lambda m, o: zero.save_checkpoint(path + "2", m, o)),
             ("full_state_dict", lambda m, o: zero.full_state_dict(m)),
             ("load_checkpoint", lambda m, o: zero.load_checkpoint(path + "_not_on_this_disk" if one else path, m, o))]
    if stage == 3 and tp == 1:
        cases.append(("a forward", lambda m, o: zero.save_checkpoint(path, m, o) if one else m(*batch(1))))
    results = []
    for name, call in cases:
        model, opt = make_here()
        if one and name in ("save_checkpoint", "full_state_dict"):
            model.wte.weight.data = model.wte.weight.detach().clone()  # (the step would not update it)
        start = time.perf_counter()
        try:
            call(model, opt)
            results.append((name, None, time.perf_counter() - start))
        except Exception as e:
            results.append((name, f"{type(e).__name__}: {e}", time.perf_counter() - start))
    return results


@pytest.mark.parametrize("stage, tp", [(1, 1), (3, 1), (1, 2)], ids=["stage1", "stage3", "stage1-dp2xtp2"])
def test_a_collective_call_one_rank_refuses_raises_on_every_rank(world, tmp_path, stage, tp):
    ranks = world(2 * tp).run(on_rank_one_rank_refuses, str(tmp_path / "ckpt"), stage, tp, timeout=120)
    fix = "zero.save_checkpoint is a collective: call it on every rank at the same point (each rank holds its own shard)"
    for cases in zip(*ranks):
        for rank, (name, error, seconds) in enumerate(cases):
            print(f"{name}: rank {rank} after {seconds:.2f} s: {error}")
            dp_rank = rank // tp  # (the rank zero's errors name: tp groups are consecutive ranks)
            if rank == 1:
                own = {"load_checkpoint": "CheckpointError: ", "a forward": "FileExistsError: "}.get(
                    name, f"RuntimeError: rank {dp_rank}: ['wte.weight'] got storage outside zero's buffers")
                assert error is not None and error.startswith(own), error
            elif name == "a forward":
                assert error == "RuntimeError: stage 3: rank 0 gathers wte while another rank refused " \
                                f"zero.save_checkpoint (its own error says why): {fix}, not under `if rank == 0:`", error
            else:
                assert error == f"RuntimeError: rank {dp_rank} calls zero.{name}, which another rank refused (its " \
                                f"own error says why), so no rank went on", error
            assert seconds < 1, seconds
    assert not list(tmp_path.glob("ckpt/*2*")), list(tmp_path.glob("ckpt/*"))


def on_rank_pending_gradients(path):
    model, opt = make(1)
    train(model, opt, 0, 1)
    zero.save_checkpoint(path, model, opt)
    x, y = batch(1)
    opt.backward(model(x, y)[1])  # a micro-batch: its gradients are in no checkpoint
    fix = "call it after optimizer.step() or optimizer.zero_grad()"
    return helpers.missed_errors({f"save_checkpoint after a backward whose gradients no step has used: they are not "
                                  f"saved; {fix}": lambda: zero.save_checkpoint(path + "2", model, opt),
                                  f"load_checkpoint after a backward whose gradients no step has used": lambda:
                                  zero.load_checkpoint(path, model, opt)}, (RuntimeError,))


@pytest.mark.xdist_group("world2")
def test_save_and_load_between_micro_batches_name_the_fix(world, tmp_path):
    assert world(2).run(on_rank_pending_gradients, str(tmp_path / "ckpt")) == [[], []]


def on_rank_format_2_still_loads(path):
    """A checkpoint in format 2, whose shard files were torch.save'd tensors, made here from a
    format-3 one (raw elements): it loads, and the full state is the saved one, bit for bit."""
    model, opt = make(1)
    train(model, opt, 0, 1)
    zero.save_checkpoint(path, model, opt)
    want = full_state(model)
    directory = pathlib.Path(path)
    if dist.get_rank() == 0:
        manifest = json.loads((directory / "manifest.json").read_text())
        for name in [n for n in manifest["files"] if n.endswith(".bin")]:
            raw = (directory / name).read_bytes()
            old = name.removesuffix(".bin") + ".pt"
            torch.save(torch.frombuffer(bytearray(raw), dtype=getattr(torch, manifest["dtype"])), directory / old)
            (directory / name).unlink()
            del manifest["files"][name]
            manifest["files"][old] = [os.path.getsize(directory / old),
                                      hashlib.sha256((directory / old).read_bytes()).hexdigest()]
        manifest["format"] = 2
        del manifest["sha256"]  # (format 2 had no digest of the manifest)
        (directory / "manifest.json").write_text(json.dumps(manifest))
    dist.barrier()
    train(model, opt, 1, 2)  # away from the saved state
    zero.load_checkpoint(path, model, opt)
    return differences(want, full_state(model)), sorted(os.listdir(directory))


@pytest.mark.xdist_group("world2")
def test_a_format_2_checkpoint_still_loads(world, tmp_path):
    for differing, files in world(2).run(on_rank_format_2_still_loads, str(tmp_path / "ckpt")):
        assert differing == [] and "rank1.weights.pt" in files, (differing, files)


def on_rank_crash_while_saving(path, new_path):
    model, opt = make(2)
    train(model, opt, 0, 1)
    zero.save_checkpoint(path, model, opt)
    want = full_state(model)
    train(model, opt, 1, 2)
    real_raw, calls = zero._raw, []

    def failing_raw(t):  # rank 1's writer fails at its third chunk, in the middle of a shard file
        calls.append(t.numel())
        return real_raw(t) if len(calls) < 3 else 1 / 0

    if dist.get_rank() == 1:
        zero._raw = failing_raw
    try:
        zero.save_checkpoint(new_path, model, opt)
        crashed = "no error"
    except RuntimeError as e:
        crashed = str(e)
    finally:
        zero._raw = real_raw
    try:
        zero.load_checkpoint(new_path, model, opt)
        refused = "loaded"
    except zero.CheckpointError as e:
        refused = str(e)
    dist.barrier()
    partial_left = os.path.exists(new_path + ".partial")  # the failed save removed what it wrote
    dist.barrier()  # (every rank has looked before rank 0 makes one below)
    if dist.get_rank() == 0:  # a directory a killed save at more ranks left there
        os.mkdir(new_path + ".partial")
        (pathlib.Path(new_path + ".partial") / "rank2.weights.bin").write_bytes(b"stale")
    dist.barrier()
    zero.save_checkpoint(new_path, model, opt)  # saved again: the directory holds this save's files only
    manifest = json.loads((pathlib.Path(new_path) / "manifest.json").read_text())
    extra = sorted(set(os.listdir(new_path)) - set(manifest["files"]) - {"manifest.json"})
    zero.load_checkpoint(path, model, opt)
    return crashed, refused, partial_left, differences(want, full_state(model)), extra


@pytest.mark.xdist_group("world2")
def test_a_crash_while_saving_leaves_the_previous_checkpoint_loadable(world, tmp_path):
    for crashed, refused, partial_left, differing, extra in world(2).run(
            on_rank_crash_while_saving, str(tmp_path / "old"), str(tmp_path / "new")):
        assert "rank 1: ZeroDivisionError" in crashed, crashed
        assert "does not exist" in refused and not partial_left, (refused, partial_left)
        assert differing == [] and extra == [], (differing, extra)
    assert sorted(os.listdir(tmp_path)) == ["new", "old"]  # the retry's new.partial became new


SMALL = 64  # bytes: see test_saving_and_loading_hold_the_model_states_and_one_bucket_chunk


def on_rank_memory_while_saving_and_loading(path):
    """Live bytes sampled at every chunk written and every range read, beyond what was alive
    before the model was built; the rank's model states, the largest bucket chunk and its shard."""
    before, sizes = zero.live_storages(), {}  # sizes: a reading's total -> its largest new storages

    def new_storages():  # memory-mapped checkpoint files are the page cache's, not this process's memory
        maps = [line.split() for line in open("/proc/self/maps")]
        mapped = [[int(a, 16) for a in m[0].split("-")] for m in maps if len(m) > 5 and m[5].startswith(path)]
        return sorted((s.nbytes() for k, s in zero.live_storages().items()
                       if k not in before and not any(lo <= s.data_ptr() < hi for lo, hi in mapped)), reverse=True)

    def reading():
        new = new_storages()
        sizes[sum(new)] = new[:8]  # for the failure's message
        return sum(new)

    def new_bytes():  # (settled: gloo's worker thread lets go of a collective's tensors after it completes)
        return settled(reading, readings=2, interval=0.002)

    model, opt = make(3, 4096)
    train(model, opt, 0, 1)
    held, samples = new_bytes(), []
    real_raw, real_read = zero._raw, zero.CheckpointReader.read

    def sampled_raw(t):
        samples.append(new_bytes())  # with the chunk about to be written
        return real_raw(t)

    zero._raw = sampled_raw
    try:
        zero.save_checkpoint(path, model, opt)
    finally:
        zero._raw = real_raw
    save_peak = max(samples)
    samples.clear()

    def sampled_read(self, *args):
        real_read(self, *args)
        samples.append(new_bytes())  # with the range just read

    zero.CheckpointReader.read = sampled_read
    try:
        zero.load_checkpoint(path, model, opt)
    finally:
        zero.CheckpointReader.read = real_read
    chunk = max(b.chunk for b in opt.partition.buckets) * 4
    steps = 4 * len(list(model.parameters()))  # the other rank's AdamW step counters, gathered to save them
    return held, save_peak, max(samples), zero.model_state_bytes(model), chunk + steps, opt.partition.shard_numel * 4, \
        (sizes[held], sizes[save_peak], sizes[max(samples)])


@pytest.mark.slow  # every live tensor walked at every chunk written and range read: about 2 minutes on 2 cores
@pytest.mark.xdist_group("world2")
def test_saving_and_loading_hold_the_model_states_and_one_bucket_chunk(world, tmp_path):
    """Saving makes each chunk of a rank's file on its own; loading reads straight into the
    weights and into each optimizer state, the old one freed first: neither holds a shard more.
    SMALL allows a few bytes of small tensors made outside zero.py while a sample walks the live
    tensors (once, in the full suite, loading sampled +10 B; alone it is +0 B), far below a chunk.
    A sample is taken once two readings agree (ranks.settled: gloo's worker thread lets go of a
    collective's tensors a moment after it completes); unsettled, saving once sampled +5338 B
    more, in the full suite only. A storage that stays is still counted."""
    for held, save_peak, load_peak, states, chunk, shard, largest in world(2).run(
            on_rank_memory_while_saving_and_loading, str(tmp_path / "ckpt")):
        print(f"held {held} B (model states {states} B); saving peaks at +{save_peak - held} B, loading at "
              f"+{load_peak - held} B; one bucket's chunk and the step counters are {chunk} B, one shard {shard} B")
        assert save_peak <= held + chunk + SMALL and load_peak <= held + SMALL, \
            (save_peak - held, load_peak - held, "largest new storages, held / saving / loading:", largest)
        assert SMALL < chunk < shard


class FineTuned(torch.nn.Module):
    """A frozen body and a small trainable head: the optimizer holds state for the head alone."""

    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
        self.body.requires_grad_(False)

    def forward(self, x):
        return self.head(self.body(x))


def on_rank_state_bytes_across_a_load(path, stage):
    torch.manual_seed(0)
    model, opt = zero.initialize(FineTuned(), torch.optim.AdamW, stage=stage, lr=1e-2, bucket_numel=1024)

    def step(i):
        model(torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * i + dist.get_rank()))).square().mean() \
            .backward()
        opt.step()
        opt.zero_grad()

    step(0)
    before, optimizer_state = zero.model_state_bytes(model), zero.full_optimizer_state(model)
    zero.save_checkpoint(path, model, opt)
    zero.load_checkpoint(path, model, opt)
    loaded, loaded_state = zero.model_state_bytes(model), zero.full_optimizer_state(model)
    step(1)
    same = all(torch.equal(loaded_state[n][k], v) for n, s in optimizer_state.items() for k, v in s.items()
               if torch.is_tensor(v))
    return before, loaded, zero.model_state_bytes(model), sorted(loaded_state) == ["head.bias", "head.weight"], same


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_load_holds_optimizer_state_for_the_trainable_pieces_alone(world, tmp_path, stage):
    """The frozen body (4,160 of 4,420 parameters) has no optimizer state: after load_checkpoint
    the rank holds the bytes it held before saving (an exp_avg and exp_avg_sq per trainable
    piece, not one per key over the whole shard, frozen chunks included), and again after a step."""
    for before, loaded, stepped, keys, same in world(2).run(on_rank_state_bytes_across_a_load,
                                                             str(tmp_path / "ckpt"), stage):
        print(f"stage {stage}: model states {before} B before saving, {loaded} B after loading, "
              f"{stepped} B a step later")
        assert before == loaded == stepped and keys and same, (before, loaded, stepped, keys, same)


def on_rank_load_into_a_model_frozen_at_initialize(path, stage):
    """Saved with every parameter trainable; loaded where ln_f is frozen at zero.initialize, which lays
    out no optimizer state for it."""
    model, opt = make(stage)
    train(model, opt, 0, 1)
    zero.save_checkpoint(path, model, opt)
    module = GPT(CONFIG, seed=2, device="meta")
    module.ln_f.requires_grad_(False)
    model, opt = zero.initialize(module, torch.optim.AdamW, stage=stage, bucket_numel=700, stage3_units=module.h,
                                 param_groups=decay_groups(module), init_fn=module.init_weights, lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero.load_checkpoint(path, model, opt)
    return [str(w.message) for w in caught], sorted(zero.full_optimizer_state(model))


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("stage", [1, 3])
def test_a_load_that_drops_a_frozen_parameters_state_says_so(world, tmp_path, stage):
    """torch keeps a frozen parameter's state through load_state_dict; zero keeps none for one frozen at
    zero.initialize, and the load dropped it without a word (a later unfrozen run restarted its moments)."""
    for messages, with_state in world(2).run(on_rank_load_into_a_model_frozen_at_initialize,
                                             str(tmp_path / "ckpt"), stage):
        print(messages)
        assert any("['ln_f.weight', 'ln_f.bias'] (2 parameter(s)) have optimizer state" in m and
                   "freeze them after zero.initialize" in m for m in messages), messages
        assert "ln_f.weight" not in with_state and "h.0.attn.c_attn.weight" in with_state, with_state


class Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight, the tie made from either side."""

    def __init__(self, emb_first, tied=True):
        super().__init__()
        if emb_first:
            self.emb, self.head = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False)
            if tied:
                self.head.weight = self.emb.weight
        else:
            self.head, self.emb = torch.nn.Linear(4, 5, bias=False), torch.nn.Embedding(5, 4)
            self.emb.weight = self.head.weight


def on_rank_load_a_tie_made_the_other_way(path):
    zero.save_checkpoint(path, *zero.initialize(Tied(emb_first=True), torch.optim.SGD, stage=1, lr=0.1))
    model, opt = zero.initialize(Tied(emb_first=False), torch.optim.SGD, stage=1, lr=0.1)
    try:
        zero.load_checkpoint(path, model, opt)
    except zero.CheckpointError as e:
        return str(e)


def on_rank_load_across_a_tie(path, saved_tied):
    zero.save_checkpoint(path, *zero.initialize(Tied(True, saved_tied), torch.optim.SGD, stage=1, lr=0.1))
    model, opt = zero.initialize(Tied(True, not saved_tied), torch.optim.SGD, stage=1, lr=0.1)
    try:
        zero.load_checkpoint(path, model, opt)
    except zero.CheckpointError as e:
        return str(e)


@pytest.mark.xdist_group("world1")
@pytest.mark.parametrize("saved_tied", [True, False], ids=["saved-tied", "saved-untied"])
def test_a_tie_the_checkpoint_does_not_have_is_named(world, tmp_path, saved_tied):
    """Saved tied and loaded untied, the load said the param_groups differed ("build the groups as they were
    saved", which they were); saved untied and loaded tied, that the weight was "tied the other way" (it was not
    tied at all) and to register its module first."""
    error, = world(1).run(on_rank_load_across_a_tie, str(tmp_path / "ckpt"), saved_tied)
    print(error)
    where = "in the checkpoint, a weight of its own here" if saved_tied else \
        "here, a weight of its own in the checkpoint"
    assert error and f"another model: head.weight is tied to emb.weight {where}" in error, error
    assert "other way" not in error, error


@pytest.mark.xdist_group("world1")
def test_a_tie_made_the_other_way_is_named_as_such(world, tmp_path):
    """The checkpoint lists the tied weight as emb.weight (head.weight its second name), the model as head.weight:
    the load said emb.weight "is not in this model" and head.weight "is not in the checkpoint", both untrue."""
    error, = world(1).run(on_rank_load_a_tie_made_the_other_way, str(tmp_path / "ckpt"))
    print(error)
    assert error and "a weight tied the other way: emb.weight is saved first, here a second name of head.weight: " \
                     "register emb.weight's module first" in error and "not in" not in error, error
