"""ZeRO-DP in one file: stages 0-3 of "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (Rajbhandari, Rasley, Ruwase, He; SC 2020), on torch.distributed.

    import zero
    model, optimizer = zero.initialize(module, torch.optim.AdamW, stage=2, lr=3e-4, weight_decay=0.1)
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
    state = zero.full_state_dict(model)   # {name: full fp32 tensor}, identical on every rank

    stage 0  baseline data parallelism: everything replicated           (4 + 4 + K)Ψ per rank
    stage 1  P_os:     optimizer states partitioned                     4Ψ + 4Ψ + KΨ/Nd
    stage 2  P_os+g:   ... and gradients                                4Ψ + (4 + K)Ψ/Nd
    stage 3  P_os+g+p: ... and parameters                               (4 + 4 + K)Ψ/Nd
    (fp32 parameters and gradients here; the paper's 2Ψ terms are its fp16 copies)

Every stage gives the same bits as torch's DistributedDataParallel: gradients are summed in
rank order, ((g_0 + g_1) + g_2) + ..., then divided by Nd, whatever the bucket sizes or the
stage (test_zero.py proves it). Run the tests with `python -m pytest -n 2 test_zero.py`.
"""
import collections
import functools
import gc
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.autograd import Variable
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

# Optimizers whose update of an element reads only that element's parameter, gradient and
# state: sharding them across ranks gives the same bits as running them whole. (Not so LBFGS,
# SparseAdam, Adafactor or Muon, whose updates mix elements.)
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                          torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)

DEFAULT_BUCKET_NUMEL = 2**22  # elements per gradient bucket (16 MB in fp32)


def _overlap(a, b, c, d):
    """Length of the intersection of the ranges [a, b) and [c, d)."""
    return max(0, min(b, d) - max(a, c))


# -----------------------------------------------------------------------------------------
# Section 3 -- where the memory goes: model states (parameters, gradients, optimizer states)
# and residual states (activations, temporary buffers, fragmentation). MemoryHooks records
# memory at every module boundary: from the caching allocator on CUDA; on CPU, where
# torch.cuda.memory_allocated() is always 0, from the bytes of the tensors alive.
# -----------------------------------------------------------------------------------------
def live_storages(device_type="cpu"):
    """{storage id: storage} of every tensor storage alive on `device_type` (and of every
    .grad), each storage once. Keyed by the storage itself: data_ptr() is 0 on the meta device
    and raises for a storage freed with resize_(0). Holding the result keeps them alive. A
    wrapper subclass (a DTensor) is skipped: its storage claims the global size and holds no
    data; the local tensor inside it is counted. Tensors C++ keeps to itself are not seen."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading .grad of a non-leaf warns
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == device_type \
                    and not is_traceable_wrapper_subclass(obj):
                for t in (obj, obj.grad):
                    if t is not None:
                        storages[t.untyped_storage()._cdata] = t.untyped_storage()
    return storages


def live_tensor_bytes(device_type="cpu"):
    """Bytes of every tensor storage alive in this process on `device_type`, each once."""
    return sum(s.nbytes() for s in live_storages(device_type).values())


class MemoryHooks:
    """records: (phase, module name, allocated, reserved) at each module's forward start and
    end and backward start (every_module=False: the root's only), while `recording` is True.
    On CPU each record walks every live tensor, a fraction of a second: record a few steps,
    not all. On CUDA it reads the allocator, and reserved - allocated is the fragmentation
    M_D fights; torch.cuda.max_memory_allocated() also sees between the boundaries."""

    def __init__(self, module, every_module=True):
        self.records, self.recording = [], False
        for name, m in module.named_modules() if every_module else [("", module)]:
            m.register_forward_pre_hook(lambda mod, args, name=name: self.record("forward start", name))
            m.register_forward_hook(lambda mod, args, out, name=name: self._forward_end(name, out))

    def _forward_end(self, name, out):
        self.record("forward end", name)
        if self.recording and torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                tensors[0].register_hook(lambda grad: self.record("backward start", name))

    def record(self, phase, name):
        if not self.recording:
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        else:
            allocated = reserved = live_tensor_bytes()
        self.records.append((phase, name, allocated, reserved))

    def peak(self):
        return max((r[2] for r in self.records), default=0)

    def kept_by_forward(self, name=""):
        """Bytes the first recorded forward of module `name` (default: the root) kept for its
        backward: allocated at the forward's end minus at its start."""
        start, end = [next(r[2] for r in self.records if r[:2] == (phase, name))
                      for phase in ("forward start", "forward end")]
        return end - start


@dataclass
class DynamicLossScale:
    """fp16's dynamic loss scaling (Micikevicius et al. 2018, as torch's GradScaler): the loss is
    multiplied by `scale` before backward; a step whose gradients overflow (inf or nan on any
    rank) is skipped and the scale multiplied by backoff_factor (not below min_scale); after
    growth_interval clean steps it is multiplied by growth_factor."""
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0


class ZeroOptimizer:
    """The optimizer a user steps, and the ZeRO-DP machinery behind it, for one module.

    The paper's state lives here: the flat parameter space and its partition (Section 5), this
    rank's optimizer over its partition (5.1, P_os), the gradient buckets reduced in backward
    (5.2, P_os+g) and the parameter gathers around each module (5.3, P_os+g+p).
    """

    # -------------------------------------------------------------------------------------
    # Section 5 -- one flat parameter space, partitioned evenly across the Nd ranks.
    # Parameters are laid end to end (trainable ones first, in module order; a tied weight
    # once); the space is padded to a multiple of Nd and rank r owns elements
    # [r * shard_numel, (r + 1) * shard_numel). A parameter may straddle two ranks.
    # -------------------------------------------------------------------------------------
    def __init__(self, module, optimizer_class, stage, group, param_groups, bucket_numel,
                 param_dtype, reduce_dtype, loss_scale, stage3_units, prefetch, optimizer_kwargs):
        self.module, self.stage, self.group, self.prefetch = module, stage, group, prefetch
        self.nd, self.rank = dist.get_world_size(group), dist.get_rank(group)
        params = list(module.parameters())  # unique: a tied weight is listed once
        self.params = [p for p in params if p.requires_grad] + [p for p in params if not p.requires_grad]
        self.n_trainable = sum(p.requires_grad for p in params)
        self.index = {p: i for i, p in enumerate(self.params)}
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.psi = self.offsets[-1]  # Ψ
        self.psi_trainable = self.offsets[self.n_trainable]
        self.shard_numel = math.ceil(self.psi / self.nd)
        self.padded_numel = self.shard_numel * self.nd
        self.lo, self.hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        self.device = params[0].device
        # small flags (which parameters were used, overflow) must be readable: on the CPU when the
        # model is on the meta device (memory_table.py simulates the paper's sizes that way)
        self.flag_device = torch.device("cpu") if self.device.type == "meta" else self.device

        # Mixed precision (Section 3.1): the model computes in param_dtype; with a 16-bit
        # param_dtype the optimizer updates an fp32 master copy of its partition, so K = 12
        # (master 4 + momentum 4 + variance 4 bytes). Gradients are reduced in reduce_dtype.
        self.param_dtype = param_dtype or params[0].dtype
        self.master_dtype = torch.float32 if self.param_dtype in (torch.float16, torch.bfloat16) else None
        self.reduce_dtype = reduce_dtype or self.param_dtype
        for b in module.buffers():
            if b.is_floating_point():
                b.data = b.data.to(self.param_dtype)

        # Every rank starts from rank 0's weights, as DDP does.
        flat = torch.zeros(self.padded_numel, dtype=params[0].dtype, device=self.device)
        for i, p in enumerate(self.params):
            flat[self.offsets[i]:self.offsets[i + 1]].copy_(p.detach().view(-1))
        dist.broadcast(flat, group_src=0, group=group)  # (padded_numel,) from rank 0
        # The range this rank updates: stage 0 updates everything (the baseline), stages 1-3
        # their own shard. Its buffers (master weights, reduced gradients) start at `base`.
        self.base, self.own_numel = (0, self.padded_numel) if stage == 0 else (self.lo, self.shard_numel)
        if self.master_dtype:
            self.master = flat[self.base:self.base + self.own_numel].to(self.master_dtype, copy=True)
        if stage < 3:
            # Stages 0-2 keep every parameter: each is a view into one flat buffer.
            self.flat_param = flat.to(self.param_dtype)
            for i, p in enumerate(self.params):
                p.data = self.flat_param[self.offsets[i]:self.offsets[i + 1]].view_as(p)
            self.own_params = self.flat_param[self.base:self.base + self.own_numel]
        else:
            # Stage 3 keeps only this rank's shard; the parameters become views into buffers
            # that are empty between uses (Section 5.3, _install_gather_hooks).
            self.param_shard = flat[self.lo:self.hi].to(self.param_dtype, copy=True)  # (shard_numel,)
            self.own_params = self.param_shard
        del flat

        # ---------------------------------------------------------------------------------
        # Section 5.1 -- P_os: the optimizer updates only this rank's partition.
        # The user's optimizer class runs over "pieces": the part of each trainable parameter
        # that falls inside the owned range, as 1-D views into the fp32 master copy (or, in
        # fp32, into the parameters themselves). Per-rank optimizer states: KΨ/Nd.
        # ---------------------------------------------------------------------------------
        weights = self.master if self.master_dtype else self.own_params
        self.pieces = []  # (piece, parameter index, flat start, flat end)
        for i in range(self.n_trainable):
            a = max(self.offsets[i], self.base)
            b = min(self.offsets[i + 1], self.base + self.own_numel)
            if a < b:
                self.pieces.append((weights[a - self.base:b - self.base], i, a, b))
        groups = param_groups if param_groups is not None else [{"params": list(module.parameters())}]
        piece_groups = []
        for g in groups:
            members = {self.index[p] for p in g["params"]}
            piece_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                 "params": [piece for piece, i, a, b in self.pieces if i in members]})
        self.optim = optimizer_class(piece_groups, **optimizer_kwargs)
        if loss_scale is None and self.param_dtype == torch.float16:
            loss_scale = DynamicLossScale()
        self.scaler = DynamicLossScale(init_scale=loss_scale, growth_interval=2**62) \
            if isinstance(loss_scale, (int, float)) else loss_scale  # a number: a static scale
        self.loss_scale = self.scaler.init_scale if self.scaler else 1.0
        self.clean_steps = 0

        # ---------------------------------------------------------------------------------
        # Section 5.2 -- P_os+g: gradient buckets, reduced during backward.
        # The trainable part of the flat space, [0, psi_trainable), is cut into buckets of
        # bucket_numel elements. A bucket is reduced once every parameter in it has its
        # gradient; buckets are reduced last to first (the order backward produces them), the
        # same order on every rank. Stages 0-1 keep a full gradient buffer (4Ψ in fp32; the
        # reduced shard is written back into it); stages 2-3 keep only the reduced shard
        # (4Ψ/Nd) and a bucket's buffer lives only until it is reduced.
        # ---------------------------------------------------------------------------------
        self.bucket_numel = bucket_numel
        self.n_buckets = math.ceil(self.psi_trainable / bucket_numel)
        self.buckets_of = [range(self.offsets[i] // bucket_numel, (self.offsets[i + 1] - 1) // bucket_numel + 1)
                           if self.params[i].numel() else range(0) for i in range(self.n_trainable)]
        self.params_in_bucket = [0] * self.n_buckets
        for i in range(self.n_trainable):
            for k in self.buckets_of[i]:
                self.params_in_bucket[k] += 1
        if stage < 2:
            self.flat_grad = torch.zeros(self.padded_numel, dtype=self.param_dtype, device=self.device)
        self.shard_in_flat_grad = stage < 2 and self.reduce_dtype == self.param_dtype
        if not self.shard_in_flat_grad:
            self.grad_shard = torch.zeros(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
        for i in range(self.n_trainable):
            self.params[i].register_post_accumulate_grad_hook(self._grad_ready)

        self.param_gathers = []  # stages 1-2: (flat start, work) of the broadcasts step() left in flight
        if stage in (1, 2):
            self._install_wait_hooks()
        if stage == 3:
            self._install_gather_hooks(stage3_units or ())
        self.buffers = [b for b in module.buffers()]
        if self.buffers and self.nd > 1:
            module.register_forward_pre_hook(self._broadcast_buffers)
        self.zero_grad()

    # -------------------------------------------------------------------------------------
    # Section 5.2 (cont.) -- the reduction, in rank order.
    # A bucket [a, b) holds for each rank j the part that falls in j's shard. all_to_all
    # sends rank j its part from every rank; each rank then folds what it received in rank
    # order, ((g_0 + g_1) + g_2) + ..., and divides by Nd: a reduce-scatter whose bits do not
    # depend on bucket sizes, padding or stage. Each rank sends (Nd-1)/Nd of the bucket, as
    # in a ring reduce-scatter: Ψ over all buckets (Section 7.1). Micro-batches: each
    # backward is reduced on its own and added to the shard, in order.
    # -------------------------------------------------------------------------------------
    def _bucket(self, k):
        a, b = k * self.bucket_numel, min((k + 1) * self.bucket_numel, self.psi_trainable)
        if self.stage < 2:
            return self.flat_grad[a:b]
        if k not in self.bucket_bufs:  # empty: every element is written (a gradient, or zeros if unused)
            self.bucket_bufs[k] = torch.empty(b - a, dtype=self.reduce_dtype, device=self.device)
        return self.bucket_bufs[k]

    def _reduce_bucket(self, k):
        a, b = k * self.bucket_numel, min((k + 1) * self.bucket_numel, self.psi_trainable)
        bucket = self._bucket(k).to(self.reduce_dtype)
        self.bucket_bufs.pop(k, None)
        splits = [_overlap(a, b, j * self.shard_numel, (j + 1) * self.shard_numel) for j in range(self.nd)]
        mine = splits[self.rank]
        received = bucket.new_empty(self.nd * mine)
        # all-to-all: bucket (b - a,) split by owner -> received (nd * mine,), row j from rank j.
        # Before: it blocked backward until done; now backward goes on computing the next
        # bucket's gradients while this one is exchanged, and it is folded when the next bucket
        # is issued (or at the end of backward): one in flight while backward computes.
        work = dist.all_to_all_single(received, bucket, [mine] * self.nd, splits, group=self.group, async_op=True)
        self.in_reduction.append((work, bucket, received.view(self.nd, mine), max(a, self.lo) - self.lo))
        while len(self.in_reduction) > 1:
            self._fold(*self.in_reduction.pop(0))

    def _fold(self, work, bucket, received, start):
        """Sum what rank j sent, j = 0, 1, ..., into the shard at `start`, divided by Nd."""
        work.wait()  # `bucket` was kept alive until now: it is the send buffer
        out = self.grad_shard[start:start + received.shape[1]]
        total = out if self.micro_batches == 0 else torch.empty_like(out)
        # Before: copy row 0, then add rows 1, 2, ...; now the first add writes g_0 + g_1
        # straight into the shard (the same sum, one pass over it fewer)
        if self.nd == 1:
            total.copy_(received[0])
        else:
            torch.add(received[0], received[1], out=total)
        for j in range(2, self.nd):
            total.add_(received[j])
        total.div_(self.nd)
        if total is not out:  # a later micro-batch: add its mean to the sum so far
            out.add_(total)

    def _grad_ready(self, p):
        """Post-accumulate-grad hook: p's gradient for this backward is complete."""
        self._begin_backward()
        i = self.index[p]
        self.used[i] = True
        a, n = self.offsets[i], p.numel()
        grad = p.grad.view(-1)
        for k in self.buckets_of[i]:  # copy into the bucket(s) it falls in
            ka, kb = k * self.bucket_numel, min((k + 1) * self.bucket_numel, self.psi_trainable)
            lo, hi = max(a, ka), min(a + n, kb)
            self._bucket(k)[lo - ka:hi - ka].copy_(grad[lo - a:hi - a])
        p.grad = None  # the full gradient lives on only in the bucket (stages 0-1: the flat buffer)
        if self.stage == 3:  # the last gradient of p's group: backward is done with its parameters
            g = self.group_of[p]
            self.grads_left[g] -= 1
            if self.grads_left[g] == 0:
                self._free(self.groups[g][0])
        for k in self.buckets_of[i]:
            self.pending[k] -= 1
        self._reduce_ready_buckets()

    def _reduce_ready_buckets(self):
        while self.next_bucket >= 0 and self.pending[self.next_bucket] == 0:
            self._reduce_bucket(self.next_bucket)
            self.next_bucket -= 1

    def _begin_backward(self):
        if self.in_backward:
            return
        if self.scaler and not self.scaling:
            raise RuntimeError("with fp16 loss scaling, call optimizer.backward(loss) instead of loss.backward()")
        if self.shard_in_flat_grad and self.micro_batches == 1:
            # Stages 0-1 reduce into their full gradient buffer, which the next micro-batch
            # needs for its own gradients: the sum so far moves out (Ψ/Nd while accumulating).
            self.grad_shard = self.grad_shard.clone()
        Variable._execution_engine.queue_callback(self._finish_backward)
        self.in_backward = True

    def _finish_backward(self):
        """End of backward: reduce what is left, agree on which parameters were used."""
        for i in range(self.n_trainable):
            if not self.used[i]:  # unused on this rank: it contributes zeros, as in DDP
                a, b = self.offsets[i], self.offsets[i + 1]
                for k in self.buckets_of[i]:
                    ka = k * self.bucket_numel
                    self._bucket(k)[max(a, ka) - ka:min(b, ka + self.bucket_numel) - ka].zero_()
                    self.pending[k] -= 1
        self._reduce_ready_buckets()
        while self.in_reduction:
            self._fold(*self.in_reduction.pop(0))
        # A parameter unused on every rank in every micro-batch keeps no gradient (the
        # optimizer skips it, as with DDP's find_unused_parameters=True); one used anywhere
        # gets the average.
        used = torch.tensor(self.used, dtype=torch.int32, device=self.flag_device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group)  # (n_trainable,) flags
        self.used_anywhere = [u or v for u, v in zip(self.used_anywhere, used.bool().tolist())]
        if self.stage == 3:
            self._finish_prefetch()
            for buf, runs in self.groups:
                self._free(buf)
        self.micro_batches += 1
        self._new_backward()

    def _new_backward(self):
        self.used = [False] * self.n_trainable  # this rank's gradient arrived, this backward
        self.pending = list(self.params_in_bucket)
        self.bucket_bufs, self.in_reduction = {}, []  # in_reduction: all-to-alls not yet folded
        self.next_bucket = self.n_buckets - 1
        self.in_backward = False
        if self.stage == 3:
            self.grads_left = list(self.group_trainable)  # per group: gradients still to come

    # -------------------------------------------------------------------------------------
    # Section 5.3 -- P_os+g+p: parameters exist in full only while a module uses them.
    # Before a module's forward, and again before its backward, the owners of its
    # parameters broadcast their parts (Section 7.2.2); after the forward, and in backward once
    # the gradients of all of them are complete, the full copy is freed. Every rank must
    # run the same modules in the same order (as with FSDP and DeepSpeed ZeRO-3).
    # Per-rank model states: (4 + 4 + K)Ψ/Nd.
    # -------------------------------------------------------------------------------------
    @staticmethod
    def _free(buf):
        buf.untyped_storage().resize_(0)

    def _install_gather_hooks(self, units):
        # A unit (e.g. a transformer block) gathers all the parameters below it at once: fewer,
        # larger broadcasts. Any other module gathers the parameters it owns itself.
        units = set(units)
        inside = {sub for u in units for sub in u.modules() if sub is not u}
        owned = [(m, list(m.parameters(recurse=m in units))) for m in self.module.modules() if m not in inside]
        owned = [(m, own) for m, own in owned if own]
        owners = collections.Counter(p for m, own in owned for p in own)
        # A parameter owned by several modules (a tied embedding and output layer) stays
        # gathered from its first use to the end of the whole forward: one gather, not one per
        # module, so forward moves Ψ and no more.
        shared = {p for p, n in owners.items() if n > 1}
        # Groups: what one module gathers into one buffer (its parameters, a shared one alone).
        self.groups, self.group_of = [], {}  # groups: (buffer, runs); group_of: parameter -> group
        for m, own in owned:
            for members in [[p for p in own if p not in shared]] + [[p] for p in own if p in shared]:
                if members and members[0] not in self.group_of:
                    self.groups.append(self._make_group(members, len(self.groups)))
            gids = tuple(sorted({self.group_of[p] for p in own}))
            m.register_forward_pre_hook(lambda mod, args, gids=gids: self._pre_forward(gids))
            m.register_forward_hook(lambda mod, args, out, gids=gids: self._post_forward(gids, out))
        self.shared = {self.group_of[p] for p in shared}
        # In backward a group is freed when its last gradient arrives; one that holds a frozen
        # parameter (no gradient says when backward is done with it) at the end of backward.
        self.group_trainable = [0] * len(self.groups)
        for p in self.params[:self.n_trainable]:
            self.group_trainable[self.group_of[p]] += 1
        for p in self.params[self.n_trainable:]:
            self.group_trainable[self.group_of[p]] = math.inf  # never counted down to 0
        self.refcount = [0] * len(self.groups)
        self.prefetch_numel = self.prefetch * max(buf.numel() for buf, runs in self.groups)  # see _prefetch
        self.module.register_forward_hook(lambda mod, args, out: self._end_forward())
        self.unit_order, self.unit_position, self.order_known, self.in_flight = [], {}, False, {}

    def _make_group(self, members, g):
        """Group g: one buffer for `members`, in flat order; each parameter becomes a view into
        it. runs: [flat start, flat end, position in the buffer] of each stretch of the flat
        space it holds (one for a block, whose parameters lie end to end)."""
        members = sorted(members, key=lambda p: self.index[p])
        buf = torch.empty(sum(p.numel() for p in members), dtype=self.param_dtype, device=self.device)
        runs, at = [], 0
        for p in members:
            a = self.offsets[self.index[p]]
            if runs and runs[-1][1] == a:
                runs[-1][1] += p.numel()
            else:
                runs.append([a, a + p.numel(), at])
            p.data = buf[at:at + p.numel()].view(p.shape)
            self.group_of[p] = g
            at += p.numel()
        self._free(buf)  # empty until a module gathers it
        return buf, runs

    def _gather(self, gids, prefetch=False):
        """Gather groups gids (prefetch: leave the broadcasts in flight). Returns their elements."""
        for g in gids:
            buf, runs = self.groups[g]
            if g in self.in_flight and not prefetch:  # prefetched: wait for its broadcasts
                for work in self.in_flight.pop(g):
                    work.wait()
            if buf.numel() == 0 or buf.untyped_storage().nbytes() > 0:
                continue  # gathered already (or on its way)
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            # Before: each parameter had a storage of its own, and broadcasts landed in a staging
            # buffer copied out into them; now a group's parameters are views into one buffer,
            # and each owner broadcasts its part straight into it (one allocation, no copy).
            works = [work for a, b, at in runs
                     for lo, work in self._broadcast_from_owners(buf, a, b, at, fill=True)]
            if prefetch:  # waited for when the group is used
                self.in_flight[g] = works
            else:
                for work in works:
                    work.wait()
        return sum(self.groups[g][0].numel() for g in gids)

    def _finish_prefetch(self):
        for works in self.in_flight.values():
            for work in works:
                work.wait()
        self.in_flight = {}

    def _prefetch(self, gids, step):
        """Before: each unit's gather waited for its own forward or backward; now the next
        units' broadcasts (in the order the first forward ran them, reversed in backward) are
        issued as this one starts, and overlap its compute. Before: the next unit only; now
        units up to `prefetch` times the largest unit's elements, so that a small module
        between two blocks (an embedding, the final LayerNorm) does not leave the next block's
        gather exposed."""
        k, budget = self.unit_position.get(id(gids)), self.prefetch_numel
        while k is not None and budget > 0 and 0 <= k + step < len(self.unit_order):
            k += step
            budget -= self._gather(self.unit_order[k], prefetch=True)

    def _end_forward(self):
        self._finish_prefetch()
        self._release(self.shared)
        self.order_known = True  # the units' order, from the first forward

    def _pre_forward(self, gids):
        self._gather(gids)
        for g in gids:
            self.refcount[g] += 1
        if not self.order_known and id(gids) not in self.unit_position:
            self.unit_position[id(gids)] = len(self.unit_order)
            self.unit_order.append(gids)
        self._prefetch(gids, +1)

    def _release(self, gids):
        for g in gids:
            if self.refcount[g] == 0:
                self._free(self.groups[g][0])

    def _post_forward(self, gids, out):
        for g in gids:
            self.refcount[g] -= 1
        if not self.in_backward:  # a forward recomputed in backward (P_a) keeps them for backward
            self._release([g for g in gids if g not in self.shared])
        if torch.is_grad_enabled():  # gather again when backward reaches this module
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, gids=gids: self._pre_backward(gids))

    def _pre_backward(self, gids):
        self._begin_backward()
        self._gather(gids)
        self._prefetch(gids, -1)

    # -------------------------------------------------------------------------------------
    # Buffers follow rank 0 at every training forward, as in DDP (broadcast_buffers=True).
    # -------------------------------------------------------------------------------------
    def _broadcast_buffers(self, module, args):
        if torch.is_grad_enabled():
            for b in self.buffers:
                dist.broadcast(b, group_src=0, group=self.group)

    # -------------------------------------------------------------------------------------
    # The step: update this rank's partition, then make the parameters whole again.
    # -------------------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optim.param_groups

    def backward(self, loss):
        """loss.backward(), scaled by the loss scale when fp16 loss scaling is on."""
        self.scaling = True
        try:
            (loss.float() * self.loss_scale if self.scaler else loss).backward()
        finally:
            self.scaling = False

    def _grads(self):
        """This rank's averaged gradient, (own_numel,) from flat index `base`, unscaled, in the
        optimizer's dtype; and whether any rank's overflowed. Computed once per step."""
        if self.grads is None:
            if self.micro_batches == 0:  # no backward reached a parameter: reduce zeros
                self._finish_backward()
            grads = self.grad_shard
            if self.stage == 0:
                # all-reduce = reduce-scatter + all-gather: each rank sends its reduced shard (Ψ/Nd)
                full = self.flat_grad if self.shard_in_flat_grad else grads.new_empty(self.padded_numel)
                full[self.lo:self.hi].copy_(grads)  # returns at once where grads is that very slice
                grads = self._all_gather(full)
            grads = grads.to(self.master_dtype or self.param_dtype)
            found_inf = torch.zeros((), device=self.flag_device)
            if self.scaler:
                found_inf = (~grads.isfinite()).any().float()
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)  # any rank's shard
                grads.div_(self.loss_scale)
            self.grads, self.overflow = grads, bool(found_inf)
        return self.grads

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """torch.nn.utils.clip_grad_norm_ over the full gradients, bit for bit: the norm of the
        per-parameter norms in parameter order, then every gradient times min(1, max_norm /
        (norm + 1e-6)). A parameter's norm is taken where its whole gradient is: on its rank,
        or, for one straddling a shard boundary, on its first rank after its pieces are sent
        there. Returns the total norm."""
        grads = self._grads()
        norms = torch.zeros(self.n_trainable, dtype=grads.dtype, device=self.device)
        for i in range(self.n_trainable):
            if not self.used_anywhere[i]:
                continue
            a, b = self.offsets[i], self.offsets[i + 1]
            first = a // self.shard_numel
            if self.stage == 0 or a // self.shard_numel == (b - 1) // self.shard_numel:
                if self.stage == 0 or first == self.rank:
                    norms[i] = torch.linalg.vector_norm(grads[a - self.base:b - self.base], norm_type)
                continue
            # a straddler: all-to-all of each rank's piece to its first rank -> (b - a,) there
            splits = [_overlap(a, b, j * self.shard_numel, (j + 1) * self.shard_numel) for j in range(self.nd)]
            mine = grads[max(a, self.lo) - self.lo:max(a, self.lo) - self.lo + splits[self.rank]]
            whole = grads.new_empty(b - a if self.rank == first else 0)
            dist.all_to_all_single(whole, mine, splits if self.rank == first else [0] * self.nd,
                                   [splits[self.rank] if j == first else 0 for j in range(self.nd)],
                                   group=self.group)
            if self.rank == first:
                norms[i] = torch.linalg.vector_norm(whole, norm_type)
        if self.stage > 0:  # each norm was found on one rank, zeros elsewhere: the sum is exact
            dist.all_reduce(norms, group=self.group)  # (n_trainable,)
        total = torch.linalg.vector_norm(torch.stack([norms[i] for i in range(self.n_trainable)
                                                      if self.used_anywhere[i]]), norm_type)
        grads.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def step(self):
        """Update this rank's partition and gather the parameters. Returns False when fp16 loss
        scaling found an overflow and skipped the step on every rank."""
        self._wait_params()  # the shard is still being sent if no forward came since the last step
        grads = self._grads()
        if self.scaler:
            self._update_loss_scale()
            if self.overflow:
                return False
        for piece, i, a, b in self.pieces:
            piece.grad = grads[a - self.base:b - self.base] if self.used_anywhere[i] else None
        self.optim.step()
        if self.master_dtype:
            self.own_params.copy_(self.master)  # fp32 master -> the 16-bit parameters
        if self.stage in (1, 2):
            # each rank sends its updated shard (Ψ/Nd); the next forward waits for it (below)
            self.param_gathers = self._all_gather(self.flat_param, wait=False)
        # stage 3: nothing to gather now; the next forward gathers what it uses
        return True

    def _broadcast_from_owners(self, buf, a, b, at=0, fill=False):
        """Flat elements [a, b) to every rank, landing in buf[at:at + b - a]: each owner
        broadcasts its part in flat order, at most bucket_numel elements at a time (C_B);
        fill: the owner first copies its part there from param_shard (stage 3). Returns
        [(flat start, work)], in flight."""
        works = []
        for j in range(self.nd):
            j_lo, j_hi = j * self.shard_numel, (j + 1) * self.shard_numel
            for lo in range(max(a, j_lo), min(b, j_hi), self.bucket_numel):
                part = buf[at + lo - a:at + min(lo + self.bucket_numel, b, j_hi) - a]
                if fill and j == self.rank:
                    part.copy_(self.param_shard[lo - self.lo:lo - self.lo + part.numel()])
                works.append((lo, dist.broadcast(part, group_src=j, group=self.group, async_op=True)))  # from rank j
        return works

    def _all_gather(self, full, wait=True):
        """full (padded_numel,): rank j's shard full[j*S:(j+1)*S] to every rank, by owner
        broadcasts. Before: all_gather_single; now asynchronous broadcasts, the same bytes
        ((Nd-1)/Nd of the tensor per rank, Section 7) in about a third of the time on gloo (43
        MB at world 2: 60 -> 18 ms; world 4: 103 -> 35 ms). wait=False: returns [(flat start,
        work)] still in flight."""
        works = self._broadcast_from_owners(full, 0, self.padded_numel)
        if not wait:
            return works
        for lo, work in works:
            work.wait()
        return full

    # -------------------------------------------------------------------------------------
    # Section 5.1 (cont.) -- stages 1-2 gather the updated parameters after the step.
    # Before: step() waited for the whole all-gather; now it leaves the broadcasts in flight,
    # and each module waits, just before its next forward, for those that cover its
    # parameters: the gather overlaps the first modules' forward. state_dict(), step() and
    # zero.full_state_dict() wait for all of it.
    # -------------------------------------------------------------------------------------
    def _install_wait_hooks(self):
        for m in self.module.modules():
            own = list(m.parameters(recurse=False))
            if own:
                end = max(self.offsets[self.index[p] + 1] for p in own)
                m.register_forward_pre_hook(lambda mod, args, end=end: self._wait_params(end))
        self.module.register_state_dict_pre_hook(lambda *args: self._wait_params())

    def _wait_params(self, end=math.inf):
        """Wait for the broadcasts that step() left in flight, of flat elements [0, end)."""
        while self.param_gathers and self.param_gathers[0][0] < end:
            self.param_gathers.pop(0)[1].wait()

    def _update_loss_scale(self):
        s = self.scaler
        if self.overflow:
            self.loss_scale, self.clean_steps = max(self.loss_scale * s.backoff_factor, s.min_scale), 0
        else:
            self.clean_steps += 1
            if self.clean_steps == s.growth_interval:
                self.loss_scale, self.clean_steps = self.loss_scale * s.growth_factor, 0

    def zero_grad(self, set_to_none=True):
        if not set_to_none:
            raise ValueError("zero_grad(set_to_none=False) is not supported: gradients are always released")
        for p in self.params:
            p.grad = None
        for piece, i, a, b in self.pieces:
            piece.grad = None
        if self.shard_in_flat_grad:
            self.grad_shard = self.flat_grad[self.lo:self.hi]  # P_os: reduced in place
        self.micro_batches, self.used_anywhere = 0, [False] * self.n_trainable
        self.grads, self.overflow, self.scaling = None, False, False
        self._new_backward()

    def model_state_bytes(self):
        """Bytes of this rank's parameters, gradients and optimizer states, summed over the
        distinct storages of the tensors that hold them (a storage freed by stage 3 counts 0)."""
        tensors = [t for p in self.params for t in (p, p.grad) if t is not None]
        tensors += [getattr(self, n) for n in ("flat_param", "param_shard", "master", "flat_grad", "grad_shard")
                    if hasattr(self, n)]
        tensors += [v for state in self.optim.state.values() for v in state.values() if torch.is_tensor(v)]
        # keyed by the storage itself (_cdata), not data_ptr, which is 0 for every meta tensor
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                    for t in tensors if t.untyped_storage().nbytes() > 0}
        return sum(storages.values())

    # -------------------------------------------------------------------------------------
    # Full tensors for checkpoints and tests (gathered; not on the training path).
    # -------------------------------------------------------------------------------------
    def _full(self, own):
        """A (padded_numel,) tensor from each rank's (own_numel,) part."""
        if self.stage == 0:
            return own
        full = own.new_empty(self.padded_numel)
        dist.all_gather_single(full, own, group=self.group)
        return full

    def full_state_dict(self):
        self._wait_params()
        # the fp32 master weights where they exist, else the parameters themselves
        flat = self._full(self.master) if self.master_dtype else \
            self.flat_param if self.stage < 3 else self._full(self.param_shard)
        state = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if t in self.index:
                i = self.index[t]
                value = flat[self.offsets[i]:self.offsets[i + 1]].view(t.shape).clone()
            else:  # a buffer: rank 0's, as the next forward would see it
                value = t.detach().clone()
                dist.broadcast(value, group_src=0, group=self.group)
            state[name] = value.float() if value.is_floating_point() else value
        return state

    def full_optimizer_state(self):
        """{parameter name: {state key: full tensor}}, as the optimizer would hold it whole."""
        kinds = {}  # per parameter: state key -> "elementwise" or the scalar state's value
        for piece, i, a, b in self.pieces:
            for key, v in self.optim.state.get(piece, {}).items():
                elementwise = torch.is_tensor(v) and v.shape == piece.shape
                kinds.setdefault(i, {})[key] = "elementwise" if elementwise else v
        everyone = [None] * self.nd
        dist.all_gather_object(everyone, kinds, group=self.group)
        merged = {}
        for d in everyone:
            for i, keys in d.items():
                merged.setdefault(i, {}).update(keys)
        full = {}
        for key in sorted({k for d in merged.values() for k, v in d.items() if v == "elementwise"}):
            part = torch.zeros(self.own_numel, device=self.device)  # one gather per elementwise state
            for piece, i, a, b in self.pieces:
                if key in self.optim.state.get(piece, {}):
                    part[a - self.base:b - self.base] = self.optim.state[piece][key]
            full[key] = self._full(part)
        names = {p: n for n, p in self.module.named_parameters()}
        result = {}
        for i, keys in sorted(merged.items()):
            p = self.params[i]
            result[names[p]] = {k: full[k][self.offsets[i]:self.offsets[i + 1]].view(p.shape).clone()
                                if isinstance(v, str) else v for k, v in keys.items()}
        return result


# -----------------------------------------------------------------------------------------
# Section 6.1 -- ZeRO-R, P_a: partitioned activation checkpointing.
# Checkpointing keeps only each block's input and recomputes the block in backward. With
# model parallelism that input is replicated on every MP rank; P_a keeps 1/MP of it on each
# rank and all-gathers it just before the recomputation (one all-gather of batch x seq x
# hidden per block). P_a+cpu moves the kept part to CPU memory. M_D (Section 6.3): the parts
# live in one pre-allocated buffer, so these long-lived tensors do not interleave with the
# short-lived ones in memory.
# -----------------------------------------------------------------------------------------
class ActivationCheckpointing:
    """Checkpoint each of `blocks` (modules called as block(x)): partition=True is P_a over
    tp_group, cpu=True is P_a+cpu, contiguous=True is M_D for the checkpoints."""

    def __init__(self, blocks, tp_group=None, partition=False, cpu=False, contiguous=False):
        self.blocks = list(blocks)
        self.tp_group, self.partition, self.cpu, self.contiguous = tp_group, partition, cpu, contiguous
        self.tp = dist.get_world_size(tp_group) if partition and tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if self.tp > 1 else 0
        self.arena, self.busy = None, [False] * len(self.blocks)
        for i, block in enumerate(self.blocks):
            block.forward = functools.partial(self._forward, i, block.forward)

    def _forward(self, i, forward, x):
        if not torch.is_grad_enabled():  # nothing to save for a backward
            return forward(x)
        shape, device, requires_grad = x.shape, x.device, x.requires_grad
        holder = [x]  # the whole input, for this forward only

        def run(part):
            if holder[0] is not None:
                return forward(holder[0])
            # the recomputation in backward: the input again, from the kept part
            return forward(self._restore(i, part, shape, device).requires_grad_(requires_grad))

        y = torch.utils.checkpoint.checkpoint(run, self._keep(i, x), use_reentrant=False)
        holder[0] = None
        return y

    def _keep(self, i, x):
        part = x.detach().reshape(-1)  # (B*T*C,)
        if self.tp > 1:  # P_a: (B*T*C,) -> my (ceil(B*T*C / tp),) slice
            n = math.ceil(part.numel() / self.tp)
            part = F.pad(part, (0, n * self.tp - part.numel()))[self.tp_rank * n:(self.tp_rank + 1) * n]
        if not (self.contiguous or self.cpu or self.tp > 1):
            return part  # plain checkpointing: keep the input itself
        device = torch.device("cpu") if self.cpu else part.device
        if self.contiguous:  # M_D: slot i of one buffer for all blocks
            if self.arena is None or self.arena.shape[1] != part.numel() or self.arena.device != device:
                self.arena = torch.empty(len(self.blocks), part.numel(), dtype=part.dtype, device=device,
                                         pin_memory=self.cpu and part.is_cuda)
            if not self.busy[i]:
                self.busy[i] = True
                slot = self.arena[i]
                # .data: filling slot i must not bump the version the other slots were saved at
                slot.data.copy_(part, non_blocking=True)
                return slot
        return part.to(device, copy=True)  # P_a's own copy, so the whole input can be freed

    def _restore(self, i, part, shape, device):
        self.busy[i] = False
        part = part.to(device, non_blocking=True)
        if self.tp == 1:
            return part[:math.prod(shape)].view(shape)
        full = part.new_empty(self.tp * part.numel())
        dist.all_gather_single(full, part, group=self.tp_group)  # (tp * n,): each rank sends n
        return full[:math.prod(shape)].view(shape)  # (B, T, C)


def checkpoint_activations(blocks, tp_group=None, partition=False, cpu=False, contiguous=False):
    """Activation checkpointing for `blocks` (e.g. a GPT's transformer blocks): plain, P_a
    (partition=True, over tp_group), P_a+cpu (cpu=True), with M_D buffers (contiguous=True)."""
    return ActivationCheckpointing(blocks, tp_group, partition, cpu, contiguous)


# -----------------------------------------------------------------------------------------
# Entry points
# -----------------------------------------------------------------------------------------
def initialize(module, optimizer_class, stage, group=None, param_groups=None, bucket_numel=DEFAULT_BUCKET_NUMEL,
               param_dtype=None, reduce_dtype=None, loss_scale=None, stage3_units=None, prefetch=1,
               **optimizer_kwargs):
    """Shard `module` for ZeRO-DP `stage` over the data-parallel `group` (default: the world).

    Returns (module, optimizer): the same module, now sharded and hooked, and the optimizer
    to step. `optimizer_class` is a torch.optim class (not an instance) and its arguments come
    as keywords; `param_groups` is an optional list of {"params": [...], **options} over the
    module's parameters, as torch.optim takes it. Every rank starts from rank 0's weights.

    param_dtype=torch.bfloat16 or torch.float16: the model computes in 16 bits and the
    optimizer keeps fp32 master weights for its partition. reduce_dtype: the dtype gradients
    are summed in (default: param_dtype). loss_scale: fp16's loss scaling, a DynamicLossScale
    (the default for float16) or a number for a static scale; then call optimizer.backward(loss).
    stage3_units: modules (e.g. transformer blocks) whose parameters stage 3 gathers together,
    in one go before the unit's forward and backward; other modules gather their own.
    prefetch: at stage 3, gather the next units while the current one computes, up to this
    many times the largest unit's elements ahead (0: no prefetch).

    At stages 1-2, step() returns with the all-gather of the updated parameters still in
    flight: each module's forward waits for its own part, and module.state_dict(),
    zero.full_state_dict() and the next step() wait for all of it. Read the parameters any
    other way (p.data, parameters_to_vector) only after one of those.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("zero.initialize needs a process group: call torch.distributed.init_process_group"
                           "('gloo' on CPU, 'nccl' on GPU) first, or run under torchrun")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (got {stage!r})")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None for the world "
                        f"(got {type(group).__name__}); make one with dist.new_group(ranks) or a DeviceMesh")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module (got {type(module).__name__})")
    if isinstance(optimizer_class, torch.optim.Optimizer):
        raise TypeError(f"pass the optimizer class, not an instance: zero.initialize(module, "
                        f"torch.optim.{type(optimizer_class).__name__}, stage=..., lr=...) and its "
                        f"arguments as keywords")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE_OPTIMIZERS)):
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"{getattr(optimizer_class, '__name__', optimizer_class)} cannot be sharded exactly: "
                         f"ZeRO splits the update across ranks, which is exact only for elementwise "
                         f"optimizers ({names})")
    if optimizer_kwargs.get("fused"):
        raise ValueError("fused=True optimizers are not layout invariant (a shard updates to other bits "
                         "than the whole tensor): use fused=False, or foreach=True for speed")
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be torch.float32, torch.bfloat16 or torch.float16 (got {dtype})")
    if loss_scale is not None and not isinstance(loss_scale, (int, float, DynamicLossScale)):
        raise TypeError(f"loss_scale must be a number or a zero.DynamicLossScale (got {type(loss_scale).__name__})")
    params = list(module.parameters())
    if not params:
        raise ValueError("module has no parameters to shard")
    for name, p in module.named_parameters():
        if not p.is_floating_point():
            raise TypeError(f"parameter {name} has dtype {p.dtype}: ZeRO shards floating-point parameters "
                            f"only; register it as a buffer instead")
        if p.dtype != params[0].dtype or p.device != params[0].device:
            raise ValueError(f"parameter {name} is {p.dtype} on {p.device} but others are {params[0].dtype} "
                             f"on {params[0].device}: move the module to one dtype and device first "
                             f"(for mixed precision keep it fp32 and pass param_dtype)")
    if param_groups is not None:
        listed = [p for g in param_groups for p in g["params"]]
        if len(listed) != len(set(listed)) or set(listed) - set(params):
            raise ValueError("param_groups must hold only this module's parameters, each at most once")
        missing = [n for n, p in module.named_parameters() if p.requires_grad and p not in set(listed)]
        if missing:
            raise ValueError(f"param_groups leaves out trainable parameters {missing}: add them to a group")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be 0 (off) or more: how many largest units' worth of parameters stage 3 "
                         f"gathers ahead (got {prefetch!r})")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be at least 1 (got {bucket_numel})")
    optimizer = ZeroOptimizer(module, optimizer_class, stage, group, param_groups, bucket_numel,
                              param_dtype, reduce_dtype, loss_scale, stage3_units, prefetch, optimizer_kwargs)
    module._zero = optimizer
    return module, optimizer


def _engine(module):
    if not isinstance(getattr(module, "_zero", None), ZeroOptimizer):
        raise ValueError("this module was not returned by zero.initialize")
    return module._zero


def full_state_dict(module):
    """{name: full tensor} for every parameter and buffer (floating point as fp32), the same keys
    as module.state_dict(), identical on every rank. A collective: call it on every rank."""
    return _engine(module).full_state_dict()


def model_state_bytes(module):
    """Bytes of parameters, gradients and optimizer states this rank holds now."""
    return _engine(module).model_state_bytes()


def full_optimizer_state(module):
    """{parameter name: {state key: full tensor}}: the optimizer state as one unsharded optimizer
    would hold it. A collective: call it on every rank."""
    return _engine(module).full_optimizer_state()
