"""ZeRO-DP in one file: stages 0-3 of "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (Rajbhandari, Rasley, Ruwase, He; SC 2020), on torch.distributed.

    model, optimizer = zero.initialize(module, torch.optim.AdamW, stage=2, lr=3e-4)
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()

    stage 0  baseline data parallelism: everything replicated           (4 + 4 + K)Ψ per rank
    stage 1  P_os:     optimizer states partitioned                     4Ψ + 4Ψ + KΨ/Nd
    stage 2  P_os+g:   ... and gradients                                4Ψ + (4 + K)Ψ/Nd
    stage 3  P_os+g+p: ... and parameters                               (4 + 4 + K)Ψ/Nd
    (fp32 parameters and gradients here; the paper's 2Ψ terms are its fp16 copies)

    python zero.py consolidate DIR OUT.pt    # a sharded checkpoint -> one plain torch state

reduction="exact" (the default) divides each rank's gradients by Nd, as DDP does, and sums them in one fixed
pairwise tree over the ranks ((g_0 + g_1) + (g_2 + g_3) at Nd 4): every stage and bucket size gives the same
bits, DDP's at Nd 2. reduction="native" uses the backend's reduce-scatter, in its own order.
Sections follow the paper: 3, 3.1, 5 and 7, 5.1, 5.2, 5.3, 6 (ZeRO-R); then `initialize`, checkpoints.
"""
import bisect
import collections
import contextlib
import copy
import datetime
import errno
import functools
import gc
import hashlib
import inspect
import io
import itertools
import json
import math
import os
import pathlib
import pickle
import shutil
import time
import types
import warnings
import weakref
from dataclasses import dataclass, field, is_dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map

if not hasattr(dist, "all_gather_single"):  # torch 2.13's name; before, all_gather_into_tensor
    raise ImportError(f"zero.py needs torch 2.13 or later (requirements.txt pins torch==2.13.0); this is torch "
                      f"{torch.__version__}, which has no torch.distributed.all_gather_single")

# Optimizers whose update of an element reads only that element's parameter, gradient and state:
# sharded, they give the same bits as whole (not so LBFGS).
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                          torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)

ALIGN = 8  # elements: every rank's chunk of a bucket starts on a 16-byte boundary (32 in fp32)
REDUCTIONS = ("exact", "native")


def default_bucket_numel(nd):
    """C_B by default: 2^22 elements (16 MiB in fp32), constant in the model's size (Section 6.2), grown
    at large Nd so each rank's chunk stays >= 2^16 elements: tiny pieces make a collective latency-bound."""
    return max(2**22, 2**16 * nd)


# -----------------------------------------------------------------------------------------
# Section 3 -- where the memory goes: model states (parameters, gradients, optimizer states)
# and residual states (activations, temporary buffers, fragmentation), recorded by MemoryHooks.
def _dense_parts(t):
    """The tensors whose storages hold t's elements (a sparse tensor has no storage of its own)."""
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return [t]


def live_storages(device_type="cpu"):
    """{storage id: storage} of every tensor (and .grad) alive on `device_type`, each storage once (not by
    data_ptr(): 0 on meta, raises once freed). Skipped: wrapper subclasses (DTensor: its local tensor counts),
    FakeTensor and mkldnn tensors (no storage). Tensors only C++ holds are not seen."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading .grad of a non-leaf warns
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == device_type and not obj.is_mkldnn \
                    and not is_traceable_wrapper_subclass(obj) and not isinstance(obj, FakeTensor):
                for t in (obj, obj.grad):
                    for part in _dense_parts(t) if t is not None else ():
                        storages[part.untyped_storage()._cdata] = part.untyped_storage()
    return storages


def live_tensor_bytes(device_type="cpu"):
    return sum(s.nbytes() for s in live_storages(device_type).values())


def _on_cuda():
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _when_backward_reaches(t, fn):
    """Call fn() when backward reaches the node that made t; for a view, its base's node, since an
    in-place op on the view (x = self.fc(x); x.relu_()) takes the view's own node out of the graph.
    The calls on one node run last registered first: modules that return one output are reached
    outermost first (the root returning its head's output, then the head), as their forwards ended."""
    node = (t._base if t._is_view() and t._base.grad_fn is not None else t).grad_fn
    if node is None:  # a leaf, returned as it is (a parameter: the hook outlives this backward, so it goes once called)
        def once(grad):
            handle.remove()
            fn()
        handle = t.register_hook(once)
        return
    calls = node.metadata.setdefault("zero: when backward reaches", [])  # (the node's own dict: dies with it)
    if not calls:
        node.register_prehook(lambda grad_outputs: _call_all(reversed(calls)))
    calls.append(fn)


def _call_all(fns):
    for fn in fns:
        fn()


class MemoryHooks:
    """records: (phase, module name, allocated, reserved) at each module's forward start and end and
    backward start (every_module=False: the root's only), while `recording` is True. On CUDA from the
    allocator (reserved - allocated is what M_D fights); on CPU, where it reads 0, a slow walk over all live tensors."""

    def __init__(self, module, every_module=True):
        self.records, self.recording, self.saved = [], False, None
        for name, m in module.named_modules() if every_module else [("", module)]:
            # stage 3 gathers a unit's parameters before its forward start and frees them after its end, whenever
            # its hooks were put on: recorded inside them (prepend), both counts hold the parameters; the root's end
            # after zero's, which free what the forward prefetched and left unused
            m.register_forward_pre_hook(lambda mod, args, name=name: self.record("forward start", name))
            m.register_forward_hook(lambda mod, args, out, name=name: self._forward_end(name, out),
                                    prepend=m is not module)
        module.register_forward_pre_hook(lambda mod, args: self._see_saved_tensors())
        module.register_forward_hook(lambda mod, args, out: self._stop_seeing(), always_call=True)

    def _see_saved_tensors(self):
        """Autograd keeps some saved tensors in C++ alone (cross_entropy's log_softmax output), unseen by
        live_storages: a recorded CPU forward keeps each through a Python object, unless an enclosing
        torch.utils.checkpoint's hooks pack them already."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if self.recording and torch.is_grad_enabled() and not _on_cuda() and outer is None:
            self.saved = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            self.saved.__enter__()

    def _stop_seeing(self):
        if self.saved is not None:
            self.saved.__exit__(None, None, None)
            self.saved = None

    def _forward_end(self, name, out):
        self.record("forward end", name)
        if self.recording and torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                _when_backward_reaches(tensors[0], lambda: self.record("backward start", name))

    def record(self, phase, name):
        if not self.recording:
            return
        if _on_cuda():
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        else:
            allocated = reserved = live_tensor_bytes()
        self.records.append((phase, name, allocated, reserved))

    def peak(self):
        return max((r[2] for r in self.records), default=0)

    def kept_by_forward(self, name=""):
        """Bytes the first recorded forward of module `name` (default: the root) kept for backward."""
        start, end = [next((r[2] for r in self.records if r[:2] == (phase, name)), None)
                      for phase in ("forward start", "forward end")]
        if start is None or end is None:
            raise ValueError(f"no recorded forward of module {name!r}: set recording = True around a forward and "
                             f"name one of {sorted({r[1] for r in self.records})}")
        return end - start


# -----------------------------------------------------------------------------------------
# Section 3.1 -- mixed precision: the model computes in param_dtype (fp16 or bf16: the
# paper's 2Ψ parameters and 2Ψ gradients); the optimizer updates an fp32 master copy (K = 12:
# master 4 + momentum 4 + variance 4 bytes). Gradients are summed in reduce_dtype.
@dataclass(frozen=True)
class Precision:
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @property
    def master_dtype(self):
        """fp32 for 16-bit parameters; None when the optimizer can update the parameters themselves."""
        return torch.float32 if self.param_dtype in (torch.float16, torch.bfloat16) else None


def _fp32(x):
    """x rounded to the nearest fp32 value, as GradScaler's fp32 scale holds it."""
    return torch.tensor(x, dtype=torch.float32).item()


@dataclass
class DynamicLossScale:
    """fp16's dynamic loss scaling (Micikevicius et al. 2018; torch's GradScaler): the loss is multiplied
    by `scale`; a step whose gradients overflow on any rank is skipped and the scale multiplied by
    backoff_factor (not below min_scale); after growth_interval clean steps, by growth_factor."""
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0


# -----------------------------------------------------------------------------------------
# Sections 5 and 7 -- one flat parameter space, partitioned over the Nd ranks.
# Parameters lie end to end in runs (reduced or gathered together), each cut into buckets of at
# most C_B elements (ALIGN x Nd where C_B is smaller; its last one padded); rank r owns chunk r of
# every bucket, and its chunks end to end are its shard, its "own space" (shard_numel elements): the
# trainable buckets' chunks first, so that gradients are laid out for those alone, a prefix of own
# space (at stages 0-2 the trainable buckets are a prefix of the flat space too).
# Figure 1's one contiguous shard per rank would reduce a bucket into one rank, whose link carries
# Nd copies; here each rank sends and receives (Nd-1)/Nd of every bucket, a ring's volume (Section 7).
#   reduce-scatter  every rank's gradient bucket in, the mean of chunk r out on rank r
#   all-gather      chunk r from rank r in, the whole bucket out on every rank
@dataclass
class Bucket:
    start: int  # flat index of its first element
    numel: int  # parameter elements; padding fills it up to chunk * Nd
    chunk: int  # elements per rank: rank r owns flat [start + r * chunk, start + (r + 1) * chunk)
    own: int  # where this rank's chunk starts in its own space
    trainable: bool
    segments: list = field(default_factory=list)  # (parameter index, flat start, flat end), flat order


class FlatPartition:
    def __init__(self, params, runs, group, bucket_numel, reduction, device, names, check_timeout=60):
        """params: trainable ones first (their index order); runs: [(parameters, trainable)] in flat order;
        names: {parameter: its name in the module} (a tied weight: its first), for messages and checkpoints."""
        self.group, self.reduction, self.device, self.names = group, reduction, device, names
        self.check_group = check_group(group)
        self.check_timeout = check_timeout if isinstance(check_timeout, datetime.timedelta) else \
            datetime.timedelta(seconds=check_timeout)
        # small flags (used parameters, stage 3's gather check) need values: the CPU when simulating on meta
        self.flag_device = torch.device("cpu") if device.type == "meta" else device
        self.nd, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = params
        self.index = {p: i for i, p in enumerate(params)}
        self.offsets = [0] * len(params)  # flat start of each parameter
        self.buckets, self.segments_of = [], [[] for _ in params]  # segments_of[i]: (bucket, flat start, end)
        # chunks are multiples of ALIGN (16-byte aligned everywhere); a full bucket is <= max(bucket_numel, ALIGN * Nd)
        full = max(ALIGN, bucket_numel // self.nd // ALIGN * ALIGN) * self.nd
        flat = 0
        for run, trainable in runs:
            first, start, numel = len(self.buckets), flat, sum(p.numel() for p in run)
            for lo in range(0, numel, full):
                chunk = math.ceil(min(full, numel - lo) / self.nd / ALIGN) * ALIGN
                self.buckets.append(Bucket(flat, min(full, numel - lo), chunk, None, trainable))
                flat += chunk * self.nd
            at = start
            for p in run:  # end to end; each parameter's segments, bucket by bucket (all but the last full)
                i, end = self.index[p], at + p.numel()
                self.offsets[i] = at
                while at < end:
                    k = first + (at - start) // full
                    hi = min(end, self.buckets[k].start + self.buckets[k].numel)
                    self.buckets[k].segments.append((i, at, hi))
                    self.segments_of[i].append((k, at, hi))
                    at = hi
        own = 0
        for b in sorted(self.buckets, key=lambda b: not b.trainable):  # (stable: in flat order within each kind)
            b.own, own = own, own + b.chunk
        self.padded_numel, self.shard_numel = flat, own
        self.trainable_own = sum(b.chunk for b in self.buckets if b.trainable)  # the prefix gradients cover
        self.unwaited = collections.deque()  # the async collectives this rank started, in that order (see wait)
        self.failed = None  # what a failed collective raises again at every later start and wait

    def flat_range(self, k):
        """Bucket k with its padding: (chunk * Nd,) of the flat space."""
        b = self.buckets[k]
        return slice(b.start, b.start + b.chunk * self.nd)

    def chunk(self, k, rank=None):
        """Rank `rank`'s (default: this rank's) chunk of bucket k, in the flat space."""
        b, r = self.buckets[k], self.rank if rank is None else rank
        return slice(b.start + r * b.chunk, b.start + (r + 1) * b.chunk)

    def holders(self, k, lo, hi):
        """The ranks whose chunks of bucket k hold flat [lo, hi)."""
        b = self.buckets[k]
        return range((lo - b.start) // b.chunk, (hi - 1 - b.start) // b.chunk + 1)

    def own(self, k):
        """This rank's chunk of bucket k, in its own space."""
        b = self.buckets[k]
        return slice(b.own, b.own + b.chunk)

    def reduce_scatter(self, bucket, k):
        """Start averaging `bucket` (chunk * Nd,) over the ranks, each sending and receiving (Nd-1)/Nd
        of it (Section 7.1); finish_reduce ends it. Divided by Nd first, as DDP does: a sum of fp16
        gradients can overflow where their mean does not, and at Nd 2 the mean has DDP's bits."""
        chunk = self.buckets[k].chunk
        bucket.div_(self.nd)  # in place: the bucket is this rank's to send
        if self.reduction == "exact":
            received = torch.empty_like(bucket)  # all-to-all: chunk j of my bucket to rank j, one bucket's traffic
            work = self.start(dist.all_to_all_single, received, bucket)
            return work, bucket, received.view(self.nd, chunk)  # (nd * chunk,) -> row j: rank j's copy of my chunk
        # native: the backend's reduce-scatter, in place: my chunk of the bucket ends as the sum
        mine = bucket[self.rank * chunk:(self.rank + 1) * chunk]
        work = self.start(dist.reduce_scatter_single, mine, bucket)
        return work, bucket, mine.view(1, chunk)

    def finish_reduce(self, pending, out, add):
        """Wait for a reduce_scatter; write its mean into out (chunk,), or add it (add=True). Exact: the Nd rows
        summed in a pairwise tree fixed by rank, one add per level: ceil(log2 Nd) kernels a bucket, not Nd - 1."""
        work, bucket, rows = pending
        self.wait(work)  # `bucket` was kept alive until now: it is the send buffer
        if out.is_meta:  # memory_table.py's simulation: meta tensors hold no values to add
            return
        while len(rows) > 1:  # (n, chunk) -> (ceil(n / 2), chunk): row 2i += row 2i + 1, in place
            pairs = len(rows) // 2
            rows[0:2 * pairs:2].add_(rows[1:2 * pairs:2])
            rows = rows[0::2]  # the sums, and an odd last row as it was
        if add:  # a later micro-batch
            out.add_(rows[0])
        else:
            out.copy_(rows[0])

    def all_gather(self, out, mine, async_op=True):
        """out (chunk * Nd,): every rank's chunk; mine (chunk,) this rank's, in place when it is
        a view of out. Each rank sends its chunk to Nd-1 ranks: (Nd-1)/Nd of the bucket."""
        work = self.start(dist.all_gather_single, out, mine)
        if not async_op:
            self.wait(work)
        return work

    def start(self, collective, *args, **kwargs):
        """dist.<collective>(*args) on the group, async, recorded in the order started (see wait)."""
        self.refuse_after_failure()
        try:
            work = collective(*args, group=self.group, async_op=True, **kwargs)
        except Exception as e:  # (gloo allocates the output in this thread: out of memory under a cap)
            self._fail(e)
        self.unwaited.append(work)
        return work

    def wait(self, work):
        """Wait for `work`, and first for each collective this rank started before it, in order. One can
        fail on a rank alone (gloo out of memory), its peers waiting in it for good: waiting for a later
        one first would hang too, the error never raised. (meet's checks wait at once, with a timeout.)"""
        self.refuse_after_failure()
        try:
            if any(w is work for w in self.unwaited):
                while True:
                    self.unwaited[0].wait()  # (left first if it raises, or an interrupt stops it)
                    if self.unwaited.popleft() is work:
                        break
            else:
                work.wait()  # waited already: returns at once
        except Exception as e:  # what was started after stays unwaited: its buffers must not be freed
            self._fail(e)

    def _fail(self, error):
        """A collective failed on this rank: every later start and wait raises this at once, none hangs."""
        self.failed = f"rank {self.rank}: a collective failed ({error}); the other ranks may wait in it for good, " \
                      f"so training cannot go on: restart it from its last checkpoint, in new processes"
        raise RuntimeError(self.failed) from error

    def meet(self, point, where, rule, patient=False):
        """Every rank at the same point before collectives it must start together (stage 3's gathers, zero's
        collective calls): `point` all-reduced as (max, -min) on the check group, 16 bytes at any Nd. A rank
        that waits check_timeout raises, naming `rule`; patient: it is warned and waits on (a rank may come
        late after work of its own, an evaluation on rank 0). A check left pending would pair with the rank's
        next one, so then no collective may start. Returns the lowest and highest point over the ranks."""
        self.refuse_after_failure()  # (not a wait of check_timeout for ranks stuck in the failed one)
        ids = torch.tensor([point, -point], dtype=torch.int64, device=self.flag_device)
        work = dist.all_reduce(ids, op=dist.ReduceOp.MAX, group=self.check_group, async_op=True)  # (max, -min)
        seconds = self.check_timeout.total_seconds()
        late = (f"{where}, but not every rank came to a stage-3 gather or a zero collective call within "
                f"{seconds:g} s: {rule}")
        try:
            if patient:
                self._wait_patiently(work, seconds, late)
            else:
                work.wait(timeout=self.check_timeout)
        except BaseException as e:  # (an interrupt, a timeout): the check may be pending
            self.failed = f"{late} (the check did not end on this rank: restart from the last checkpoint, in new " \
                          f"processes: a model built in this one would meet the pending check)"
            if isinstance(e, RuntimeError):
                raise RuntimeError(late) from e
            raise
        high, low = ids.tolist()
        return -low, high

    def _wait_patiently(self, work, seconds, late):
        """Warn after `seconds`, then wait on. Polled, backing off: on NCCL a wait that times out aborts the
        communicator. (The fake backend's work never says it completed: waited for at once.)"""
        fake, delay, deadline = dist.get_backend(self.check_group) == "fake", 1e-4, time.monotonic() + seconds
        while not fake and not work.is_completed() and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(2 * delay, 0.01)
        if not fake and not work.is_completed():
            warnings.warn(f"{late} (a rank that is only late, after work of its own, needs no change: this one "
                          f"waits on)")
        work.wait()

    def holds_its_parameters(self, module):
        """Whether module's parameters are those laid out here: under torch.func.functional_call they are the
        tensors it swapped in, so a forward reads those (the first forward's learning and checks wait for another)."""
        return all(p in self.index for p in type(module).parameters(module))

    def refuse_after_failure(self):
        if self.failed is not None:
            raise RuntimeError(self.failed)

    def to_flat(self, chunk_of, dtype):
        """(padded_numel,) in CPU memory from every rank's chunk_of(k) (chunk,), made a bucket at a time: an all-gather
        per bucket through one bucket-sized buffer, so the device holds one bucket more at any model size."""
        full = torch.empty(self.padded_numel, dtype=dtype)
        buffer = torch.empty(max(b.chunk for b in self.buckets) * self.nd, dtype=dtype, device=self.device)
        for k in range(len(self.buckets)):
            bucket = buffer[:self.buckets[k].chunk * self.nd]
            self.all_gather(bucket, chunk_of(k), async_op=False)
            full[self.flat_range(k)] = bucket
        return full

    def all_gather_object(self, obj):
        """[every rank's obj], each pickled and broadcast from its rank at its own size: the ranks receive what they
        hold together (dist.all_gather_object pads each to the largest: every rank would receive Nd times that).
        In torch's fake process group, where no data moves, the other ranks' sizes read 0: this rank's alone."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.flag_device)
        sizes = torch.zeros(self.nd, dtype=torch.int64, device=self.flag_device)  # (Nd,): bookkeeping
        sizes[self.rank] = len(data)
        dist.all_reduce(sizes, group=self.group)
        everyone = []
        for rank, size in enumerate(sizes.tolist()):  # one broadcast per rank, of its pickle alone
            if not size:  # (a pickle is never empty)
                continue
            data_r = data if rank == self.rank else torch.empty(size, dtype=torch.uint8, device=self.flag_device)
            dist.broadcast(data_r, group_src=rank, group=self.group)
            everyone.append(pickle.loads(data_r.cpu().numpy().tobytes()))
        return everyone

    def values(self, k):
        """Bucket k's values (chunk * Nd,) as the parameters hold them on this rank, zero-padded."""
        b = self.buckets[k]
        values = torch.zeros(b.chunk * self.nd, dtype=self.params[0].dtype, device=self.device)
        for i, lo, hi in b.segments:
            a = self.offsets[i]
            values[lo - b.start:hi - b.start] = self.params[i].detach().reshape(-1)[lo - a:hi - a]
        return values

    def rank0_values(self, k):
        """A module built whole starts from rank 0's weights, as in DDP: a bucket-sized broadcast."""
        values = self.values(k)
        dist.broadcast(values, group_src=0, group=self.group)
        return values


_CHECK_GROUPS = {}  # data-parallel group -> the group its checks run on (see FlatPartition.meet)


def check_group(group=None):
    """The group meet's checks run on: for a gloo group of all the ranks, one of its own (the first call is every
    rank's collective), so its 16 bytes wait behind no bucket in gloo's two worker threads; else the group. (Not
    for a subgroup: new_group(use_local_synchronization=True) names groups by each rank's count of groups, so
    ranks in different numbers of groups would wait for each other forever.)"""
    group = group or dist.group.WORLD
    if dist.get_backend(group) != "gloo" or dist.get_world_size(group) != dist.get_world_size():
        return group
    if group not in _CHECK_GROUPS:
        _CHECK_GROUPS[group] = dist.new_group(backend="gloo")
    return _CHECK_GROUPS[group]


# -----------------------------------------------------------------------------------------
# Shard-only initialisation: a module built on the meta device is never whole on any rank.
# Bucket by bucket, each rank materialises the modules whose parameters lie in the bucket, has
# init_fn fill them (the same values on every rank: gpt.py seeds each parameter by its name),
# copies the bucket out and frees each module it is done with: at stage 3, its shard and one unit.
class MetaInit:
    def __init__(self, module, partition, init_fn):
        self.partition, self.init_fn, device = partition, init_fn, partition.device
        self.module_names = {m: name or "the root module" for name, m in module.named_modules()}  # (for errors)
        self.sums = []  # per bucket, its values' bits summed as integers (int64, wrapping; see check_ranks_agree)
        self.owner = {}  # parameter -> the first module that holds it (a tied weight has one owner)
        for m in module.modules():
            for p in m.parameters(recurse=False):
                self.owner.setdefault(p, m)
        owns = {m for p, m in self.owner.items() if p.numel()}  # (an empty parameter has nothing to copy out)
        self.last = [segments[-1][0] if segments else -1 for segments in partition.segments_of]  # its last bucket
        # Each parameter moves to the device now, storageless, as the same Parameter object, before
        # any hook is put on it (a hook lives on the tensor that swap_tensors replaces).
        for p in partition.params:
            real = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
            real.__dict__.update(p.__dict__)  # attributes such as gpt.py's tensor-parallel marks
            real.untyped_storage().resize_(0)
            torch.utils.swap_tensors(p, real)
        # created: buffer made here -> its first module, whose init_fn fills it (a shared mask stays one)
        self.materialized, self.created, made = set(), {}, {}
        for m in module.modules():  # buffers are small and every rank keeps them whole
            on_meta = [(name, b) for name, b in m.named_buffers(recurse=False) if b.is_meta]  # (a real one stays)
            for name, b in on_meta:
                if b not in made:
                    made[b] = torch.empty_like(b, device=device)
                    self.created[made[b]] = m
                setattr(m, name, made[b])
            if m not in owns and any(self.created[made[b]] is m for name, b in on_meta):
                self._materialize(m)  # else init_fn fills them with its parameters, bucket by bucket

    def values(self, k):
        """Bucket k's parameter values, padded with zeros, initialised on this rank."""
        part, b = self.partition, self.partition.buckets[k]
        for i, lo, hi in b.segments:
            if self.owner[part.params[i]] not in self.materialized:
                self._materialize(self.owner[part.params[i]])
        values = part.values(k)
        if not values.is_meta:  # (the simulation's values are shapes only)
            self.sums.append(_bit_sum(values).item())
        for i, lo, hi in b.segments:
            if self.last[i] == k:  # done with this parameter: free it (it keeps its shape), whenever its module's
                part.params[i].untyped_storage().resize_(0)  # others come (stages 0-2 lay frozen ones out last)
        return values

    def _materialize(self, m):
        """Storage for m's own parameters, then init_fn(m) fills them. A weight tied to an earlier module
        keeps its values (as if tied after both were built): init_fn(m) fills a scratch copy, dropped."""
        shared = {}
        for name, p in m.named_parameters(recurse=False):
            if self.owner[p] is m:
                p.untyped_storage().resize_(p.numel() * p.element_size())
            else:
                shared[name] = p
                scratch = torch.nn.Parameter(torch.empty_like(p), p.requires_grad)
                scratch.__dict__.update(p.__dict__)
                setattr(m, name, scratch)
        mine = [(name, t) for name, t in m.named_parameters(recurse=False) if name not in shared]
        mine += [(name, t) for name, t in m.named_buffers(recurse=False) if self.created.get(t) is m]
        mine = [(name, t) for name, t in mine if not t.is_meta]  # (meta: no values to check)
        with torch.no_grad():
            for name, t in mine:  # what init_fn leaves unset keeps this value, and is caught below
                t.fill_(_unset_value(t))
        self.materialized.add(m)
        self.init_fn(m)
        replaced = [name for name, t in mine if name in m._parameters and m._parameters[name] is not t]
        if replaced:
            raise ValueError(f"init_fn replaced {replaced} of {self.module_names[m]} ({type(m).__name__}) with new "
                             f"Parameters, but zero.initialize has laid out those it made: fill them in place "
                             f"(nn.init.normal_(m.weight), m.weight.copy_(t) under torch.no_grad())")
        mine = [(name, t) for name, t in mine if getattr(m, name) is t]  # (a buffer registered anew is init_fn's)
        unset = [name for name, t in mine if t.dtype != torch.bool and
                 (t.isnan() if t.is_floating_point() or t.is_complex() else t == _unset_value(t)).any()]
        if unset:
            mha = " (nn.MultiheadAttention has no reset_parameters: fill its in_proj_*)" if isinstance(
                m, torch.nn.MultiheadAttention) else ""
            raise ValueError(f"init_fn left {unset} of {self.module_names[m]} ({type(m).__name__}) unset: init_fn(m) "
                             f"must fill every parameter and buffer m holds itself, those computed in __init__ "
                             f"too{mha}. A value set on purpose that reads as unset (NaN, an integer type's largest) "
                             f"cannot be told apart: register that buffer on a real device in __init__ (it keeps "
                             f"its value there)")
        for name, p in shared.items():
            setattr(m, name, p)

    def check_ranks_agree(self):
        """Each rank computes every bucket's values itself, and init_fn must make them the same on every rank
        (drawn from differing seeds, stage 0's replicas would train apart, and at stages 1-3 each rank's shard
        would hold its own draws): each bucket's bits summed as integers, compared over the ranks once."""
        if not self.sums:  # (simulated on meta: no values)
            return
        part = self.partition
        differ = _differing(part.group, part.flag_device, dict(enumerate(self.sums)))  # {bucket: its sum}
        if differ:
            names = list(dict.fromkeys(part.names[part.params[i]] for i, lo, hi in part.buckets[differ[0]].segments))
            raise ValueError(f"init_fn gave the ranks different values (first in {names[:3]}): it must compute the "
                             f"same values on every rank: seed each parameter by its name, as gpt.py does, or call "
                             f"torch.manual_seed with one seed on every rank before zero.initialize")


def _bit_sum(t):
    """t's elements' bits, each times its position + 1, summed as integers (int64, wrapping), a 0-d tensor on t's
    device: equal values in the same places give equal sums on every rank, exactly (a float sum rounds), and the
    same values in other places (rows drawn in another order) another. An eighth at a time: no t-sized int64 copy."""
    t = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)
    bits = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    total, at = torch.zeros((), dtype=torch.int64, device=t.device), 1
    for c in bits.chunk(8):
        total += (c.long() * torch.arange(at, at + len(c), device=t.device)).sum()
        at += len(c)
    return total


def _unset_value(t):
    """What a tensor init_fn must fill holds before it runs: NaN, an integer type's largest value,
    or False (a bool has no value to tell unset apart: it is at least the same on every rank)."""
    if t.is_floating_point() or t.is_complex():
        return math.nan
    return False if t.dtype == torch.bool else torch.iinfo(t.dtype).max


# -----------------------------------------------------------------------------------------
# Section 5.1 -- P_os: the optimizer updates only this rank's part of the flat space, as "pieces":
# each trainable parameter's part in an owned range, a 1-D view into the fp32 master (or the parameters).
# Stage 0 owns every bucket whole (own space = flat space), stages 1-3 their chunks. Per-rank: KΨ/Nd.
@dataclass
class Piece:
    index: int  # the parameter's index in the partition
    flat: slice  # where it lies in the flat space (None: not in one stretch there)
    own: slice  # where it lies in this rank's own space


def _refuse_foreach(foreach, device):
    """torch's clip functions raise this where foreach=True meets a device without foreach kernels."""
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")


def _norm(grad, norm_type, foreach=None):
    """A gradient's norm by the kernel clip_grad_norm_ picks: _foreach_norm or vector_norm (bits differ on CUDA)."""
    _refuse_foreach(foreach, grad.device)
    if foreach or foreach is None and _has_foreach_support([grad], grad.device):
        return torch._foreach_norm([grad], norm_type)[0]
    return torch.linalg.vector_norm(grad, norm_type)


class _PieceStates(dict):
    """optim.state, keyed by this rank's pieces: a new one gets {} as in torch.optim, a model parameter raises."""

    def __init__(self, names, states):
        super().__init__(states)
        self.names = names

    def __missing__(self, key):
        if key in self.names:
            raise KeyError(f"{self.names[key]} is a model parameter, but optimizer.state is keyed by pieces of this "
                           f"rank's shard: zero.full_optimizer_state(model)[{self.names[key]!r}] gathers it whole, "
                           f"once a step has made it (a collective)")
        self[key] = {}
        return self[key]


class ZeroOptimizer(torch.optim.Optimizer):
    """Steps the parameters (5.1, 5.3) from the gradient buckets (5.2). A torch.optim.Optimizer for LR schedulers,
    never __init__ed: `optim`, the torch optimizer over this rank's pieces, holds the groups and state."""

    def __init__(self, module, partition, parameters, gradients, precision, loss_scale, start,
                 optimizer_class, param_groups, optimizer_kwargs, tp_group):
        self.partition, self.parameters, self.gradients = partition, parameters, gradients
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.precision = precision
        # owned: per bucket, (flat slice, own slice); stage 0 (replicate) owns every bucket whole
        self.owned = owned = [(partition.flat_range(k), partition.flat_range(k)) if gradients.replicate else
                              (partition.chunk(k), partition.own(k)) for k in range(len(partition.buckets))]
        self.own_numel = sum(o.stop - o.start for f, o in owned)
        self.n_trainable = gradients.n_trainable
        # A parameter's pieces in consecutive buckets lie end to end in own space: where the optimizer steps
        # own-space tensors (fp32 master, stage 3's shard) they merge into one per parameter.
        merge = precision.master_dtype is not None or parameters.in_own_space
        self.pieces = []
        for (f, o), b in zip(owned, partition.buckets):
            for i, lo, hi in b.segments if b.trainable else ():
                lo, hi = max(lo, f.start), min(hi, f.stop)
                if lo >= hi:
                    continue
                own = slice(o.start + lo - f.start, o.start + hi - f.start)
                last = self.pieces[-1] if self.pieces else None
                if last and last.index == i and last.own.stop == own.start and (merge or last.flat.stop == lo):
                    flat = slice(last.flat.start, hi) if last.flat and last.flat.stop == lo else None
                    self.pieces[-1] = Piece(i, flat, slice(last.own.start, own.stop))
                else:
                    self.pieces.append(Piece(i, slice(lo, hi), own))
        # start(k): bucket k's starting values (rank 0's, or from meta); the fp32 master copies its ranges uncast
        self.master = torch.empty(self.own_numel, dtype=precision.master_dtype, device=partition.device) \
            if precision.master_dtype else None
        self.weights_dtype = precision.master_dtype or precision.param_dtype  # the optimizer's weights and states
        for k, (f, o) in enumerate(owned):
            values = start(k)
            parameters.load(k, values)
            if self.master is not None:
                b = partition.buckets[k]
                self.master[o].copy_(values[f.start - b.start:f.stop - b.start])
        parameters.bind()
        self.weights = [self.master[p.own] if self.master is not None else parameters.owned(p.flat, p.own)
                        for p in self.pieces]
        groups = param_groups if param_groups is not None else [{"params": list(module.parameters())}]
        piece_groups = []
        for g in groups:
            members = {partition.index[p] for p in g["params"]}
            piece_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                 "params": [w for w, p in zip(self.weights, self.pieces) if p.index in members]})
        self.optim = optimizer_class(piece_groups, **optimizer_kwargs)
        self.group_members = [list(g["params"]) for g in groups]  # the user's groups, for checkpoints
        self.names = partition.names
        self.optim.state = _PieceStates(self.names, self.optim.state)
        self.param_groups, self.defaults, self.state = self.optim.param_groups, self.optim.defaults, self.optim.state
        self.module = weakref.ref(module)  # (which holds this optimizer: no cycle)
        # step() updates a window of pieces at a time, at most a bucket (C_B) of own space (or one piece): its
        # gradient copy and the optimizer's temporaries exist for a window, not 4Ψ/Nd bytes each (sub_group_size).
        window, self.windows = max(b.chunk for b in partition.buckets) * partition.nd, []
        for piece, w in zip(self.pieces, self.weights):
            if not self.windows or piece.own.stop - self.windows[-1][0][0].own.start > window:
                self.windows.append([])
            self.windows[-1].append((piece, w))
        if loss_scale is None and precision.param_dtype == torch.float16:
            loss_scale = DynamicLossScale()
        # a number: a static scale, never grown or backed off (a step that overflows is still skipped)
        self.static_scale = isinstance(loss_scale, (int, float))
        self.scaler = DynamicLossScale(loss_scale, growth_interval=2**62, backoff_factor=1.0, min_scale=0.0) \
            if self.static_scale else loss_scale
        self.loss_scale = _fp32(self.scaler.init_scale) if self.scaler else 1.0
        gradients.require_scaled_backward = self.scaler is not None
        self.clean_steps, self.norm_plan = 0, None
        self.zero_grad()
        self.versions = [p._version for p in partition.params]  # what _written_since_step compares with
        # torch.optim.Optimizer's hook registries: register_step_pre_hook/post_hook run around step()
        for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                     "load_state_dict_post"):
            setattr(self, f"_optimizer_{kind}_hooks", collections.OrderedDict())
        self._patch_step_function()

    # GradScaler.step then sets grad_scale and found_inf instead of unscaling p.grad (None here): step() refuses
    _step_supports_amp_scaling = True

    def add_param_group(self, param_group):
        raise RuntimeError("zero.initialize lays out every parameter's shard once: pass all the groups to it as "
                           "param_groups=[{'params': [...], **options}, ...]")

    def backward(self, loss):
        """loss.backward(), scaled by the loss scale when fp16 loss scaling is on."""
        self.gradients.scaled_backward = True
        try:
            (loss.float() * self.loss_scale if self.scaler else loss).backward()
        finally:
            self.gradients.scaled_backward = False

    def _reduce(self):
        """The step's gradients reduced, and whether any rank's overflowed. Once per step."""
        if self.gradients.finished:
            return
        if self.gradients.stepped:
            raise RuntimeError("step() has used and freed this step's gradients: call optimizer.zero_grad() and run "
                               "the next backward before clip_grad_norm_() or step()")
        unfrozen = [self.names[p] for p in self.partition.params[self.n_trainable:] if p.requires_grad]
        if unfrozen:
            raise RuntimeError(f"{unfrozen[:3]} had requires_grad=False at zero.initialize, which laid out gradients "
                               f"and states for trainable ones only: set requires_grad=True before zero.initialize")
        self.gradients.finish()
        self.overflow = False
        if self.scaler:  # (reading the flag waits for the device: only with loss scaling)
            # this rank's reduced chunks, one at a time (C_B): an inf or NaN in any rank's gradient is in its owner's
            # sum, and the flag's all-reduce tells every rank
            finite = torch.ones((), dtype=torch.bool, device=self.gradients.reduced.device)
            for chunk in self.gradients.reduced_chunks:
                if chunk is not None:
                    finite &= chunk.isfinite().all()
            found_inf = (~finite).float()
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.partition.group)  # a scalar: any rank's
            if self.tp_group:  # and any tp slice's: every tp rank skips the same steps
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.tp_group)
            self.overflow = bool(found_inf)

    def _grad(self, own, last=False):
        """This rank's averaged gradient over slice `own` of its own space, in the optimizer's dtype, unscaled
        and clipped: a view of the reduced gradient, copied first where it is changed and read again (not `last`)."""
        grad = self.gradients.own(own, self.weights_dtype)
        if (self.scaler or self.clips) and grad._is_view() and not last:  # clipping reads it again
            grad = grad.clone()
        if self.scaler:  # times the scale's reciprocal, as GradScaler.unscale_: the fp32 scale inverted in fp64
            grad.mul_(torch.tensor(self.loss_scale, dtype=torch.float32).double().reciprocal().float().item())
        for clip in self.clips:  # (one per clip call this step, in call order)
            clip(grad)
        return grad

    def clip_grad_value_(self, clip_value, foreach=None):
        """torch.nn.utils.clip_grad_value_, bit for bit: each rank clamps its own part (foreach changes no bit)."""
        clip_value = float(clip_value)
        _refuse_foreach(foreach, self.partition.device)
        if self.gradients.micro_batches > 0:  # (no backward yet: nothing to clip)
            self._reduce()
            self.clips.append(lambda grad: grad.clamp_(-clip_value, clip_value))

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch.nn.utils.clip_grad_norm_, bit for bit: every gradient times min(1, max_norm / (norm + 1e-6)).
        torch's norm sums in an order set by the tensor's length, so a split gradient goes whole to one "norm
        rank" (about Ψ/Nd elements sent a rank). With a tp_group, the whole model's norm (Megatron's rule)."""
        max_norm, norm_type = float(max_norm), float(norm_type)  # as torch takes them (a tensor max_norm too)
        if self.gradients.micro_batches == 0:  # no backward yet: 0, nothing to clip
            return torch.zeros((), dtype=self.weights_dtype, device=self.partition.device)
        self._reduce()
        used = self.gradients.read_flags()
        like = torch.empty(0, dtype=self.weights_dtype, device=self.partition.device)
        norms = like.new_zeros(self.n_trainable)
        if self.gradients.replicate:  # every gradient is whole here, in flat order (stage 0)
            for i in range(self.n_trainable):
                a = self.partition.offsets[i]
                norms[i] = _norm(self._grad(slice(a, a + self.partition.params[i].numel())), norm_type, foreach)
        else:
            wholes = {}  # parameter index -> [its whole gradient, elements filled], round by round
            for rnd in self._norm_plan():
                self._norms_of_round(*rnd, like, norms, wholes, norm_type, foreach)
            dist.all_reduce(norms, group=self.partition.group)  # (n_trainable,): each found on one rank
        with_grad = [i for i in range(self.n_trainable) if used[i]]
        norms = [norms[i] for i in with_grad]
        if self.tp_group:
            total = self._tp_norm(norms, [self.partition.params[i] for i in with_grad], norm_type)
        else:
            total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else like.new_zeros(())
        if error_if_nonfinite and not total.isfinite():  # (the same total on every rank: all raise)
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               f"so it cannot be clipped. To disable this error and scale the gradients by the "
                               f"non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self.clips.append(lambda grad: grad.mul_(coef))  # step() multiplies by it
        return total

    def _tp_norm(self, norms, params, norm_type):
        """The norm over every tp rank's slices: split parameters count on each, replicated ones on tp rank 0 only."""
        if norm_type == 0:
            raise ValueError("clip_grad_norm_(norm_type=0) counts parameters with a nonzero gradient, which "
                             "tensor-parallel slices cannot add up to: clip by norm_type 2")
        first = dist.get_rank(self.tp_group) == 0
        mine = [n for n, p in zip(norms, params) if getattr(p, "tensor_model_parallel", False) or first]
        # none here (only replicated parameters, on tp rank > 0): no term
        mine = torch.stack(mine) if mine else torch.zeros(0, dtype=self.weights_dtype, device=self.partition.device)
        if norm_type in (math.inf, -math.inf):  # the largest (smallest) norm of any slice, norms being >= 0
            part = torch.cat([mine, mine.new_tensor([0.0 if norm_type > 0 else math.inf])])  # (the identity)
            sign = 1.0 if norm_type > 0 else -1.0  # (min = -max of the negated)
            # (2,): the largest, and whether a rank's is NaN (a backend's max may drop a NaN, torch's norm is NaN)
            both = torch.stack([sign * (part.max() if norm_type > 0 else part.min()), part.isnan().any().to(part)])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.tp_group)
            return torch.where(both[1] > 0, math.nan, sign * both[0])
        part = (mine ** norm_type).sum()
        dist.all_reduce(part, group=self.tp_group)
        return part ** (1.0 / norm_type)

    def _norm_plan(self):
        """Rounds of transfers bringing each gradient whole to its norm rank (the one holding all of it, else the
        least loaded), a bucket's worth of every norm rank at a time. Per round, in rank order: slices sent, elements
        per rank, pieces received (parameter, start, length), elements per rank; then whether anything moves."""
        if self.norm_plan is not None:
            return self.norm_plan
        part, me = self.partition, self.partition.rank

        def quarter(k, lo, hi, j, q):  # quarter q of rank j's piece of flat [lo, hi) in bucket k (a >= z: none)
            a, z = max(lo, part.chunk(k, j).start), min(hi, part.chunk(k, j).stop)
            return a + (z - a) * q // 4, a + (z - a) * (q + 1) // 4
        norm_rank, load = [], [0] * part.nd
        for i in range(self.n_trainable):
            holders = [part.holders(k, lo, hi) for k, lo, hi in part.segments_of[i]]
            if holders and all(r == range(holders[0].start, holders[0].start + 1) for r in holders):
                norm_rank.append(holders[0].start)  # one rank holds all of it
            else:
                norm_rank.append(min(range(part.nd), key=lambda j: (load[j], j)))
            load[norm_rank[i]] += part.params[i].numel()
        # windows[r]: rank r's segments (bucket, parameter, flat start, end), a full bucket's worth. A gradient that
        # would not end in the window it starts in starts a new one, so a window holds at most one gradient that
        # goes on past it or came from before: a norm rank fills that one and at most a window of others at once.
        full = max(b.chunk for b in part.buckets) * part.nd
        windows, room = [[] for _ in range(part.nd)], [0] * part.nd
        for k, b in enumerate(part.buckets):
            for i, lo, hi in b.segments if b.trainable else ():
                r = norm_rank[i]
                if lo == part.offsets[i] and room[r] < part.params[i].numel():
                    room[r] = 0
                while lo < hi:  # cut where rank r's window is full
                    if room[r] == 0:
                        windows[r].append([])
                        room[r] = full
                    cut = min(hi, lo + room[r])
                    windows[r][-1].append((k, i, lo, cut))
                    room[r], lo = room[r] - (cut - lo), cut
        # Window t of every norm rank travels in four rounds, a quarter of each sender's piece in each: a rank
        # receives at most a quarter bucket a round; it sends its parts of every norm rank's window, a quarter
        # bucket where windows and buckets line up (at most 2.7 quarters in a random search of layouts at Nd 3-64).
        self.norm_plan = []
        for t in range(max(len(w) for w in windows)):
            window = [w[t] if t < len(w) else [] for w in windows]  # every norm rank's window t
            moves = any(part.holders(k, lo, hi) != range(r, r + 1)  # any piece not on its norm rank already
                        for r in range(part.nd) for k, i, lo, hi in window[r])
            for q in range(4):  # what this rank sends and receives, in rank order, and how much per rank
                slices, pieces, send_splits, receive_splits = [], [], [0] * part.nd, [0] * part.nd
                for j in range(part.nd):
                    for k, i, lo, hi in window[j]:  # my piece of rank j's window, to j
                        a, z = quarter(k, lo, hi, me, q)
                        if a < z:
                            at = part.buckets[k].own - part.chunk(k).start  # flat -> own space
                            slices.append(slice(at + a, at + z))
                            send_splits[j] += z - a
                    for k, i, lo, hi in window[me]:  # rank j's piece of my window, to me
                        a, z = quarter(k, lo, hi, j, q)
                        if a < z:
                            pieces.append((i, a - part.offsets[i], z - a))
                            receive_splits[j] += z - a
                self.norm_plan.append((slices, send_splits, pieces, receive_splits, moves))
        return self.norm_plan

    def _norms_of_round(self, slices, send_splits, pieces, receive_splits, moves, like, norms, wholes, norm_type,
                        foreach):
        part = self.partition
        send = torch.cat([self._grad(s) for s in slices]) if slices else like
        if moves:
            # all-to-all: each gradient's pieces to its norm rank -> (Σ receive_splits,) here, by source rank
            received = like.new_empty(sum(receive_splits))
            dist.all_to_all_single(received, send, receive_splits, send_splits, group=part.group)
        else:  # every piece is on its norm rank already
            received = send
        x = 0
        for i, at, n in pieces:
            if i not in wholes:  # (not setdefault, which would make a whole gradient for every piece)
                wholes[i] = [like.new_empty(part.params[i].numel()), 0]
            wholes[i][0][at:at + n] = received[x:x + n]
            wholes[i][1], x = wholes[i][1] + n, x + n
            if wholes[i][1] == part.params[i].numel():  # all of it is here; freed once its norm is taken
                norms[i] = _norm(wholes.pop(i)[0], norm_type, foreach)

    def step(self, closure=None):
        """Update this rank's part and make the parameters whole again; False where an fp16 overflow skipped it."""
        if closure is not None:
            raise TypeError("step() takes no closure: run the forward and backward (optimizer.backward(loss) for fp16) "
                            "before optimizer.step()")
        if hasattr(self, "found_inf"):  # set by torch.amp.GradScaler.step (see _step_supports_amp_scaling)
            del self.grad_scale, self.found_inf  # (GradScaler deletes them only after a step that returns)
            raise RuntimeError("torch.amp.GradScaler cannot see zero's gradients (p.grad stays None): drop it, pass "
                               "loss_scale=zero.DynamicLossScale(growth_interval=2000, min_scale=0.0) to "
                               "zero.initialize and call optimizer.backward(loss), which scales as GradScaler does")
        self._refuse_differing_writes()  # (before the versions are recorded anew)
        self._refuse_lost_writes(record=True)
        self._reduce()
        self.gradients.stepped = True  # this step's gradients are used: the next backward needs zero_grad()
        if self.overflow:  # (loss scaling only) skipped on every rank, the scale backed off
            s = self.scaler
            self.loss_scale, self.clean_steps = _fp32(max(self.loss_scale * s.backoff_factor, s.min_scale)), 0
            self._free_grads()
            return False
        used = self.gradients.read_flags()
        for window in self.windows:  # each piece steps once, on its own state: the bits of one whole step
            lo, hi = window[0][0].own.start, window[-1][0].own.stop
            grads = self._grad(slice(lo, hi), last=True)
            for piece, w in window:
                w.grad = grads[piece.own.start - lo:piece.own.stop - lo] if used[piece.index] else None
            self.optim.step()  # (skips the pieces with no gradient: those of other windows)
            for piece, w in window:
                w.grad = None
            del grads  # freed before the next window's is made
        self._free_grads()
        if self.scaler:  # grown after growth_interval clean steps, once this step's gradients are unscaled
            self.clean_steps += 1
            # (>: counted under a longer interval, then resumed; an interval below 1 never grows, as in GradScaler)
            if 0 < self.scaler.growth_interval <= self.clean_steps:
                grown = _fp32(self.loss_scale * self.scaler.growth_factor)
                self.loss_scale = grown if math.isfinite(grown) else self.loss_scale  # (as GradScaler)
                self.clean_steps = 0
        if self.master is not None:  # fp32 master -> the 16-bit parameters
            self.parameters.copy_owned(self.owned, self.master)
        self._count_writes([p for p, u in zip(self.partition.params, used) if u])
        self.parameters.after_step()
        return True

    def _count_writes(self, params):
        """Each parameter written (by a step, a load) goes up a version, as with torch.optim, so that a backward through
        a graph saved before raises ("modified by an inplace operation"). Recorded anew: not a user's write."""
        torch.autograd.graph.increment_version(params)
        self.versions = [p._version for p in self.partition.params]

    def _written_since_step(self, record=True):
        """Parameters written in place (p.clamp_()) since the last step, initialize or load_checkpoint, their versions
        recorded anew if `record`. zero's own writes change no version; one through p.data is unseen."""
        versions = [p._version for p in self.partition.params]
        written = [self.names[p] for p, a, b in zip(self.partition.params, self.versions, versions) if a != b]
        if record:
            self.versions = versions
        return written

    def _refuse_lost_writes(self, record=False):
        """Before step() or a call that reads the weights (full_state_dict, save_checkpoint): wait for stages 1-2's
        all-gather, then refuse what the step would lose: a parameter registered after zero.initialize or given new
        storage, an in-place write (WGAN's p.clamp_()) where the weights stepped are an fp32 master or stage 3's
        shard. Only step() records the versions anew (record=True): after the other calls the step still raises."""
        self.parameters.wait()  # stages 1-2: last step's all-gather, if no forward waited for it
        module = self.module()
        # (a parameter another zero model laid out is stepped by that model's optimizer)
        added = [n for n, p in module.named_parameters() if p.requires_grad and p not in self.partition.index
                 and not getattr(p, "_zero_laid_out", False)] if module is not None else []
        if added:
            raise RuntimeError(f"rank {self.partition.rank}: {added[:3]} were registered after zero.initialize, so the "
                               f"step would not update them: add layers and parametrize before zero.initialize")
        moved = [self.names[p] for p in self.partition.params if not self.parameters.holds(p)]
        if moved:
            raise RuntimeError(f"rank {self.partition.rank}: {moved[:3]} got storage outside zero's buffers (p.data = "
                               f"t, vector_to_parameters), so the step would not update them: set the values before "
                               f"zero.initialize, or between steps write in place (p.copy_(t)) at stages 0-2 in fp32")
        written = self._written_since_step(record)
        if written and self.parameters.in_own_space:
            self.parameters.refill_stand_ins()
        if written and (self.master is not None or self.parameters.in_own_space):
            why = (f"the step would overwrite them with the fp32 master weights (param_dtype="
                   f"{self.precision.param_dtype})" if self.master is not None else
                   "at stage 3 a parameter holds this rank's values only as its shard, which such a write misses")
            raise RuntimeError(f"rank {self.partition.rank}: {written[:3]} were written in place since the last "
                               f"step, but {why}: set the values before zero.initialize, restore them with "
                               f"zero.load_checkpoint, or write them between steps, the same on every rank, at "
                               f"stages 0-2 without param_dtype")

    def _refuse_differing_writes(self):
        """Where in-place writes are kept (stages 0-2 without param_dtype), every rank must write the same: a flag per
        parameter some rank wrote since the step (all-reduced), then their values' sums compared (16 bytes each).
        max_norm (F.embedding's) writes the rows a rank looked up: stage 0's copies would part, and at stages 1-2 the
        all-gather after step() keeps each row's owner's values."""
        if self.master is not None or self.parameters.in_own_space:  # (refused apart: see _refuse_lost_writes)
            return
        part, mine = self.partition, set(self._written_since_step(record=False))
        flags = torch.tensor([self.names[p] in mine for p in part.params], dtype=torch.int32, device=part.flag_device)
        part.wait(part.start(dist.all_reduce, flags, op=dist.ReduceOp.MAX))  # (parameters,)
        written = {self.names[p]: _bit_sum(p.detach()).item() for p, f in zip(part.params, flags.tolist()) if f}
        differ = _differing(part.group, part.flag_device, written) if written else []
        refused = len(differ)
        if self.tp_group:  # where any rank of the (dp, tp) mesh refuses, every rank raises (see _all_ranks_call)
            refused = torch.tensor([refused], device=part.flag_device)
            dist.all_reduce(refused, op=dist.ReduceOp.MAX, group=self.tp_group)
            refused = refused.item()
        if refused:
            what = differ[:3] if differ else "parameters of another tensor-parallel slice"
            raise RuntimeError(f"rank {part.rank}: {what} were written in place since the last step, but not the same "
                               f"on every rank (F.embedding with max_norm writes the rows each rank looked up), so "
                               f"the ranks' weights would part: write the same values on every rank, or scale out of "
                               f"place (max_norm=None)")

    def _free_grads(self):
        """The step's gradients are used (or dropped): the next step reduces and clips anew."""
        for w in self.weights:
            w.grad = None
        self.gradients.finished, self.clips = False, []

    def zero_grad(self, set_to_none=True):
        if not set_to_none:
            raise ValueError("zero_grad(set_to_none=False) would keep zeroed p.grad tensors, but p.grad stays None at "
                             "every stage (the gradients live in zero's buffers): call optimizer.zero_grad()")
        self._free_grads()
        self.parameters.end_raised_forward()  # (a KeyboardInterrupt's; see there)
        self.gradients.zero_grad()
        self.overflow = False

    def state_dict(self):
        raise RuntimeError("the optimizer's state is zero's (sharded over the ranks from stage 1 on): save it with "
                           "zero.save_checkpoint(path, model, optimizer)")

    def __reduce_ex__(self, protocol):  # torch.save(optimizer), pickle, copy
        self.state_dict()

    def load_state_dict(self, state_dict):
        raise RuntimeError("the optimizer's state is zero's (sharded over the ranks from stage 1 on): restore it "
                           "with zero.load_checkpoint(path, model, optimizer)")

    def wait_params(self):
        """Stages 1-2: wait for the all-gather step() left in flight (other stages: nothing to wait for)."""
        self.parameters.wait()

    # Full tensors, in CPU memory, for export (gathered; not on the training path).
    def _to_flat(self, key):
        """The weights ("weights") or optimizer state `key`, whole: every rank's chunks, a bucket at a time."""
        return self.partition.to_flat(lambda k: self._saved_chunk(key, k), self.weights_dtype)

    # For checkpoints: this rank's shard, read and written through its own space.
    def _all_states(self):
        """(elementwise state keys, {name: other states, e.g. AdamW's step}, {name: its elementwise keys}) for
        every parameter with state, alike on every rank. A parameter's pieces step together, so the rank with
        its first element speaks for it: O(parameters) bytes gathered, whatever Nd (at stage 3 rank 0 speaks for
        the first parameters of every unit: see FlatPartition.all_gather_object)."""
        part, scalars, keys_of = self.partition, {}, {}
        for piece, w in zip(self.pieces, self.weights):
            state = self.optim.state.get(w, {})
            elementwise = {key for key, v in state.items() if torch.is_tensor(v) and v.shape == w.shape}
            k, lo, hi = part.segments_of[piece.index][0]
            if state and part.holders(k, lo, lo + 1).start == part.rank:
                name = self.names[part.params[piece.index]]
                scalars[name] = {key: v for key, v in state.items() if key not in elementwise}
                keys_of[name] = sorted(elementwise)
        everyone = part.all_gather_object((scalars, keys_of))
        scalars = {n: v for s, _ in everyone for n, v in s.items()}
        keys_of = {n: v for _, ks in everyone for n, v in ks.items()}
        return sorted(set().union(*keys_of.values())), scalars, keys_of

    def own_chunk(self, k):
        """Where this rank's chunk of bucket k lies in its own space (stage 0: own space is the flat space)."""
        return self.partition.chunk(k) if self.gradients.replicate else self.partition.own(k)

    def _saved_chunk(self, key, k):
        """This rank's chunk of bucket k of the weights (fp32 master, else parameters) or of optimizer state `key`
        (zeros where no piece has it)."""
        part, s = self.partition, self.own_chunk(k)
        if key == "weights":
            return self.master[s] if self.master is not None else self.parameters.owned(part.chunk(k), s)
        own = torch.zeros(s.stop - s.start, dtype=self.weights_dtype, device=part.device)
        i = max(bisect.bisect_right(self.pieces, s.start, key=lambda piece: piece.own.start) - 1, 0)
        while i < len(self.pieces) and self.pieces[i].own.start < s.stop:
            piece, state = self.pieces[i], self.optim.state.get(self.weights[i], {})
            lo, hi = max(s.start, piece.own.start), min(s.stop, piece.own.stop)
            if key in state and lo < hi:
                own[lo - s.start:hi - s.start] = state[key][lo - piece.own.start:hi - piece.own.start]
            i += 1
        return own


# -----------------------------------------------------------------------------------------
# Section 5.2 -- P_os+g: gradient buckets, reduced during backward.
# A bucket is reduced once all its gradients are in, in the order backward fills them (flat order reversed until a
# step has shown it on rank 0), one in flight while backward computes the next. Stages 0-1 keep the full gradient
# (4Ψ in fp32, the buckets views into it); stages 2-3 only the reduced chunks (4Ψ/Nd), each bucket living until it
# is reduced. Each micro-batch's backward is reduced on its own and added to the sum so far.
class GradientBuckets:
    def __init__(self, partition, precision, keep_full, replicate, on_grad, on_backward_end, name):
        """keep_full: stages 0-1; replicate: stage 0 (see finish). on_grad, on_backward_end: the parameters' hooks."""
        self.partition, self.precision, self.replicate, self.name = partition, precision, replicate, name
        self.reached = None  # find_unused_parameters: the parameters the graph of forward reaches (see walk_graph)
        self.on_grad, self.on_backward_end = on_grad, on_backward_end
        self.n_trainable = sum(p.requires_grad for p in partition.params)
        device, trainable_flat = partition.device, partition.trainable_own * partition.nd
        # for the trainable parameters only: the prefix of the flat space (stages 0-1) or of own space they lie in
        self.full = torch.zeros(trainable_flat, dtype=precision.param_dtype, device=device) if keep_full else None
        # reduced chunks: in the full gradient where it has the reduce dtype, else a flat (stage 0) or own-space buffer
        in_full = keep_full and precision.reduce_dtype == precision.param_dtype
        self.reduced = self.full if in_full else torch.zeros(
            trainable_flat if replicate else partition.trainable_own, dtype=precision.reduce_dtype, device=device)
        self.reduced_chunks = [self.reduced[partition.chunk(k) if in_full or replicate else partition.own(k)]
                               if b.trainable else None for k, b in enumerate(partition.buckets)]
        self.order = [k for k, b in enumerate(partition.buckets) if b.trainable]  # reduced from its end
        self.order_agreed, self.order_seen, self.first_filled = False, False, None  # (see _agree_on_order)
        self.require_scaled_backward, self.scaled_backward, self.in_backward = False, False, False
        # the hook holds this object weakly: Python's collector cannot see a cycle through C++
        for p in partition.params[:self.n_trainable]:
            p.register_post_accumulate_grad_hook(functools.partial(_call_weakly, weakref.WeakMethod(self.grad_ready)))

    def storages(self):
        return [t for t in (self.full, self.reduced) if t is not None]

    def zero_grad(self):
        if self.in_backward:  # a backward that raised never reached its end: end it, dropping its gradients
            if self.for_params:  # every rank starts the reductions it has not, in the order, to pair with those
                self._reduce_the_rest()  # a rank further along started (a layer only it used)
            for k, (work, *_) in self.in_reduction:
                self.partition.wait(work)  # its send buffer may be the full gradient, which the next backward writes
            self.on_backward_end()  # stage 3: the groups it gathered are freed, its counts reset
        for p in self.partition.params:
            p.grad = None
        self.micro_batches, self.used_so_far, self.used_flags = 0, [False] * self.n_trainable, []
        self.finished, self.stepped = False, False  # finished: reduced by a clip or step(); stepped: step() used them
        self._new_backward()

    def read_flags(self):
        """Wait for each backward's flags: the parameters some rank used, and whether rank 0 filled every bucket.
        Returns which parameters some rank used in some backward of this step."""
        for work, used in self.used_flags:
            self.partition.wait(work)
            *flags, seen = used.bool().tolist()
            self.used_so_far = [u or v for u, v in zip(self.used_so_far, flags)]
            self.order_seen = self.order_seen or seen
        self.used_flags = []
        return self.used_so_far

    def _new_backward(self):
        self.used = [False] * self.n_trainable  # this rank's gradient arrived, this backward
        self.pending = [len(b.segments) for b in self.partition.buckets]  # gradients still to come, per bucket
        self.filled = []  # the buckets whose last gradient came, in that order
        self.skipped = set()  # parameters taken as getting no gradient in this backward (see _skip_unreached)
        self.temporary, self.in_reduction = {}, []  # in_reduction: reductions not yet finished
        self.next = len(self.order) - 1
        self.in_backward, self.for_params = False, True  # (True: step() without a backward reduces zeros)

    def _bucket(self, k):
        """Where bucket k's gradients go: the full gradient in a step's first backward (stages 0-1), else its own."""
        if self.full is not None and self.micro_batches == 0:
            return self.full[self.partition.flat_range(k)]
        if k not in self.temporary:  # empty: every element is written (a gradient, zeros, padding)
            b = self.partition.buckets[k]
            self.temporary[k] = torch.empty(b.chunk * self.partition.nd, dtype=self.precision.reduce_dtype,
                                            device=self.reduced.device)
            self.temporary[k][b.numel:].zero_()
        return self.temporary[k]

    def begin(self, for_params=True):
        """At a backward's first hook (stage 3: first pre-backward) and at each gradient. A backward with no
        parameter's gradient (stage 3's autograd.grad(loss, x)) reduces nothing and is no micro-batch, as in DDP."""
        if not self.in_backward:
            Variable._execution_engine.queue_callback(self._finish_backward)
            self.in_backward, self.for_params = True, False
        if not for_params or self.for_params:
            return
        self.for_params = True  # (also when a gradient comes after all, as from a reentrant checkpoint's backward)
        if self.finished:  # it would miss the clip (and stage 0's all-gather)
            raise RuntimeError("backward after optimizer.clip_grad_norm_() (or clip_grad_value_()) in the same step: "
                               "clip after the step's last backward, just before step()")
        if self.stepped:  # its sum would be added to the gradients the step has used
            raise RuntimeError(f"backward reached {self.name}'s parameters after its optimizer.step() without "
                               f"optimizer.zero_grad(): zero the gradients after each step, also before another "
                               f"model's loss backpropagates through this one. A wrapper made after zero.initialize "
                               f"(torch.compile's) clears only p.grad, which zero leaves None: "
                               f"call optimizer.zero_grad()")
        if self.require_scaled_backward and not self.scaled_backward:
            raise RuntimeError(f"with fp16 loss scaling, call optimizer.backward(loss) instead of loss.backward(); "
                               f"where it is another model's optimizer.backward(loss) reaching {self.name}'s "
                               f"parameters, freeze {self.name} for it (requires_grad_(False)): its gradients would "
                               f"carry the other loss scale")
        self._skip_unreached()  # (after the checks: a backward refused has started no collective)

    def walk_graph(self, out):
        """find_unused_parameters=True, after each forward of the whole module (DDP's walk): add the trainable
        parameters its output's graph reaches. A reentrant checkpoint builds its graph in backward: then all count."""
        nodes = [get_gradient_edge(t).node for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                 and t.requires_grad]
        if not nodes:  # (a forward under no_grad)
            return
        part, reached, seen = self.partition, self.reached or set(), set(nodes)
        while nodes:
            node = nodes.pop()
            if node.name() == "CheckpointFunctionBackward":
                reached.update(range(self.n_trainable))
                break
            if getattr(node, "variable", None) in part.index:  # an AccumulateGrad node: a leaf's
                reached.add(part.index[node.variable])
            new = [n for n, _ in node.next_functions if n is not None and n not in seen]
            seen.update(new)
            nodes += new
        self.reached = reached

    def _skip_unreached(self):
        """At a backward's start, the parameters it cannot reach contribute zeros now, so that later buckets in the
        order are reduced as they fill, not held to backward's end (stages 2-3: up to the whole gradient): those frozen
        after zero.initialize, and (find_unused_parameters=True) those the walks since the last backward missed."""
        reached, self.reached = self.reached, None
        for i, p in enumerate(self.partition.params[:self.n_trainable]):
            if not p.requires_grad or reached is not None and i not in reached:
                self._skip(i)
        self._reduce_ready_buckets()

    def _skip(self, i):
        """Parameter i gets no gradient in this backward: its segments are zeros, written as each bucket is reduced."""
        self.skipped.add(i)
        for k, lo, hi in self.partition.segments_of[i]:
            self._one_more_in(k)

    def grad_ready(self, p):
        if p.grad is None:  # frozen after the forward that read it: torch accumulates nothing but calls the hook
            self.begin(for_params=False)
            self.on_grad(p)
            return
        self.begin()
        part, i = self.partition, self.partition.index[p]
        if i in self.skipped:  # (find_unused_parameters: its bucket may be reduced already)
            raise RuntimeError(f"parameter {self.partition.names[p]} got a gradient though the graph of the forward "
                               f"output did not reach it, so find_unused_parameters=True took it as unused: it is "
                               f"read outside the forward (a loss reading model.head.weight): return what the loss "
                               f"needs from the forward; or this backward is of a forward run before the previous "
                               f"backward (micro-batches in flight at once), whose walk that backward used up: "
                               f"there, use find_unused_parameters=False")
        if self.used[i]:  # its bucket may be reduced already: the second part would be lost
            raise RuntimeError(f"parameter {self.partition.names[p]} got a gradient twice in one backward: a "
                               f"module called more than once inside torch.utils.checkpoint(use_reentrant=True) (or "
                               f"used inside and outside it); use use_reentrant=False (or "
                               f"zero.checkpoint_activations). "
                               f"Or an earlier backward raised and was not ended: call optimizer.zero_grad() after it")
        if p.grad.layout != torch.strided:
            raise RuntimeError(f"parameter {self.partition.names[p]} got a sparse gradient (nn.Embedding with "
                               f"sparse=True): ZeRO's buckets are dense; build the layer with sparse=False")
        self.used[i] = True
        grad, a = p.grad.view(-1), part.offsets[i]
        for k, lo, hi in part.segments_of[i]:  # copy into the bucket(s) it falls in
            start = part.buckets[k].start
            self._bucket(k)[lo - start:hi - start].copy_(grad[lo - a:hi - a])
            self._one_more_in(k)
        p.grad = None  # the full gradient lives on only in the bucket (stages 0-1: the full buffer)
        self.on_grad(p)
        self._reduce_ready_buckets()

    def _one_more_in(self, k):
        self.pending[k] -= 1
        if self.pending[k] == 0:
            self.filled.append(k)

    def _reduce_ready_buckets(self):
        while self.next >= 0 and self.pending[self.order[self.next]] == 0:
            k = self.order[self.next]
            bucket, start = self._bucket(k), self.partition.buckets[k].start
            for i, lo, hi in self.partition.buckets[k].segments if self.skipped else ():
                if i in self.skipped:  # no gradient: zeros, as in DDP
                    bucket[lo - start:hi - start].zero_()
            bucket = bucket.to(self.precision.reduce_dtype)
            self.temporary.pop(k, None)
            self.in_reduction.append((k, self.partition.reduce_scatter(bucket, k)))
            while len(self.in_reduction) > 1:  # one in flight while backward computes the next
                self._finish_reduction()
            self.next -= 1

    def _finish_reduction(self):
        k, pending = self.in_reduction.pop(0)
        self.partition.finish_reduce(pending, self.reduced_chunks[k], add=self.micro_batches > 0)

    def _finish_backward(self):
        """End of backward: reduce what is left, agree on which parameters were used."""
        if not self.for_params:
            self.on_backward_end()
            self._new_backward()
            return
        part = self.partition
        # whether gradients filled every bucket, before the zeros below (not step()'s zeros where no backward ran)
        filled_all = self.in_backward and len(self.filled) == len(self.order) and not self.skipped
        if filled_all and self.first_filled is None:
            self.first_filled = list(self.filled)
        self._reduce_the_rest()
        while self.in_reduction:
            self._finish_reduction()
        # As with DDP's find_unused_parameters=True, a parameter no rank used in any micro-batch keeps no gradient.
        # One more flag: rank 0 filled every bucket (see _agree_on_order). The flags travel while the next runs.
        used = torch.tensor(self.used + [filled_all and part.rank == 0], dtype=torch.int32, device=part.flag_device)
        work = part.start(dist.all_reduce, used, op=dist.ReduceOp.MAX)  # (n_trainable + 1,)
        self.used_flags.append((work, used))
        self.on_backward_end()
        self.micro_batches += 1
        self._new_backward()

    def _reduce_the_rest(self):
        """Start every bucket's reduction not started yet, in the order: a gradient that did not come is zeros."""
        for i in range(self.n_trainable):
            if not self.used[i] and i not in self.skipped:  # unused on this rank: it contributes zeros
                self._skip(i)
        self._reduce_ready_buckets()

    def _agree_on_order(self):
        """From the step after the first backward that filled every bucket on rank 0, reduce in that backward's
        order (rank 0's broadcast, once), as DDP rebuilds its buckets. Until then, in flat order reversed, a module
        registered before those it runs after (a head defined first) holds every bucket filled after it until its
        own is reduced: up to the whole gradient, at stages 2-3 too."""
        order = torch.tensor(self.first_filled or self.order, dtype=torch.int64, device=self.partition.flag_device)
        self.partition.wait(self.partition.start(dist.broadcast, order, group_src=0))  # (trainable buckets,)
        self.order, self.order_agreed = order.tolist()[::-1], True

    def finish(self):
        """At step time: the step's gradients reduced (zeros if no backward ran); at stage 0 all-gathered
        too, as all-reduce = reduce-scatter + all-gather: each rank sends its reduced chunks (Ψ/Nd) to Nd-1 ranks."""
        if self.micro_batches == 0:
            self._finish_backward()
        if not self.order_agreed:
            self.read_flags()
            if self.order_seen:
                self._agree_on_order()
        self.finished = True
        part = self.partition
        for k in self.order if self.replicate else ():
            part.all_gather(self.reduced[part.flat_range(k)], self.reduced_chunks[k], async_op=False)

    def own(self, s, dtype):
        """The reduced gradient over slice s of this rank's own space, in `dtype`: a view of `reduced`,
        else a copy (at stage 1 the reduced chunks lie in the full gradient, each at its bucket's place)."""
        if self.reduced is not self.full or self.replicate:  # own space laid out in `reduced`
            return self.reduced[s].to(dtype)
        part = self.partition
        out = torch.empty(s.stop - s.start, dtype=dtype, device=self.reduced.device)
        k = bisect.bisect_right(part.buckets, s.start, key=lambda b: b.own) - 1
        while k < len(part.buckets) and part.buckets[k].own < s.stop:
            o = part.own(k)
            lo, hi = max(s.start, o.start), min(s.stop, o.stop)
            out[lo - s.start:hi - s.start] = self.reduced_chunks[k][lo - o.start:hi - o.start]
            k += 1
        return out


def _call_weakly(method, *args):
    bound = method()  # (once: a collection between two calls could leave the second None)
    if bound is not None:
        bound(*args)


# -----------------------------------------------------------------------------------------
# Stages 0-2 keep every parameter, a view into one flat buffer (padded_numel,). After the step (5.1), stages 1-2
# all-gather each bucket's updated chunks in place, left in flight: a module's next forward waits for those it reads.
class ParameterReads(TorchFunctionMode):
    """In the first forward of the whole module: on_read(module, t, func) for each tensor t a torch function gets,
    in zero's hooks too (module: the innermost `running`, or None). Stages 1-2 learn what each module's code reads,
    another's parameters too (nn.MultiheadAttention reads out_proj.weight without calling out_proj); stage 3
    refuses a read of a freed parameter, and on_made(tensors read, their nodes before the call, result) watches
    what backward will read."""

    def __init__(self, on_read, on_made=None):
        super().__init__()
        self.on_read, self.on_made, self.running = on_read, on_made, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for t in tensors:
            self.on_read(self.running[-1] if self.running else None, t, func)
        # (before: an in-place call gives its input a new node; a view's, its base too)
        before = self.on_made and {n for t in tensors for n in (t.grad_fn, t._base.grad_fn if t._is_view() else None)}
        out = func(*args, **(kwargs or {}))
        if self.on_made is not None:
            self.on_made(tensors, before, out)
        return out


class FlatParameters:
    def __init__(self, partition, module, dtype, gather_after_step):
        self.partition, self.gather_after_step = partition, gather_after_step
        self.flat = torch.zeros(partition.padded_numel, dtype=dtype, device=partition.device)
        self.in_flight = []  # (bucket, work) of the all-gathers step() left in flight, in flat order
        self.issued_at = None  # each parameter's version when they were issued (see wait)
        self.reads, self.read_ends = None, {}  # in the first forward: how far each module's code read
        self.ends = None  # then: each module's wait point
        if gather_after_step:
            # taken now: under torch.func.functional_call, m.parameters() are the tensors it swapped in
            self.own_end = {m: max((partition.offsets[partition.index[p]] + p.numel()
                                    for p in m.parameters(recurse=False)), default=0) for m in module.modules()}
            for m in module.modules():
                # no hooks on a module with no parameter below, nor on torch.compile's wrapper (its inner module's run)
                if next(m.parameters(), None) is not None and "_orig_mod" not in m._modules:
                    # prepend: before a pre-hook the module had already (weight_norm's reads the weights)
                    m.register_forward_pre_hook(lambda mod, args: self._pre_forward(mod), prepend=True)
                    m.register_forward_hook(lambda mod, args, out: self._post_forward(), always_call=True)
                m.register_state_dict_pre_hook(lambda *args: self.wait())
                m.named_parameters = types.MethodType(self._after_wait("named_parameters"), m)  # parameters() too
            # a module made around it after (torch.compile's wrapper, a parent) lists its parameters through this
            module.named_modules = types.MethodType(self._after_wait("named_modules"), module)
            # the first forward of the whole module (not of a part called on its own) learns the reads
            module.register_forward_pre_hook(lambda mod, args: self._start_reading(mod), prepend=True)
            module.register_forward_hook(lambda mod, args, out: self._learn_ends(), always_call=True)

    def _after_wait(self, name):
        """Module.<name> that first waits for step()'s all-gathers: listing the parameters (or modules) before the
        next forward (an EMA) gives the stepped weights. Made a method of the module, as torch.compile expects."""
        def listing(module, *args, **kwargs):
            self.wait()
            return getattr(type(module), name)(module, *args, **kwargs)
        return listing

    def _start_reading(self, module):
        if self.ends is None and self.reads is None:
            self.wait()  # the first forward waits for everything and learns what each module reads
            # (else a later forward learns; not under no_grad, where the mode would turn off torch's eval fast paths)
            if self.partition.holds_its_parameters(module) and torch.is_grad_enabled():
                self.reads = ParameterReads(self._read).__enter__()

    def _pre_forward(self, m):
        if self.ends is not None:  # (a module that did not run in the first forward waits for all)
            self.wait(self.ends.get(m, math.inf))
        elif self.reads is not None:
            self.reads.running.append(m)
            self.read_ends.setdefault(m, 0)
        else:  # a part of the module called on its own before the first forward
            self.wait()

    def _read(self, m, t, func):
        part = self.partition
        if m is not None and isinstance(t, torch.nn.Parameter) and t in part.index:
            self.read_ends[m] = max(self.read_ends[m], part.offsets[part.index[t]] + t.numel())

    def _post_forward(self):
        if self.reads is not None:
            self.reads.running.pop()

    def _learn_ends(self):
        """Each module's wait point: the end of what its code read in the first forward, and at least of
        its own parameters and of children that did not run (in case reads escaped the mode in torch.compile).
        Also at zero_grad(), for a first forward a KeyboardInterrupt stopped (always_call hooks run on an Exception
        only, so its ParameterReads is still active): the reads so far."""
        if self.reads is None:  # (not reading: not in the first forward, or learnt already)
            return
        self.reads.__exit__(None, None, None)
        self.reads = None

        def end(m):
            return max([self.own_end.get(m, 0)] + [end(c) for c in m.children() if c not in self.read_ends])

        self.ends = {m: max(read, end(m)) for m, read in self.read_ends.items()}

    end_raised_forward = _learn_ends

    def load(self, k, values):
        self.flat[self.partition.flat_range(k)].copy_(values)

    def bind(self):
        for p, a in zip(self.partition.params, self.partition.offsets):
            p.data = self.flat[a:a + p.numel()].view_as(p)

    in_own_space = False  # owned(f, o) indexes the flat space

    def copy_owned(self, owned, source):
        """The owned ranges of the parameters from `source`, an own-space tensor (stage 0: the flat space)."""
        for f, o in owned:
            self.flat[f].copy_(source[o])

    def owned(self, f, o):
        """The parameters over an owned range: flat slice f (own slice o)."""
        return self.flat[f]

    def holds(self, p):
        """Whether p is still the view bind() made (not given new storage since)."""
        return p.untyped_storage()._cdata == self.flat.untyped_storage()._cdata and \
            p.storage_offset() == self.partition.offsets[self.partition.index[p]]

    def after_step(self, frozen_too=False):
        if self.gather_after_step:  # each rank's updated chunk to every rank: Ψ per rank (Section 7.2.1)
            part = self.partition
            for k in (k for k, b in enumerate(part.buckets) if b.trainable or frozen_too):
                work = part.all_gather(self.flat[part.flat_range(k)], self.flat[part.chunk(k)])
                self.in_flight.append((k, work))
            self.issued_at = [p._version for p in part.params]

    def wait(self, end=math.inf):
        """Wait for step()'s all-gathers of flat elements [0, end); raise where one overwrote a write made since."""
        while self.in_flight and self.partition.buckets[self.in_flight[0][0]].start < end:
            (k, work), part = self.in_flight[0], self.partition
            part.wait(work)
            self.in_flight.pop(0)  # (not before: one that failed raises again at the next wait)
            written = [part.names[part.params[i]] for i, lo, hi in part.buckets[k].segments
                       if part.params[i]._version != self.issued_at[i]]
            if written:
                raise RuntimeError(f"rank {part.rank}: {written[:3]} were written in place while step()'s "
                                   f"all-gather of the updated parameters was in flight, which overwrote part of it: "
                                   f"call optimizer.wait_params() after step() and before writing into parameters")

    def storages(self):
        return [self.flat]

    def on_grad(self, p):
        pass

    def on_backward_end(self):
        pass


# -----------------------------------------------------------------------------------------
# Section 5.3 -- P_os+g+p: parameters exist in full only while a module uses them.
# Per-rank model states: (4 + 4 + K)Ψ/Nd, this rank's chunk of every bucket. Before a module's forward and again
# before its backward its parameters are all-gathered, bucket by bucket, into the buffer they are views of (Section
# 7.2.2: Ψ in forward, Ψ in backward less the last units, which forward keeps for backward); freed after forward and
# once backward has all their gradients. Every rank must run the same modules in the same order (as in FSDP).
def gather_groups(module, units):
    """A unit (a transformer block) gathers all the parameters below it, any other module its own; a parameter of
    several modules (a tied embedding) is a group of its own, kept from its first use to the end of forward, so
    forward moves Ψ. nn.MultiheadAttention reads out_proj's weights without calling it: always a unit.
    Returns (groups, [(module, its group indices)], shared groups)."""
    containers = [type(u).__name__ for u in units if isinstance(u, (torch.nn.ModuleList, torch.nn.ModuleDict))]
    if containers:
        raise ValueError(f"stage3_units holds a {containers[0]}, whose forward never runs, so it cannot be gathered "
                         f"around one: pass the modules in it (stage3_units=model.h, not [model.h])")
    modules = set(module.modules())
    strays = [type(u).__name__ for u in units if not isinstance(u, torch.nn.Module) or u not in modules]
    if strays:  # (nothing would gather around it)
        raise ValueError(f"stage3_units holds a {strays[0]} that is not a module inside the model given to "
                         f"zero.initialize: pass that model's own modules (stage3_units=model.h)")
    units = set(units) | {m for m in module.modules() if isinstance(m, torch.nn.MultiheadAttention)}
    inside = {sub for u in units for sub in u.modules() if sub is not u}
    owned = [(m, list(m.parameters(recurse=m in units))) for m in module.modules() if m not in inside]
    owned = [(m, own) for m, own in owned if own]
    owners = collections.Counter(p for m, own in owned for p in own)
    shared = {p for p, n in owners.items() if n > 1}
    groups, group_of, hooks = [], {}, []
    for m, own in owned:
        for members in [[p for p in own if p not in shared]] + [[p] for p in own if p in shared]:
            if members and members[0] not in group_of:
                group_of.update((p, len(groups)) for p in members)
                groups.append(members)
        hooks.append((m, tuple(sorted({group_of[p] for p in own}))))
    return groups, hooks, {group_of[p] for p in shared}


class ShardedParameters:
    def __init__(self, partition, module, groups, hooks, shared, dtype, prefetch):
        self.partition, self.shared = partition, shared
        self.shard = torch.zeros(partition.shard_numel, dtype=dtype, device=partition.device)
        names = {m: name or "the root module" for name, m in module.named_modules()}
        self.names = [None] * len(groups)  # a group's name: the first module that gathers it
        for m, gids in hooks:
            for g in gids:
                self.names[g] = self.names[g] or names[m]
        self.group_of = {p: g for g, members in enumerate(groups) for p in members}
        # a group's buckets, in order, are consecutive: its runs were laid out together
        self.group_buckets = [sorted({k for p in members for k, lo, hi in partition.segments_of[partition.index[p]]})
                              for members in groups]
        self.groups, self.dtype, self.buffers, self.views = groups, dtype, [], []  # per group, made by bind()
        self.nodes = {}  # parameter -> its AccumulateGrad node, held: torch reuses it in every graph (see _grads_left)
        self.ran = set()  # the groups the forwards since a backward gathered for their modules (see _prefetch)
        self.calls_seen = []  # the calls this backward reached or passed
        self._new_backward()
        self.refcount = [0] * len(groups)
        self.calls = collections.defaultdict(list)  # id(gids) -> the calls in forward, innermost last
        self.prefetch_numel = prefetch * max(sum(partition.buckets[k].chunk for k in ks) * partition.nd
                                             for ks in self.group_buckets)  # see _prefetch
        self._forget_order()
        self.order_known, self.in_flight = False, {}
        self.tail = set()  # the groups backward gathers first (see _learn_order)
        self.reads, self.stand_ins = None, set()  # the first forward's check; the stand-ins' storages
        self.group_of_storage = {}  # the first forward's: each buffer's storage -> its group (see _made)
        self.made = []  # the first forward's: (node, what it saved of the buffers) (see _made)
        self.detached = set()  # groups the first forward read without a gradient edge (see _read)
        self.gradients = None  # the GradientBuckets, set by initialize
        self.warned_autocast = False
        for m, gids in hooks:
            # prepend: gathered before a pre-hook the module had already (weight_norm's computes the weight)
            m.register_forward_pre_hook(lambda mod, args, kwargs, gids=gids: self._pre_forward(gids, args, kwargs),
                                        with_kwargs=True, prepend=True)
            # always_call: refcount drops also when forward raises (torch's checkpoint stops a P_a recompute early)
            m.register_forward_hook(lambda mod, args, out, gids=gids: self._post_forward(gids, out), always_call=True)
        for m in module.modules():  # a module inside a unit too: its parameters are freed with the unit's
            m.register_state_dict_pre_hook(self._refuse_state_dict)
        # always_call: a forward that raised frees its prefetched groups too (zero_grad() those kept for backward)
        module.register_forward_hook(lambda mod, args, out: self._end_forward(), always_call=True)
        module.register_forward_hook(lambda mod, args, out: self._learn_order())  # (a forward that raised: not all)
        module.register_forward_pre_hook(lambda mod, args: self._start_reading(mod), prepend=True)
        module.register_forward_hook(lambda mod, args, out: self._stop_reading(), always_call=True)

    def load(self, k, values):
        chunk = self.partition.buckets[k].chunk
        self.shard[self.partition.own(k)].copy_(values[self.partition.rank * chunk:(self.partition.rank + 1) * chunk])

    def bind(self):
        """While gathered, each parameter is a view into its group's buffer (made and freed here one by one). Freed,
        it is a stand-in of its shape, dtype and device that reads as NaN (reading the freed buffer would crash
        the process); a stand-in holds one element, so a one-element parameter gets its own."""
        part = self.partition
        nan = torch.full((), math.nan, dtype=self.dtype, device=part.device)
        for ks, members in zip(self.group_buckets, self.groups):
            buf = torch.empty(sum(part.buckets[k].chunk for k in ks) * part.nd, dtype=self.dtype, device=part.device)
            views = []  # (parameter, its view into buf, its stand-in)
            for p in members:
                a = part.offsets[part.index[p]] - (part.buckets[ks[0]].start if ks else 0)
                stand_in = (nan.clone() if p.numel() == 1 else nan).expand(p.shape)
                self.stand_ins.add(stand_in.untyped_storage()._cdata)
                views.append((p, buf[a:a + p.numel()].view(p.shape), stand_in))
                if buf.numel() == 0:  # parameters of zero size: nothing to gather, their views serve for good
                    p.data = views[-1][1]
            self.buffers.append(buf)
            self.views.append(views)
            self._free(len(self.buffers) - 1)

    in_own_space = True  # owned(f, o) indexes the shard

    def copy_owned(self, owned, source):
        self.shard.copy_(source)

    def owned(self, f, o):
        return self.shard[o]

    def holds(self, p):
        """Whether p is its stand-in or its view into its group's buffer (not given new storage)."""
        storage = p.untyped_storage()._cdata
        return storage in self.stand_ins or storage == self.buffers[self.group_of[p]].untyped_storage()._cdata

    def after_step(self, frozen_too=False):
        """The shard changed (a step, a loaded checkpoint): no gathered copy may outlive it."""
        self._finish_prefetch()
        for g in range(len(self.groups)):
            self._free(g)

    def wait(self):
        pass

    def storages(self):
        return [self.shard] + self.buffers + [stand_in for views in self.views for p, view, stand_in in views]

    def refill_stand_ins(self):
        """NaN again in every stand-in: fill_ and zero_ on one write the element they share."""
        with torch.no_grad():
            for p, view, stand_in in itertools.chain(*self.views):
                stand_in.fill_(math.nan)

    def _gathered(self, g):
        """Whether group g's buffer holds its storage (gathered, or an all-gather on its way)."""
        return self.buffers[g].untyped_storage().nbytes() > 0

    def _free(self, g):
        self._wait_gathered(g)  # never under an all-gather still writing (a gather that raised midway)
        if self._gathered(g):  # (freed already: its parameters are stand-ins)
            self.buffers[g].untyped_storage().resize_(0)
            for p, view, stand_in in self.views[g]:
                p.data = stand_in

    @staticmethod
    def _refuse_state_dict(module, prefix, keep_vars):
        if not keep_vars:  # (keep_vars=True hands back the Parameters themselves, as named_parameters() does)
            raise RuntimeError("at stage 3 a parameter holds data only while its module runs, so module.state_dict() "
                               "has nothing to copy: use zero.full_state_dict(model) (a collective)")

    def _gather(self, gids, prefetch=False):
        """Gather groups gids (prefetch: leave the all-gathers in flight; else they are in use, no longer ahead)."""
        for g in gids:
            if self.buffers[g].numel() and not self._gathered(g):  # (else gathered already, or on its way)
                self._start_gather(g)
            if not prefetch:  # prefetched: waited for when the group is used
                self._wait_gathered(g)
        if not prefetch:  # (see _prefetch)
            self.ahead.difference_update(gids)

    def _start_gather(self, g):
        part, buf = self.partition, self.buffers[g]
        moved = [part.names[p] for p, view, stand_in in self.views[g] if not self.holds(p)]
        if moved:  # the gather would replace it with the shard's values
            raise RuntimeError(f"stage 3: parameters {moved[:3]} of {self.names[g]} were given new storage "
                               f"(p.data = t, vector_to_parameters) outside its forward, so the gather would lose "
                               f"their values: rebuild the model and set the values before zero.initialize")
        self._check_same_group(g)
        buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        start = part.buckets[self.group_buckets[g][0]].start
        # one all-gather per bucket k: every rank's chunk (chunk,) -> buf's slice (chunk * nd,), each rank
        # sending its chunk to nd - 1; recorded in in_flight as it starts: _free waits for it, whatever raises
        works = self.in_flight[g] = []
        try:
            for k in self.group_buckets[g]:
                works.append(part.all_gather(buf[part.flat_range(k).start - start:part.flat_range(k).stop - start],
                                             self.shard[part.own(k)]))
        except BaseException:  # not all started: freed once those that did end, never taken for gathered
            self._free(g)
            raise

    def _check_same_group(self, g):
        """Before each gather the ranks meet at group g (FlatPartition.meet): a branch some ranks take is an error, not
        a hang or the wrong parameters, and so is a rank that stops gathering, after check_timeout."""
        rule = ("every rank must run the same modules in the same order at stage 3: take a branch on "
                "every rank or on none (or use stage 2, which allows it)")
        here = f"stage 3: rank {self.partition.rank} gathers {self.names[g]}"
        low, high = self.partition.meet(g, here, rule)
        if low < 0:  # (see _all_ranks_call)
            name = COLLECTIVE_CALLS[(-1 - low) % len(COLLECTIVE_CALLS)]
            raise RuntimeError(f"{here} while another rank {_doing(low)}: {_call_rule(name)}")
        if low != high:
            raise RuntimeError(f"stage 3: ranks gather different modules at the same point (rank "
                               f"{self.partition.rank}: {self.names[g]}; first and last in module order over the "
                               f"ranks: {self.names[low]}, {self.names[high]}): {rule}")

    def _wait_gathered(self, g):
        """Wait for group g's all-gathers, each leaving in_flight as it ends (an interrupt leaves the rest to _free);
        only then do its parameters become views into the buffer, so nothing reads it while an all-gather writes. A
        failure (of one, or of an earlier collective) raises at once, the group never taken for gathered: dropped if
        all its all-gathers ended, else left to them (peers may be stuck in the failed one: waiting could hang too)."""
        if g not in self.in_flight:
            return
        works = self.in_flight[g]
        try:
            while works:
                self.partition.wait(works[0])
                works.pop(0)
        except Exception:
            if all(w.is_completed() for w in works):
                self.in_flight.pop(g)
                self._free(g)  # (out of in_flight: drops it at once)
            raise
        for p, view, stand_in in self.views[g]:  # (before it leaves in_flight: an interrupt between the two
            p.data = view  # would leave it gathered with stand-ins)
        self.in_flight.pop(g)

    def _finish_prefetch(self):
        for g in list(self.in_flight):
            self._wait_gathered(g)

    def _prefetch(self, gids, step):
        """Gather the next units (the first forward's order: as they started; in backward, as they ended, reversed) as
        this one starts, so a small module between two blocks leaves no gather exposed. Where a step runs other units
        (layer drop, another expert), a group the pass is done with is not gathered again, one gathered for a skipped
        unit is freed, and backward gathers ahead only what the forwards ran (it reaches nothing else)."""
        k = self.position[step].get(id(gids))
        if k is None or id(gids) in self.visited:  # (a module's other calls: its place is one call's)
            return
        self.visited.add(id(gids))
        units = [[g for g in unit if g not in self.finished and g not in gids and (step > 0 or g in self.ran)]
                 for unit in self._ahead(k, step)]
        # ahead: what a prefetch gathered and nothing has used since (not a group backward reached and still uses)
        ahead = {g for unit in units for g in unit if g in self.ahead or not self._gathered(g)}
        self._release(self.ahead.difference(ahead, gids, self.shared))  # (not a module running around)
        self.ahead = ahead
        for unit in units:
            self._gather(unit, prefetch=True)

    def _ahead(self, k, step):
        """The units after position k of the order (step +1; before it: -1), up to `prefetch` times the largest
        group's elements, rounded to the nearest unit: the next one always, then each while at least half of it fits
        (a small module before a block comes with it; past the first, the budget is passed by half a unit at most)."""
        units, budget = [], self.prefetch_numel
        while budget > 0 and 0 <= k + step < len(self.order[step]):
            numel = sum(self.buffers[g].numel() for g in self.order[step][k + step])
            if units and numel > 2 * budget:  # (the next unit always: one with tied groups can pass the budget)
                break
            k, budget = k + step, budget - numel
            units.append(self.order[step][k])
        return units

    def _read(self, m, t, func):
        """In the first forward, reading a freed parameter's values (not its metadata) is an error, not NaN. A
        parameter read without a gradient edge (p.detach(), p.data) may be saved for another tensor's gradient,
        computed after its own: its group is kept as a frozen parameter's is (see _watch_inputs)."""
        name = getattr(func, "__name__", repr(func))
        if t in self.group_of and (name == "detach" or func == torch.Tensor.data.__get__):
            self.detached.add(self.group_of[t])
            self.pinned[self.group_of[t]] = True  # (this call's inputs are not watched)
        if t.untyped_storage()._cdata not in self.stand_ins or name in _METADATA:
            return
        what = f"a parameter of {self.names[self.group_of[t]]}" if t in self.group_of else "a freed parameter"
        raise RuntimeError(f"stage 3: {what} {tuple(t.shape)} was read ({name}) while no module holding it ran, so "
                           f"it has no data here. Make the module whose forward reads it a unit (stage3_units=[...]: "
                           f"it gathers every parameter below it), read it through a module that holds it (a tied "
                           f"head: self.head.weight = self.emb.weight) or in a forward hook registered with "
                           f"prepend=True. A module inside a unit called outside it (block.fc(h)) has no hooks of its "
                           f"own: leave the unit out of stage3_units")

    def end_raised_forward(self):
        """End a forward that a BaseException other than Exception (KeyboardInterrupt) stopped: always_call hooks run
        on an Exception only, so its modules still count as running and the first forward's check is on. Called at
        zero_grad(), not the next forward (the root module may call itself); frees the groups kept for backward too."""
        self._stop_reading()
        if any(self.refcount) or any(self.calls.values()):
            self.refcount = [0] * len(self.groups)
            self.calls.clear()
            self._end_forward()
        self._release(self.tail)
        self.ahead, self.finished, self.visited = set(), set(), set()  # (also where it stopped between two modules)

    def _made(self, tensors, before, out):
        """In the first forward, each autograd node a torch function made (F.linear of a 3-d input makes three) that
        saved a gathered parameter, or a view of one, is to check before it runs that the parameter holds its values:
        backward runs a term made from a module's weights after its outputs and kept aside (self.pen =
        self.weight.square().sum(), added to the loss) before it reaches those outputs, so before their module is
        gathered again. (Not under saved-tensor hooks, a checkpoint's: reading its saved tensors would run them.)"""
        group = self.group_of_storage
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None or \
                not any(t.untyped_storage()._cdata in group for t in tensors):
            return
        seen, nodes = set(before), [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        while nodes:
            node = nodes.pop()
            if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
                continue
            seen.add(node)
            nodes += [n for n, _ in node.next_functions]
            saved = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
            saved = [(t, group[t.untyped_storage()._cdata]) for t in saved
                     if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in group]
            if saved:
                self.made.append((node, saved))

    def _refuse_freed_read(self, saved, grad_outputs):
        for t, g in saved:
            if t.untyped_storage()._cdata != self.buffers[g].untyped_storage()._cdata or not self._gathered(g) \
                    or g in self.in_flight:
                raise RuntimeError(f"stage 3: backward reached a tensor made from the parameters of {self.names[g]} "
                                   f"before it reached {self.names[g]}'s outputs, so they are not gathered and it "
                                   f"would read NaN or freed memory (a term made after the outputs and kept aside, "
                                   f"self.pen = self.weight.square().sum() added to the loss, is differentiated "
                                   f"first). Return the term from the module's forward as one of its outputs. (A "
                                   f"module inside a unit called outside it, block.fc(h) after block(x), has no hooks "
                                   f"of its own, and a weight tied there is read so: leave the unit out of "
                                   f"stage3_units)")

    def _start_reading(self, module):
        # (a forward under torch.func.functional_call reads other tensors: a later forward checks and learns)
        # (nor under no_grad: the mode would turn off torch's eval fast paths, MultiheadAttention's; a later one checks)
        if not self.order_known and self.reads is None and self.partition.holds_its_parameters(module) and \
                torch.is_grad_enabled():
            self.group_of_storage = {b.untyped_storage()._cdata: g for g, b in enumerate(self.buffers) if b.numel()}
            self._forget_order()  # (not an earlier forward's, which raised)
            self.reads = ParameterReads(self._read, self._made).__enter__()

    def _stop_reading(self):
        """The first forward's check ends with it, also when it raised (then the next one checks). The nodes _made found
        get their check now, after the hooks gathering a module as backward reaches it (pre-hooks run as registered)."""
        if self.reads is not None:
            self.reads.__exit__(None, None, None)
            self.reads = None
        for node, saved in self.made:
            node.register_prehook(functools.partial(self._refuse_freed_read, saved))
        self.made = []

    def _end_forward(self):
        """Free what no module holds: the shared groups, and groups prefetched for a module this forward
        skipped or never reached; a forward that builds a graph keeps the tail (see _learn_order), but for
        what it gathered ahead and never used (a last unit skipped: backward will not reach it)."""
        self._finish_prefetch()
        if not self.gradients.in_backward:  # recomputed in backward (P_a): backward frees what its modules held
            kept = set(self._kept()) - self.ahead
            self._release([g for g in range(len(self.groups)) if g not in kept])
            self.ahead, self.finished, self.visited = set(), set(), set()

    def _learn_order(self):
        """The units' order, from the first forward that ran to its end, and the tail: the groups backward gathers
        first (the last unit's and those its prefetch takes), which a later forward building a graph keeps for
        backward (as FSDP2 keeps its root's): an all-gather and a check fewer per step."""
        if self.order_known:
            return
        if self.reads is None:  # a forward under functional_call or no_grad (see _start_reading): the next learns
            return
        # backward's order: each unit where its last call ended (backward reaches a unit called twice there first)
        last_end = {id(gids): i for i, gids in enumerate(self.ends)}
        for i, gids in enumerate(self.ends):
            if last_end[id(gids)] == i:
                self._learn_position(gids, -1)
        self.order_known, last = True, len(self.order[-1]) - 1
        if last >= 0:
            self.tail = {g for gids in [self.order[-1][last]] + self._ahead(last, -1) for g in gids}

    def _forget_order(self):
        """The units in the first forward's order as they first started (forward's, step +1) and as they last ended
        (backward's, step -1, walked from the end: a module around others, the root, ends after them and backward
        reaches it first). Per order: the units and each unit's position; `ends`: every end, repeats too."""
        self.order, self.position, self.ends = {+1: [], -1: []}, {+1: {}, -1: {}}, []

    def _learn_position(self, gids, step):
        if not self.order_known and id(gids) not in self.position[step]:
            self.position[step][id(gids)] = len(self.order[step])
            self.order[step].append(gids)

    def _kept(self):
        return self.tail if torch.is_grad_enabled() else ()

    def _pre_forward(self, gids, args, kwargs):
        # counted before the gather: the post-forward hook, which runs also when the gather raises, undoes it
        self.calls[id(gids)].append(self._watch_inputs(gids, args, kwargs))
        for g in gids:
            self.refcount[g] += 1
            if torch.is_grad_enabled() and not self.gradients.in_backward:  # (not a recomputation: see _grads_left)
                if self.backward_ran:  # the first forward after a backward starts the record anew
                    self.ran, self.backward_ran = set(), False
                self.ran.add(g)
            elif self.gradients.in_backward and not self._gathered(g):  # (not one backward or its prefetch holds)
                self.recomputing.add(g)
        self._gather(gids)
        if torch.is_grad_enabled():  # (after the gather: get_gradient_edge reads the parameter)
            self.nodes.update((p, get_gradient_edge(p).node) for g in gids for p in self.groups[g]
                              if p.requires_grad and p not in self.nodes)
        self._warn_autocast()
        self._learn_position(gids, +1)
        if not self.gradients.in_backward:  # a forward recomputed in backward (P_a): the next units are done
            self._prefetch(gids, +1)

    def _warn_autocast(self):
        device = self.partition.flag_device.type  # (the CPU when simulating on meta)
        dtype = torch.get_autocast_dtype(device)
        if not self.warned_autocast and torch.is_autocast_enabled(device) and dtype != self.dtype and \
                (torch.is_grad_enabled() or torch.is_autocast_cache_enabled()):
            self.warned_autocast = True
            warnings.warn(f"stage 3 under torch.autocast: autocast keeps its {dtype} copy of each gathered weight "
                          f"(its cache, and for backward), so every rank holds the whole model in {dtype} (2Ψ bytes): "
                          f"pass param_dtype={dtype} to zero.initialize instead, over an fp32 master (Section 3.1)")

    def _release(self, gids):
        for g in gids:
            if self.refcount[g] == 0:
                self._free(g)

    def _post_forward(self, gids, out):
        """Returns the output, cloning any tensor in it that views a buffer about to be freed (self.weight[:T])."""
        held = {self.buffers[g].untyped_storage()._cdata for g in gids if self._gathered(g)}
        if any(isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in held for t in tree_flatten(out)[0]):
            out = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and
                           t.untyped_storage()._cdata in held else t, out)
        call = self.calls[id(gids)].pop()
        if call is None and torch.is_grad_enabled() and not self.detached.isdisjoint(gids):
            call = _PINNED  # a weight read detached in this forward, the first (see _read)
        for g in gids:
            self.refcount[g] -= 1
        if self.reads is not None:  # (the first forward's)
            self.ends.append(gids)
        if not self.gradients.in_backward:
            done = [g for g in gids if g not in self.shared and g not in self._kept() and self.refcount[g] == 0]
            self._release(done)
            self.finished.update(done)
        else:  # a forward recomputed in backward (P_a) keeps what backward reached or gathered ahead; a group it
            # gathered ahead of its module's backward (a checkpoint over several units) is freed, gathered again there
            self._release([g for g in gids if g in self.recomputing and g not in self.reached])
        if torch.is_grad_enabled():  # gather again when backward reaches this module
            self._hook_backward(gids, out, call)
        return out

    def _watch_inputs(self, gids, args, kwargs):
        """A frozen parameter has no gradient to say when backward is done with it; its module's inputs do (FSDP2's
        post-backward: autograd runs a forward's nodes before the node that made its input). So a call holding a
        frozen (or detached-read) parameter in a forward that builds a graph gets a record [reached by backward,
        inputs' gradients in] and its inputs watched. Inputs that cannot say it (none needs a gradient; a leaf, whose
        gradient autograd takes first; a tensor inside an object) make it _PINNED: its groups kept to backward's end."""
        if not torch.is_grad_enabled() or all(p.requires_grad and g not in self.detached
                                              for g in gids for p in self.groups[g]):
            return None
        leaves = tree_flatten((args, kwargs))[0]
        inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs or any(t.grad_fn is None for t in inputs) or any(_holds_tensors(t) for t in leaves):
            for g in gids:
                self.pinned[g] = True
            return _PINNED
        call = [False, False]
        torch.autograd.graph.register_multi_grad_hook(
            inputs, functools.partial(_call_weakly, weakref.WeakMethod(self._inputs_done), gids, call))
        return call

    def _inputs_done(self, gids, call, grads):
        """The call's inputs have their gradients. Not counted in a backward no hook of zero's began (a penalty's
        torch.autograd.grad on an input): nothing would clear the mark, and the retained graph's next backward would
        take the call as done before reaching it."""
        if call[1] or not self.gradients.in_backward:
            return
        call[1] = True  # (before it was reached: the module passed an input through as an output)
        self.calls_seen.append(call)
        if call[0]:
            for g in gids:
                self.inputs_left[g] -= 1
                self._free_in_backward(g)

    def _hook_backward(self, gids, out, call):
        """Gather gids again when backward reaches one of the module's outputs."""
        leaves = tree_flatten(out)[0]
        hidden = [type(t).__name__ for t in leaves if _holds_tensors(t)]
        if hidden:
            raise TypeError(f"stage 3: {self.names[gids[0]]} returned an instance of {hidden[0]}, which "
                            f"torch.utils._pytree does not flatten, so backward cannot say when it reaches the "
                            f"module: return a tuple, dict or NamedTuple, or register the type with torch.utils."
                            f"_pytree (register_dataclass, register_pytree_node)")
        # not a leaf (an input returned as it is): backward reaching it computes nothing of the module, and a
        # hook on it would stay on the tensor for every later step, one more per forward
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                _when_backward_reaches(t, lambda: self._pre_backward(gids, call))

    def _pre_backward(self, gids, call):
        if torch.is_grad_enabled():  # (the engine enables it only for create_graph=True)
            raise RuntimeError("stage 3 frees the gathered parameters when backward ends, so a backward with "
                               "create_graph=True would leave a graph that reads freed parameters: use stage 2")
        if not self.gradients.in_backward:  # does it accumulate gradients (not autograd.grad(loss, x))?
            self.gradients.begin(self._accumulates())
        self.reached.update(gids)
        self._gather(gids)
        if call is _PINNED:  # kept to the end of each backward that reaches it (see _watch_inputs)
            for g in gids:
                self.pinned[g] = True
        elif call == [False, False]:  # reached (once per call, whatever its number of outputs)
            call[0] = True
            self.calls_seen.append(call)
            for g in gids:
                self.inputs_left[g] += 1
        self._prefetch(gids, -1)

    def _accumulates(self):
        """Whether the backward running accumulates any trainable parameter's gradient. torch.autograd.grad
        never does, and torch refuses the question for a parameter passed to it as an input."""
        trainable = itertools.islice(self.partition.params, self.gradients.n_trainable)  # (any() stops early)
        return any(_will_run(get_gradient_edge(p).node) for p in trainable if p.requires_grad)

    def on_grad(self, p):
        g = self.group_of[p]
        if self.buffers[g].numel() and not self._gathered(g):  # so it was read as its NaN stand-in
            raise RuntimeError(f"stage 3: a parameter of {self.names[g]} got a gradient while {self.names[g]} was "
                               f"neither running nor gathered, so forward read it as NaN (a parent reading a child's "
                               f"weight without calling the child): make the module reading it a unit (stage3_units)")
        self._grads_left()[g] -= 1
        self._free_in_backward(g)

    def _grads_left(self):
        """Per group, the gradients still to come in this backward: a parameter's hook runs where the graph was built
        while it required a gradient (its AccumulateGrad node), with no gradient if it was frozen since. Counted: those
        that require one now, and those frozen since whose node this backward runs (a retained graph's next backward,
        an interleaved schedule's F1 F2 B1 F3 B2 with a parameter frozen at F3, a graph kept past a step that did not
        write its weights). One more than runs only keeps the group to backward's end."""
        if self.grads_left is None:
            self.grads_left = [sum(p.requires_grad or p in self.nodes and _will_run(self.nodes[p]) for p in members)
                               for members in self.groups]
        return self.grads_left

    def _free_in_backward(self, g):
        """Done with g: all its gradients in, and the inputs' gradients of every call with a frozen parameter."""
        if self._grads_left()[g] <= 0 and self.inputs_left[g] == 0 and not self.pinned[g]:
            self._free(g)
            self.finished.add(g)

    def _new_backward(self):
        # groups gathered ahead and not yet used; done with; the units whose calls prefetched (see _prefetch)
        self.ahead, self.finished, self.visited = set(), set(), set()
        self.grads_left, self.backward_ran = None, True  # (see _grads_left)
        self.inputs_left = [0] * len(self.groups)  # calls reached whose inputs' gradients are to come
        self.pinned = [False] * len(self.groups)  # kept to the end of backward (see _watch_inputs, _PINNED)
        self.reached = set()  # groups whose module's output this backward has reached
        self.recomputing = set()  # groups a forward recomputed in this backward gathered (see _post_forward)
        for call in self.calls_seen:  # a retained graph's next backward reaches them again
            call[:] = [False, False]
        self.calls_seen = []

    def on_backward_end(self):
        self.after_step()  # free every group, prefetched ones included
        self._new_backward()


# a call of a module whose inputs cannot say when backward is done with it (see _watch_inputs)
_PINNED = "pinned"


def _will_run(node):
    """Whether the backward running will run autograd node `node`. torch refuses the question for the node of a
    tensor passed to torch.autograd.grad as an input, whose gradient it returns, not accumulates: no."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError as e:
        if "running autograd.grad()" not in str(e):
            raise
        return False


# what code may do with a freed parameter: read or set its metadata, make a new tensor like it
_METADATA = {"__get__", "__set__", "__hash__", "untyped_storage", "size", "numel", "dim", "stride", "element_size",
             "is_floating_point", "is_complex", "is_contiguous", "requires_grad_", "detach", "new_empty",
             "new_zeros", "new_ones", "new_full", "empty_like", "zeros_like", "ones_like", "full_like"}


def _holds_tensors(obj):
    """A pytree leaf holding tensors that need gradients: in its fields (a plain @dataclass), or as the items of a
    dict, list or tuple subclass pytree does not know (those it knows are not leaves)."""
    if isinstance(obj, torch.Tensor):
        return False
    held = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    held += list(obj.values()) if isinstance(obj, dict) else list(obj) if isinstance(obj, (list, tuple)) else []
    return bool(held) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(held)[0])


# -----------------------------------------------------------------------------------------
# Buffers follow rank 0 by DDP's rule (broadcast_buffers=True): at initialize, and before every forward
# that follows one with gradients on (so a no-grad BatchNorm recalibration is what the next forward uses).
# The module's buffers as they are then: one reassigned in forward (self.avg = 0.9 * self.avg + ...) is a new tensor.
def _broadcast_buffers(group, after_training, module, args):
    if after_training[0]:
        # Module.named_modules, not the module's own, which at stages 1-2 waits for step's all-gather
        modules = [m for _, m in torch.nn.Module.named_modules(module)]
        buffers = {id(b): b for m in modules for b in m._buffers.values() if b is not None}  # (a shared one once)
        for b in buffers.values():
            dist.broadcast(b, group_src=0, group=group)
    after_training[0] = torch.is_grad_enabled()


# -----------------------------------------------------------------------------------------
# Section 6.1 -- ZeRO-R, P_a: partitioned activation checkpointing.
# Checkpointing keeps only each block's input and recomputes the block in backward. Under model parallelism
# that input is replicated on every MP rank; P_a keeps 1/MP of it per rank and all-gathers it just before the
# recomputation (one all-gather of batch x seq x hidden per block); P_a+cpu keeps that part in CPU memory.
# M_D (Section 6.3): the parts live in one pre-allocated buffer, apart from the short-lived tensors.
class ActivationCheckpointing:
    """zero.checkpoint_activations: checkpoint each of `blocks` (modules called as block(x)): plain,
    P_a (partition=True, over tp_group), P_a+cpu (cpu=True), M_D buffers (contiguous=True)."""

    ROW = 64  # elements: an M_D slot starts 64-element aligned (the kernels' bits depend on alignment)

    def __init__(self, blocks, tp_group=None, partition=False, cpu=False, contiguous=False):
        self.blocks = list(blocks)
        self.tp_group, self.cpu, self.contiguous = tp_group, cpu, contiguous
        self.tp = dist.get_world_size(tp_group) if partition and tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if self.tp > 1 else 0
        self.arena, self.busy, self.checked = None, [False] * len(self.blocks), False
        for i, block in enumerate(self.blocks):
            block.forward = functools.partial(self._forward, i, block.forward)

    def _forward(self, i, forward, /, *args, **kwargs):
        if not args and list(kwargs) == list(inspect.signature(forward).parameters)[:1]:  # block(x=h): as block(h)
            args, kwargs = tuple(kwargs.values()), {}
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            if len(args) == 1 and not kwargs:
                got = f"a {type(args[0]).__name__}"
            elif args:
                got = f"{len(args) - 1} more argument(s) and keywords {sorted(kwargs)}"
            else:
                got = f"no positional tensor, and keywords {sorted(kwargs)}"
            raise TypeError(f"zero.checkpoint_activations checkpoints blocks called as block(x), with one tensor; "
                            f"this one got {got}: checkpoint a module whose forward takes x alone")
        x = args[0]
        if not torch.is_grad_enabled():  # nothing to save for a backward
            return forward(x)
        if self.tp > 1 and not self.checked:
            self._check_inputs_agree(i, x)
        if torch._debug_has_internal_overlap(x) == 1:  # an expanded x (elements share memory):
            x = x.contiguous()  # computed on a copy the recomputation can rebuild
        like = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")  # x's layout, no memory
        # where x starts past a line (a micro-batch sliced from a batch): the kernels' bits depend on it (CPU
        # kernels on 64-byte lines; cuBLASLt picks a kernel by alignment up to 256 bytes)
        line = 64 if x.device.type == "cpu" else 256
        offset, requires_grad, holder = x.data_ptr() % line, x.requires_grad, [x]  # holder: x, for this forward only

        def run(part, anchor):
            if holder[0] is not None:
                return forward(holder[0])
            # the recomputation in backward: the input again, from the kept part, in x's layout and alignment
            full = self._restore(part, like.shape, anchor.device)
            if full.stride() != like.stride() or full.data_ptr() % line != offset:  # (a transposed x, a sliced x)
                full = _placed(like, offset, line, anchor.device).copy_(full)
            return forward(full.requires_grad_(requires_grad))

        # anchor: an empty tensor on x's device, so checkpoint restores that device's RNG (dropout) under P_a+cpu too
        y = torch.utils.checkpoint.checkpoint(run, self._keep(i, x), x.new_empty(0), use_reentrant=False)
        holder[0] = None
        return y

    def _check_inputs_agree(self, i, x):
        """P_a rebuilds a block's input from every tp rank's slice: in the first forward the ranks' inputs are
        compared (shape, dtype, the sum of their bits; 16 bytes a field), as a tp group the inputs differ over (the
        data-parallel group) would train on a patchwork of them, silently."""
        differ = _differing(self.tp_group, x.device, {"shape": tuple(x.shape), "dtype": x.dtype,
                                                      "values": _bit_sum(x.detach()).item()})
        if differ:
            raise ValueError(f"zero.checkpoint_activations(partition=True): the ranks of tp_group fed block {i} "
                             f"inputs of different {differ}, but P_a needs the same input on every rank of the "
                             f"group, as Megatron's tensor-parallel blocks have it: pass the tensor-parallel group "
                             f"(gpt.make_mesh(dp, tp)[1]), or partition=False")
        self.checked = True

    def _keep(self, i, x):
        part = x.detach().reshape(-1)  # (B*T*C,)
        if self.tp > 1:  # P_a: (B*T*C,) -> my (ceil(B*T*C / tp),) slice
            n = math.ceil(part.numel() / self.tp)
            part = F.pad(part, (0, n * self.tp - part.numel()))[self.tp_rank * n:(self.tp_rank + 1) * n]
        if not (self.contiguous or self.cpu or self.tp > 1):
            return part  # plain checkpointing: keep the input itself
        device = torch.device("cpu") if self.cpu else part.device
        if self.contiguous:  # M_D: slot i of one buffer for all blocks
            row = math.ceil(part.numel() / self.ROW) * self.ROW
            fits = self.arena is not None and (self.arena.shape[1], self.arena.dtype, self.arena.device) == \
                (row, part.dtype, device)
            if not fits and not any(self.busy):  # a new shape: a new arena, once no graph holds the old one
                self.arena, fits = torch.empty(len(self.blocks), row, dtype=part.dtype, device=device,
                                               pin_memory=self.cpu and part.is_cuda), True
            if fits and not self.busy[i]:
                slot = self.arena[i, :part.numel()]
                slot.data.copy_(part, non_blocking=True)  # .data: keep the version the other slots were saved at
                self.busy[i] = True
                weakref.finalize(slot, self.busy.__setitem__, i, False)  # free once no graph holds slot i
                return slot
        # a copy of its own, so the whole input can be freed (to the CPU: pinned, not waited for)
        kept = torch.empty(part.shape, dtype=part.dtype, device=device, pin_memory=self.cpu and part.is_cuda)
        return kept.copy_(part, non_blocking=True)

    def _restore(self, part, shape, device):
        full = part = part.to(device, non_blocking=True)
        if self.tp > 1:
            full = part.new_empty(self.tp * part.numel())
            dist.all_gather_single(full, part, group=self.tp_group)  # (tp * n,): each rank sends n
        return full[:math.prod(shape)].view(shape)  # (B, T, C)


def _placed(like, offset, line, device):
    """An empty tensor of like's shape and strides whose first element lies `offset` bytes past a `line`: one of
    its line // element_size starting positions in a buffer that many elements longer than like's span."""
    n, span = like.element_size(), 1 + sum((size - 1) * stride for size, stride in zip(like.shape, like.stride()))
    span = span if like.numel() else 0  # (a dimension of size 0: no element)
    buffer = torch.empty(span + line // n, dtype=like.dtype, device=device)
    start = (offset - buffer.data_ptr()) % line // n
    return buffer[start:start + span].as_strided(like.shape, like.stride())


checkpoint_activations = ActivationCheckpointing


# -----------------------------------------------------------------------------------------
# Entry points. initialize composes the parts a stage needs, once:
#   stage 0  FlatParameters (no gather after step)   GradientBuckets(full, all-gathered)  owns every bucket
#   stage 1  FlatParameters (all-gather after step)  GradientBuckets(full)                owns its chunks
#   stage 2  FlatParameters (all-gather after step)  GradientBuckets(reduced chunks only)  owns its chunks
#   stage 3  ShardedParameters (gathers per module)  GradientBuckets(reduced chunks only)  owns its chunks
def initialize(module, optimizer_class, stage, group=None, param_groups=None, bucket_numel=None,
               param_dtype=None, reduce_dtype=None, loss_scale=None, stage3_units=None, prefetch=1,
               reduction="exact", check_timeout=60, init_fn=None, device=None, tp_group=None,
               find_unused_parameters=False, **optimizer_kwargs):
    """Shard `module` for ZeRO-DP `stage` over the data-parallel `group` (default: the world); return the same
    module, sharded and hooked, and the optimizer to step. Every rank starts from rank 0's weights (on meta: from
    init_fn's). docs/api.md describes every argument: bucket_numel is C_B; param_dtype, reduce_dtype and loss_scale
    give 16-bit compute over an fp32 master (Section 3.1); tp_group is Megatron's group (gpt.py)."""
    param_groups = _groups(param_groups)
    stage3_units = list(stage3_units or ())  # (it may be a generator: read once)
    _check(module, optimizer_class, stage, group, param_groups, bucket_numel, param_dtype, reduce_dtype,
           loss_scale, prefetch, reduction, init_fn, device, tp_group, optimizer_kwargs, check_timeout)
    # unique (a tied weight is listed once), the trainable ones first (stable: in module order within each kind)
    params = sorted(module.parameters(), key=lambda p: not p.requires_grad)
    precision = Precision(param_dtype or params[0].dtype, reduce_dtype or param_dtype or params[0].dtype)
    if not params[0].is_meta:
        device = params[0].device
    elif device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    groups, hooks, shared = gather_groups(module, stage3_units)  # (checked at every stage: one call serves all)
    # the trainable parameters, then the frozen ones: of the whole module, or (stage 3) of each group it gathers
    runs = [([p for p in members if p.requires_grad == wants_grad], wants_grad)
            for members in (groups if stage == 3 else [params]) for wants_grad in (True, False)]
    bucket_numel = bucket_numel or default_bucket_numel(dist.get_world_size(group))
    unit_names = {m: name for name, m in module.named_modules()}
    names = {p: name for name, p in module.named_parameters()}
    # the model's device (NCCL has no CPU collectives), or the CPU when simulating on meta
    _check_ranks_agree(group, torch.device("cpu") if device.type == "meta" else device, {
        "stage": stage, "bucket_numel": bucket_numel, "reduction": reduction, "param_dtype": precision.param_dtype,
        "reduce_dtype": precision.reduce_dtype, "prefetch": prefetch, "loss_scale": loss_scale,
        "stage3_units": [unit_names.get(u) for u in stage3_units], "optimizer_class": optimizer_class,
        "optimizer options": optimizer_kwargs, "param_groups": [
            ({k: v for k, v in g.items() if k != "params"}, [names.get(p) for p in g["params"]])
            for g in param_groups or ()],
        "parameters (names, shapes, dtypes, requires_grad)": [
            (name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters()]})
    partition = FlatPartition(params, [(run, t) for run, t in runs if run], group, bucket_numel, reduction, device,
                              names, check_timeout)
    meta = MetaInit(module, partition, init_fn) if params[0].is_meta else None
    start = meta.values if meta else partition.rank0_values
    if stage < 3:
        parameters = FlatParameters(partition, module, precision.param_dtype, gather_after_step=stage > 0)
    else:
        parameters = ShardedParameters(partition, module, groups, hooks, shared, precision.param_dtype, prefetch)
    gradients = GradientBuckets(partition, precision, keep_full=stage < 2, replicate=stage == 0,
                                on_grad=parameters.on_grad, on_backward_end=parameters.on_backward_end,
                                name=type(module).__name__)
    if stage == 3:
        parameters.gradients = gradients
    if find_unused_parameters:
        module.register_forward_hook(lambda mod, args, out: gradients.walk_graph(out))
    optimizer = ZeroOptimizer(module, partition, parameters, gradients, precision, loss_scale, start,
                              optimizer_class, param_groups, optimizer_kwargs, tp_group)
    if meta:
        meta.check_ranks_agree()
    for b in module.buffers() if param_dtype else ():  # (init_fn has filled a meta module's buffers by now)
        if b.is_floating_point():
            b.data = b.data.to(param_dtype)
    if partition.nd > 1 and list(module.buffers()):
        _broadcast_buffers(group, [True], module, ())  # rank 0's from the start, as DDP's constructor does
        module.register_forward_pre_hook(functools.partial(_broadcast_buffers, group, [True]))
    for p in params:  # another model's zero.initialize would take them into its own buffers
        p._zero_laid_out = True
    for m in module.modules():  # loading around zero would miss the fp32 master and stage 3's shard
        m.register_load_state_dict_pre_hook(_refuse_load_state_dict)
        m._apply = functools.partial(_refuse_conversion, m)  # .to(), .half(), .cuda()
        m.__deepcopy__ = _refuse_deepcopy  # (copy.deepcopy looks it up on the instance)
        m.__reduce_ex__ = _refuse_pickling  # torch.save(model), pickle, copy.copy (they too look on the instance)
    module.zero_grad = optimizer.zero_grad  # the gradients are zero's buffers, not p.grad
    module.no_sync = contextlib.nullcontext  # DDP's accumulation idiom: nothing to put off (see GradientBuckets)
    module._zero = optimizer
    return module, optimizer


def _canonical(v):
    """v as every rank writes it: dicts in key order, tensors by dtype, shape and values (not device), an object
    torch.optim would only call (a function) by its type: a repr with an address or a device differs by rank."""
    if isinstance(v, dict):
        return sorted((str(k), _canonical(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return [_canonical(x) for x in v]
    if isinstance(v, torch.Tensor):
        return str(v.dtype), tuple(v.shape), v.tolist()
    if isinstance(v, functools.partial):
        return _canonical(v.func), _canonical(v.keywords)
    if is_dataclass(v):
        return type(v).__qualname__, _canonical(vars(v))
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, type)):
        return v
    return type(v).__qualname__


def _differing(group, device, fields):
    """The names of `fields` whose values differ between the ranks: a 56-bit hash per field, all-reduced as
    (max, -min), 16 bytes a field, at any Nd."""
    hashes = [int.from_bytes(hashlib.sha256(repr(_canonical(v)).encode()).digest()[:7], "little")
              for v in fields.values()]
    both = torch.tensor(hashes + [-h for h in hashes], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)  # (2 x fields,): the largest hash, minus the smallest
    return [name for name, high, low in zip(fields, both[:len(hashes)].tolist(), both[len(hashes):].tolist())
            if high != -low]


def _check_ranks_agree(group, device, fields):
    """Ranks that build different models or pass different arguments would mismatch their collectives: silently
    wrong weights, a hang or an abort."""
    differ = _differing(group, device, fields)
    if differ:
        mine = {name: fields[name] for name in differ if not name.startswith("parameters")}
        here = f" (rank {dist.get_rank(group)}: {mine})" if mine else ""
        raise ValueError(f"the ranks passed zero.initialize different {differ}{here}: build the same model and pass "
                         f"the same arguments on every rank")


def _groups(param_groups):
    """param_groups in any form torch.optim takes (groups whose "params" is a tensor or an iterable of
    tensors or (name, tensor) pairs; or the parameters alone) as [{"params": [tensors], **options}]."""
    if param_groups is None:
        return None
    groups = list(param_groups)  # (read once: it may be a generator)
    if isinstance(param_groups, (set, frozenset)) or any(isinstance(g, dict) and isinstance(g.get("params"), (
            set, frozenset)) for g in groups):  # (as torch.optim: ranks would lay out different orders)
        raise TypeError("param_groups holds a set, whose order changes between runs and processes: use a list")
    if all(isinstance(g, (torch.Tensor, tuple)) for g in groups):
        groups = [{"params": groups}]
    if not all(isinstance(g, dict) and "params" in g for g in groups):
        raise TypeError("param_groups must be [{'params': [...], **options}, ...] (or a list of parameters)")
    return [{**g, "params": [g["params"]] if isinstance(g["params"], torch.Tensor) else
             [p[1] if isinstance(p, tuple) else p for p in g["params"]]} for g in groups]


def _refuse_conversion(module, fn, recurse=True):
    """Module._apply (.to(), .half(), ...) would swap the parameters, views into zero's buffers, for tensors the
    step never updates. Each parameter's conversion is tried first on a probe of its dtype, device and dim (memory
    formats need 4 or 5): a no-op goes through, anything else is refused before a parameter changes."""
    for p in module.parameters():
        probe = torch.empty((2,) * p.dim(), dtype=p.dtype, device=p.device)
        shared = probe.is_shared()  # share_memory() converts in place (a CUDA tensor is always "shared")
        if fn(probe) is not probe or probe.is_shared() != shared:
            raise RuntimeError("zero.initialize has laid this module's parameters into its own buffers: move or "
                               "cast the module before zero.initialize (param_dtype=torch.bfloat16 for 16-bit compute)")
    return type(module)._apply(module, fn, recurse)


def _refuse_deepcopy(memo):
    """copy.deepcopy(module): the copy's hooks would gather and wait for the original's parameters."""
    raise RuntimeError("this module is sharded by zero.initialize, and a deep copy carries its hooks: copy the module "
                       "before zero.initialize (an EMA, AveragedModel), then update it from zero.full_state_dict")


def _refuse_pickling(protocol):
    raise RuntimeError("this module is sharded by zero.initialize, and pickling or copying it (torch.save(model), "
                       "copy.copy) would carry zero's hooks and buffers: save zero.full_state_dict(model) (the whole "
                       "weights, a collective) or zero.save_checkpoint(path, model, optimizer); copy a module before "
                       "zero.initialize")


def _refuse_load_state_dict(*args):
    raise RuntimeError("this module is sharded by zero.initialize, and load_state_dict would write around the shards: "
                       "load weights before zero.initialize, or use zero.load_checkpoint(path, model, optimizer)")


def _refuse_registration(module, name, param):
    """torch's global register_parameter hook: a parametrization would move a laid-out weight out of zero's buffers
    with set_(), and a new tie would hand one module another's shard (new parameters: _refuse_lost_writes)."""
    if getattr(param, "_zero_laid_out", False) and module._parameters.get(name) is not param:
        raise RuntimeError(f"{type(param).__name__} {tuple(param.shape)} is laid out by zero.initialize, and "
                           f"registering it as {type(module).__name__}.{name} would move it out of zero's buffers "
                           f"(a parametrization) or tie it anew: register parametrizations and tie weights before "
                           f"zero.initialize")


torch.nn.modules.module.register_module_parameter_registration_hook(_refuse_registration)


def _check(module, optimizer_class, stage, group, param_groups, bucket_numel, param_dtype, reduce_dtype,
           loss_scale, prefetch, reduction, init_fn, device, tp_group, optimizer_kwargs, check_timeout):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("zero.initialize needs a process group: call torch.distributed.init_process_group"
                           "('gloo' on CPU, 'nccl' on GPU) first")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (got {stage!r})")
    for name, g in (("group", group), ("tp_group", tp_group)):
        if isinstance(g, int) and g == dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives the ranks left out
            raise ValueError(f"this rank is not in {name} (new_group returned NON_GROUP_MEMBER here): call "
                             f"zero.initialize on the group's ranks only")
        if g is not None and not isinstance(g, dist.ProcessGroup):
            raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None (got {type(g).__name__}): "
                            f"make one with dist.new_group(ranks)")
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        # dp ranks of one tp group would start from one slice and average different slices' gradients, silently
        both = sorted(set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
                      & set(dist.get_process_group_ranks(tp_group)))
        if len(both) > 1:
            raise ValueError(f"group ({'the world, by default' if group is None else 'the data-parallel group'}) and "
                             f"tp_group share ranks {both}, which hold different tensor-parallel slices: pass the "
                             f"groups of a (dp, tp) mesh: dp_group, tp_group = gpt.make_mesh(dp, tp)")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module (got {type(module).__name__})")
    if any(getattr(m.__dict__.get("_apply"), "func", None) is _refuse_conversion for m in module.modules()):
        raise ValueError("this module (or one inside or around it) was already sharded by zero.initialize: keep the "
                         "model and optimizer it returned")
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("module is wrapped in DistributedDataParallel, whose reducer would all-reduce every gradient "
                        "again: pass the module inside, ddp.module")
    if isinstance(optimizer_class, torch.optim.Optimizer):
        raise TypeError(f"pass the optimizer class, not an instance: zero.initialize(module, "
                        f"torch.optim.{type(optimizer_class).__name__}, stage=..., lr=...), its arguments as keywords")
    cls, options = (optimizer_class.func, optimizer_class.keywords) if isinstance(optimizer_class, functools.partial) \
        else (optimizer_class, {})
    if not (isinstance(cls, type) and issubclass(cls, ELEMENTWISE_OPTIMIZERS)):
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"{getattr(cls, '__name__', cls)} cannot be sharded exactly: "
                         f"ZeRO splits the update across ranks, exact only for elementwise optimizers ({names})")
    chosen = {**options, **optimizer_kwargs}
    if chosen.get("fused") or any(g.get("fused") for g in param_groups or ()):
        raise ValueError("fused=True optimizers are not layout invariant (a shard updates to other bits "
                         "than the whole tensor): use fused=False, or foreach=True for speed")
    if chosen.get("differentiable") or any(g.get("differentiable") for g in param_groups or ()):
        raise ValueError("differentiable=True: zero's step updates its shards of the weights, which no graph "
                         "reaches: use differentiable=False (as DDP's optimizer would need too)")
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be torch.float32, torch.bfloat16 or torch.float16 (got {dtype})")
    if loss_scale is not None and (isinstance(loss_scale, bool) or  # (True would be a static scale of 1)
                                   not isinstance(loss_scale, (int, float, DynamicLossScale))):
        raise TypeError(f"loss_scale must be a number or a zero.DynamicLossScale (got {type(loss_scale).__name__}): "
                        f"zero.DynamicLossScale() for dynamic scaling, the default under fp16")
    scale = loss_scale.init_scale if isinstance(loss_scale, DynamicLossScale) else loss_scale
    # held in fp32, as GradScaler's: one that rounds to 0 makes every gradient 0, unscaled by 1/0 into NaN
    if scale is not None and not 0 < _fp32(scale) < math.inf:
        raise ValueError(f"loss_scale must be positive and finite in fp32 (got {scale!r}): a number for a static "
                         f"scale, zero.DynamicLossScale() for a dynamic one (DeepSpeed's loss_scale=0)")
    dynamic = loss_scale if isinstance(loss_scale, DynamicLossScale) else None
    if dynamic and not (dynamic.growth_factor > 1 and 0 < dynamic.backoff_factor < 1 and
                        0 <= dynamic.min_scale <= dynamic.init_scale):
        raise ValueError(f"{loss_scale}: growth_factor must be above 1, backoff_factor between 0 and 1 and min_scale "
                         f"from 0 to init_scale (else the scale grows on overflow or shrinks on clean steps)")
    seconds = check_timeout.total_seconds() if isinstance(check_timeout, datetime.timedelta) else check_timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ValueError(f"check_timeout must be a positive number of seconds or a datetime.timedelta (got "
                         f"{check_timeout!r}): how long a rank waits for the others at a stage-3 gather or a "
                         f"zero collective call")
    params = list(module.parameters())
    if not any(p.numel() for p in params):
        raise ValueError("module has no parameters to shard" + (" (every one has 0 elements)" if params else ""))
    on_meta = [name for name, p in module.named_parameters() if p.is_meta]
    if on_meta and len(on_meta) < len(params):
        raise ValueError(f"parameters {on_meta[:3]}... are on the meta device and the others are not: build the "
                         f"whole module on meta (with torch.device('meta'): ...) and pass init_fn, or none of it")
    if on_meta and init_fn is None:
        raise ValueError("the module is on the meta device: pass init_fn, a function that fills one submodule's "
                         "own parameters in place, e.g. init_fn=lambda m: m.reset_parameters()")
    if init_fn is not None and not on_meta:
        raise ValueError(f"init_fn initialises a module built on the meta device, but this one is on "
                         f"{params[0].device} and already initialised: drop init_fn")
    if device is not None and not on_meta:
        want, have = torch.device(device), params[0].device
        if want.type != have.type or None not in (want.index, have.index) and want.index != have.index:
            fix = "build it under torch.device('meta') and pass init_fn" if want.type == "meta" else \
                f"move it before zero.initialize (module.to({str(device)!r}))"
            raise ValueError(f"device places a module built on the meta device, but this one is on {have} "
                             f"already: {fix}, or drop device")
    for name, p in module.named_parameters():
        if getattr(p, "_zero_laid_out", False):  # a Parameter another model shares (a module is caught above)
            raise ValueError(f"parameter {name} is laid out already by zero.initialize of another module: give models "
                             f"that share a parameter as one module (an nn.ModuleDict of both)")
        if p.is_complex():
            raise TypeError(f"parameter {name} has dtype {p.dtype}: ZeRO shards real floating-point parameters "
                            f"only; hold it real, nn.Parameter(torch.view_as_real(w)), and use "
                            f"torch.view_as_complex(self.{name.rsplit('.', 1)[-1]}) in forward")
        if not p.is_floating_point():
            raise TypeError(f"parameter {name} has dtype {p.dtype}: ZeRO shards floating-point parameters "
                            f"only; register it as a buffer instead")
    kinds = collections.Counter((p.dtype, p.device) for p in params)
    if len(kinds) > 1:
        names = {kind: next(n for n, p in module.named_parameters() if (p.dtype, p.device) == kind) for kind in kinds}
        raise ValueError("the parameters differ in dtype or device: " + ", ".join(
            f"{n} {d} on {v} ({kinds[d, v]} like it)" for (d, v), n in names.items()) + "; move the module to "
            f"one dtype and device (fp32; for 16-bit compute pass param_dtype)")
    by_storage = collections.defaultdict(list)  # parameters made from one tensor's data (q, k = w[:, :4], w[:, 4:])
    for name, p in module.named_parameters():
        if p.numel():  # (on meta, where every data_ptr is 0, by the storage itself)
            by_storage[p.untyped_storage()._cdata if p.is_meta else p.untyped_storage().data_ptr()].append((name, p))
    for shared in (s for s in by_storage.values() if len(s) > 1):
        taken = torch.zeros(shared[0][1].untyped_storage().nbytes() // shared[0][1].element_size(), dtype=torch.bool)
        for j, (name, p) in enumerate(shared):
            mine = taken.as_strided(p.shape, p.stride(), p.storage_offset())  # its elements of the storage
            if mine.any():  # torch.optim steps both in one memory; zero's buffers would part them
                raise ValueError(f"parameter {name} shares memory with {[n for n, _ in shared[:j]]} (one made from "
                                 f"another's data): make one parameter and take views of it in forward")
            mine.fill_(True)
    strided = [name for name, p in module.named_parameters() if not p.is_contiguous()]
    if strided:  # a view of the flat buffer is row-major; DDP keeps the layout, and kernels follow the weight's
        warnings.warn(f"{strided[0]} ({len(strided)} parameter(s)) is not contiguous: zero.initialize lays every "
                      f"parameter out contiguous in its buffer, as FSDP and DeepSpeed do, so convolutions and matmuls "
                      f"compute in that layout and the bits may differ from DDP's; pass inputs in channels_last to "
                      f"compute a convolution in it")
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None:
            if stage == 3:
                where = "at stage 3 into a gathered copy, freed after the forward: the renormalisation would be lost"
            elif param_dtype in (torch.bfloat16, torch.float16):
                where = (f"with param_dtype={param_dtype} into a 16-bit copy the step overwrites from the fp32 master: "
                         f"the renormalisation would be lost")
            elif stage == 0:
                where = "the rows of this rank's batch alone: the ranks' copies would part (DDP's do)"
            else:
                where = (f"at stage {stage} into rows other ranks own, which the all-gather after step() overwrites: "
                         f"the renormalisation would be lost")
            raise ValueError(f"{name or 'the module'} is an nn.{type(m).__name__} with max_norm={m.max_norm}, which "
                             f"renormalises looked-up rows by writing into its weight in forward: here it would write "
                             f"{where}. Build it with max_norm=None (scale the looked-up rows out of place)")
    if param_groups is not None:
        listed = [p for g in param_groups for p in g["params"]]
        if len(listed) != len(set(listed)) or set(listed) - set(params):
            raise ValueError("param_groups must hold only this module's parameters, each at most once")
        missing = [n for n, p in module.named_parameters() if p.requires_grad and p not in set(listed)]
        if missing:
            raise ValueError(f"param_groups leaves out trainable parameters {missing}: add them to a group")
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch must be 0 (off) or more: largest units stage 3 gathers ahead (got {prefetch!r})")
    if bucket_numel is not None and (not isinstance(bucket_numel, int) or isinstance(bucket_numel, bool) or
            bucket_numel < 1):
        raise ValueError(f"bucket_numel must be an int, at least 1 (got {bucket_numel!r}): elements, e.g. int(5e8)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be 'exact' (bit-reproducible) or 'native' (the backend's own) "
                         f"(got {reduction!r})")


COLLECTIVE_CALLS = ("save_checkpoint", "load_checkpoint", "full_state_dict", "full_optimizer_state")


def _all_ranks_call(opt, name, checks=lambda: None):
    """Every rank meets at the start of collective zero.<name> (FlatPartition.meet): a rank calling it alone is
    warned after check_timeout, not left waiting silently for the process group's timeout, and ranks at different
    calls (or a stage-3 gather) raise at once. Each rank first runs `checks`, its own refusals, and its point says
    whether it refused; with a tp_group the points meet over it too, so where any rank of the (dp, tp) mesh
    refused, every rank raises. Returns what `checks` returns."""
    part, calls = opt.partition, len(COLLECTIVE_CALLS)
    point = -1 - COLLECTIVE_CALLS.index(name)
    here = f"rank {part.rank} calls zero.{name}"
    try:
        checked, refusal = checks(), None
    except Exception as e:
        checked, refusal = None, e
    low, high = part.meet(point - calls if refusal else point, here, _call_rule(name), patient=True)
    if opt.tp_group:  # (max, -min) over the tp ranks, whose dp groups met apart
        both = torch.tensor([high, -low], dtype=torch.int64, device=part.flag_device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=opt.tp_group)
        high, low = both[0].item(), -both[1].item()
    if refusal is not None:
        raise refusal
    if low != high:
        other = low if low != point else high
        if other == point - calls:
            raise RuntimeError(f"{here}, which another rank refused (its own error says why), so no rank went on")
        raise RuntimeError(f"{here} while another rank {_doing(other)}: {_call_rule(name)}")
    return checked


def _doing(point):
    """What a rank meeting at `point` does: stage 3 gathers at group indices, zero's calls at -1 - their index in
    COLLECTIVE_CALLS, a call the rank refused at that less len(COLLECTIVE_CALLS)."""
    if point >= 0:
        return "gathers parameters (stage 3: a forward or backward)"
    name = COLLECTIVE_CALLS[(-1 - point) % len(COLLECTIVE_CALLS)]
    return f"calls zero.{name}" if point >= -len(COLLECTIVE_CALLS) else f"refused zero.{name} (its own error says why)"


def _call_rule(name):
    return (f"zero.{name} is a collective: call it on every rank at the same point (each rank holds its own shard), "
            f"not under `if rank == 0:`")


def _engine(module, optimizer=None):
    """The ZeroOptimizer zero.initialize returned with `module` (checking `optimizer` is it), and that module: `module`
    itself, or the one inside a wrapper made after (torch.compile's)."""
    if not isinstance(getattr(module, "_zero", None), ZeroOptimizer):
        raise ValueError("this module was not returned by zero.initialize: pass the model it returned (model, "
                         "optimizer = zero.initialize(...)), not a module inside it or a wrapper made around it")
    if optimizer is not None and optimizer is not module._zero:
        raise ValueError("the optimizer given is not the one zero.initialize returned with this model, whose state "
                         "the checkpoint holds: pass the pair it returned (model, optimizer = zero.initialize(...))")
    return module._zero, module._zero.module()


def model_state_bytes(module):
    """Bytes of the distinct storages of this rank's parameters, gradients and optimizer states (freed ones: 0)."""
    opt, module = _engine(module)
    tensors = [p.grad for p in opt.partition.params if p.grad is not None]
    tensors += opt.parameters.storages() + opt.gradients.storages()  # the parameters are views of these
    tensors += [opt.master] if opt.master is not None else []
    tensors += [v for state in opt.optim.state.values() for v in state.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def full_state_dict(module):
    """{name: full CPU tensor} for every parameter and buffer (floats in fp32 or wider), and rank 0's extra states,
    keyed as module.state_dict(), the same on every rank of the data-parallel group (each tp rank gets its slices).
    A collective. Gathered a bucket at a time: the device holds one bucket more."""
    opt, module = _engine(module)
    _all_ranks_call(opt, "full_state_dict", opt._refuse_lost_writes)
    opt._refuse_differing_writes()
    # the weights whole: stages 0-2's flat buffer as it is, else the fp32 master or stage 3's shard, gathered
    flat = opt._to_flat("weights") if opt.master is not None or opt.parameters.in_own_space else opt.parameters.flat
    part, state = opt.partition, {}
    for name, t in module.state_dict(keep_vars=True).items():
        if _is_extra(name):  # a module's get_extra_state(), whatever it is: rank 0's
            box = [copy.deepcopy(t)]
            dist.broadcast_object_list(box, group_src=0, group=part.group)
            state[name] = box[0]
            continue
        if t in part.index:
            a = part.offsets[part.index[t]]
            value = flat[a:a + t.numel()].view(t.shape)
        else:  # a buffer: rank 0's, as the next forward would see it
            value = t.detach().clone()
            dist.broadcast(value, group_src=0, group=part.group)
        # one copy, to the CPU and to fp32 (or wider) at once: the state shares no storage with the model
        wide = torch.promote_types(value.dtype, torch.float32) if value.is_floating_point() else value.dtype
        state[name] = value.to("cpu", wide, copy=True)
    return state


def full_optimizer_state(module):
    """{parameter name: {state key: full CPU tensor}}, as one unsharded optimizer would hold it. A collective."""
    opt, module = _engine(module)
    _all_ranks_call(opt, "full_optimizer_state")
    keys, scalars, keys_of = opt._all_states()  # elementwise keys; per parameter with state: scalars, its keys
    params = {n: p for n, p in module.named_parameters() if n in scalars}  # in module order
    result = {name: {key: v.cpu() if torch.is_tensor(v) else v for key, v in scalars[name].items()}
              for name in params}
    for key in keys:  # one gather per elementwise state
        full = opt._to_flat(key)
        for name, p in params.items():
            if key in keys_of[name]:  # (a group with amsgrad=False has no max_exp_avg_sq)
                a = opt.partition.offsets[opt.partition.index[p]]
                result[name][key] = full[a:a + p.numel()].view(p.shape).clone()
    return result


# -----------------------------------------------------------------------------------------
# Checkpoints: rank r owns chunk r of every bucket (Section 5), its shard, and writes it a chunk at a time: one raw
# file for the weights (the fp32 master where there is one), one per elementwise optimizer state; manifest.json
# holds the layout and each file's sha256. Flat element x lies in bucket k's chunk (x - start_k) // chunk_k, at
# own_k + (x - start_k) % chunk_k of that rank's shard: a checkpoint loads at any Nd, stage or bucket size.
FORMAT = 3  # (format 2, whose shard files were torch.save'd tensors, still loads)


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete or for another model. extra: the rank's saved extra where it could
    be read (a job's flags in it can say which changed), else None."""

    def __init__(self, message, extra=None):
        super().__init__(message)
        self.extra = extra


def save_checkpoint(path, model, optimizer, **extra):
    """Save into the new directory `path` on every rank (a collective), via path.partial, renamed once every rank has
    written: a crash mid-save leaves none. extra: this rank's own values (the step), returned by load_checkpoint."""
    (opt, model), path = _engine(model, optimizer), pathlib.Path(path)

    def checks():
        opt._refuse_lost_writes()
        if path.exists():
            raise FileExistsError(f"{path} exists: save each checkpoint into a new directory (e.g. step_000100)")
        _refuse_pending_gradients(opt, "save_checkpoint", "they are not saved")

    _all_ranks_call(opt, "save_checkpoint", checks)
    opt._refuse_differing_writes()
    part, group = opt.partition, opt.partition.group
    partial = path.with_name(path.name + ".partial")
    if opt.tp_group:  # each tp slice is saved over a dp group of its own: into one path they would race
        paths = [None] * dist.get_world_size(opt.tp_group)
        dist.all_gather_object(paths, os.path.abspath(path), group=opt.tp_group)
        if len(set(paths)) < len(paths):
            raise ValueError(f"every tensor-parallel slice into {path}: each is a checkpoint of its own; give each "
                             f"its own directory, e.g. f'{path}/tp{{tp_rank}}', tp_rank = dist.get_rank(tp_group)")

    made = []  # (rank 0's) the directories above path this save makes, innermost first: each synced in its parent

    def discard():  # a failed save leaves the file system as it found it
        shutil.rmtree(partial, ignore_errors=True)
        for d in made:
            with contextlib.suppress(OSError):  # (not emptied: another process wrote into it since)
                d.rmdir()

    def make_partial():
        shutil.rmtree(partial, ignore_errors=True)
        made.extend(d for d in partial.parents if not d.exists())
        try:
            partial.mkdir(parents=True)
        except BaseException:  # (made some: path.partial's name too long, say)
            discard()
            raise

    _on_rank0(group, f"saving {path}", make_partial)
    files, (keys, scalars, keys_of), error = {}, opt._all_states(), None
    try:
        for key, value in extra.items():
            _loadable(value, f"extra {key}={type(value).__name__}")
        for key in ["weights"] + keys:  # (shard_numel,): bucket k's chunk at own_k
            name = f"rank{part.rank}.{key}.bin"
            with open(partial / name, "wb") as f:
                for k in sorted(range(len(part.buckets)), key=lambda k: part.buckets[k].own):
                    _raw(opt._saved_chunk(key, k)).tofile(f)
            _seal(partial, files, name)
        buffers, extra_states = _buffers_and_extra_states(model)
        _loadable(extra_states, "a module's get_extra_state()")
        rest = f"rank{part.rank}.rest.pt"
        files[rest] = {"rng": torch.get_rng_state(), "extra": extra, "buffers": buffers, "persistent": list(buffers),
                       "extra_states": extra_states}
        if part.device.type == "cuda":  # the device's own generator (dropout on the GPU)
            files[rest]["cuda_rng"] = torch.cuda.get_rng_state(part.device)
        torch.save(files[rest], partial / rest)
        _seal(partial, files, rest)
        if part.rank == 0:  # every parameter's scalar states (AdamW's step), one file for all
            torch.save(scalars, partial / "scalars.pt")
            _seal(partial, files, "scalars.pt")
            manifest = _layout(opt, model)
            for key, value in ((k, v) for g in manifest["param_groups"] for k, v in g.items()):
                if repr(json.loads(json.dumps(value, default=repr))) != repr(value):  # (by repr: NaN is NaN)
                    raise TypeError(f"param_group option {key}={value!r} would not load back from the manifest's "
                                    f"JSON as it is: hold options as numbers, strings, bools, None, tensors, or "
                                    f"lists and str-keyed dicts of them")
    except Exception as e:  # every rank learns of it: none may wait for a rank that failed
        error = f"rank {part.rank}: {type(e).__name__}: {e}"
    everyone = [None] * part.nd  # (shares alike in size: padding to the largest costs little)
    dist.all_gather_object(everyone, (error, {} if error else files), group=group)  # files: name -> [bytes, sha256]
    if any(err for err, _ in everyone):
        if part.rank == 0:  # every rank is done writing into it
            discard()
        raise RuntimeError(f"saving {path} failed, the checkpoint was not written: "
                           f"{'; '.join(err for err, _ in everyone if err)}")

    def publish():
        try:
            manifest.update(format=FORMAT, torch=torch.__version__, nd=part.nd, state_keys=keys, state_keys_of=keys_of,
                            files={name: digest for _, f in everyone for name, digest in f.items()})
            manifest["sha256"] = _manifest_digest(manifest)
            (partial / "manifest.json").write_text(json.dumps(manifest, indent=1))
            for synced in (partial / "manifest.json", partial):  # on disk before the name is: a power loss
                _sync(synced)  # after the return leaves the checkpoint whole, or this save not made
            os.replace(partial, path)  # atomic: the checkpoint appears whole or not at all
        except BaseException:  # (a full disk): no partial copy of the model is left behind
            discard()
            raise
        try:  # the new names: path's, and those of the directories made for it
            for directory in [path.parent] + [d.parent for d in made]:
                _sync(directory)
        except OSError as e:  # (the checkpoint is in place, and loads)
            warnings.warn(f"saved {path}, but its name could not be synced to disk ({e}): a power loss before the "
                          f"system writes it could take the checkpoint back")

    _on_rank0(group, f"saving {path}", publish)


def _on_rank0(group, what, fn):
    """fn() on rank 0, then every rank raises if it failed: none is left waiting for rank 0."""
    error = [None]
    if dist.get_rank(group) == 0:
        try:
            fn()
        except Exception as e:
            error[0] = f"rank 0: {type(e).__name__}: {e}"
    dist.broadcast_object_list(error, group_src=0, group=group)
    if error[0]:
        raise RuntimeError(f"{what} failed, the checkpoint was not written: {error[0]}")


def _refuse_pending_gradients(opt, what, why):
    if opt.gradients.micro_batches > 0 and not opt.gradients.stepped:
        raise RuntimeError(f"{what} after a backward whose gradients no step has used: {why}; call it after "
                           f"optimizer.step() or optimizer.zero_grad()")


EXTRA = torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX  # "_extra_state"


def _is_extra(name):
    return name == EXTRA or name.endswith("." + EXTRA)


def _buffers_and_extra_states(model):
    """({name: buffer} of the buffers a state_dict holds (not a non-persistent one, e.g. a RoPE cache), {state_dict
    key: value} of each module's get_extra_state()), each under every name it has in the state_dict."""
    state, buffers = model.state_dict(keep_vars=True), dict(model.named_buffers(remove_duplicate=False))
    return ({name: buffers[name] for name in state if name in buffers},
            {name: value for name, value in state.items() if _is_extra(name)})


def _loadable(value, what):
    """Raise unless torch.load(weights_only=True), as load_checkpoint reads, gives `value` back."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as e:  # a lambda, a lock
        raise TypeError(f"{what} cannot be saved ({type(e).__name__}: {e}): save plain values (numbers, strings, "
                        f"tensors, and lists and dicts of them)") from e
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as e:
        raise TypeError(f"{what} could not be loaded back by load_checkpoint's torch.load(weights_only=True): save "
                        f"plain values, e.g. vars(args) for an argparse.Namespace") from e


def _raw(t):
    """t's elements as bytes in CPU memory (a view where t is there already)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


def _sync(path):
    """fsync a file, or a directory's entries (the names in it; a file system that cannot, as some network ones,
    raises EINVAL for a directory: there the names are as safe as it makes them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL or not os.path.isdir(path):
            raise
    finally:
        os.close(fd)


def _seal(directory, files, name):
    """files[name] = [bytes, sha256] of the file just written into directory, synced to disk."""
    with open(directory / name, "rb") as f:
        os.fsync(f.fileno())
        files[name] = [os.path.getsize(directory / name), hashlib.file_digest(f, "sha256").hexdigest()]


def _layout(opt, model):
    part, names, aliases = opt.partition, opt.names, collections.defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        if name != names[p]:  # a tied weight's other names
            aliases[p].append(name)
    return dict(psi=sum(p.numel() for p in part.params),
                params=[dict(name=names[p], shape=list(p.shape), offset=part.offsets[i], aliases=aliases[p])
                        for i, p in enumerate(part.params)],
                buckets=[[b.start, b.numel, b.chunk, b.own] for b in part.buckets],
                dtype=str(opt.weights_dtype).removeprefix("torch."),  # of the weights and the states
                param_dtype=str(opt.precision.param_dtype).removeprefix("torch."),
                optimizer=type(opt.optim).__name__,
                param_groups=[{**{k: _as_json(v) for k, v in g.items() if k != "params"},
                               "params": [names[p] for p in members]}
                              for g, members in zip(opt.optim.param_groups, opt.group_members)],
                loss_scale=opt.loss_scale if opt.scaler else None, clean_steps=opt.clean_steps, tp=_tp_slice(opt))


def _tp_slice(opt):
    """[tp rank, tp size] of this rank's slice: every slice has the same names and shapes, only this differs."""
    return [dist.get_rank(opt.tp_group), dist.get_world_size(opt.tp_group)] if opt.tp_group else [0, 1]


def _mismatch(opt, model, manifest):
    """Why this model and optimizer cannot take the checkpoint (empty: they can)."""
    saved = {p["name"]: p["shape"] for p in manifest["params"]}
    live = {n: list(p.shape) for n, p in model.named_parameters()}
    # a tied weight's second name -> its first, here and saved
    tied = {n: opt.names[p] for n, p in model.named_parameters(remove_duplicate=False) if n != opt.names[p]}
    saved_tied = {a: p["name"] for p in manifest["params"] for a in p.get("aliases", [])}
    problems = []
    for n, s in saved.items():
        if n in tied and saved_tied.get(tied[n]) == n:  # saved under this name first, here the second name
            problems.append(f"a weight tied the other way: {n} is saved first, here a second name of {tied[n]}: "
                            f"register {n}'s module first, as when saved")
        elif n in tied:
            problems.append(f"another model: {n} is tied to {tied[n]} here, a weight of its own in the checkpoint")
        elif live.get(n) != s:
            here = "not in this model" if n not in live else f"{live[n]} here, {s} saved"
            problems.append(f"another model: {n} is {here}")
    problems += [f"another model: {n} is tied to {saved_tied[n]} in the checkpoint, a weight of its own here"
                 for n in live if n in saved_tied and tied.get(saved_tied[n]) != n]  # (not tied the other way)
    problems += [f"another model: {n} is not in the checkpoint" for n in live if n not in saved and n not in saved_tied]
    saved = (manifest["dtype"], manifest["param_dtype"])
    live = tuple(str(t).removeprefix("torch.") for t in (opt.weights_dtype, opt.precision.param_dtype))
    if saved != live:
        problems.append(f"another dtype: saved with {saved[0]} weights computing in {saved[1]}, this model has "
                        f"{live[0]} weights computing in {live[1]}: initialize with the checkpoint's dtypes")
    live = _tp_slice(opt)
    if manifest.get("tp", live) != live:  # (a manifest without it: not checked)
        saved = manifest["tp"]
        problems.append(f"another tensor-parallel slice: saved by tp rank {saved[0]} of {saved[1]}, this is tp rank "
                        f"{live[0]} of {live[1]}: load the checkpoint this tp rank saved")
    if manifest["optimizer"] != type(opt.optim).__name__:
        problems.append(f"another optimizer: {manifest['optimizer']} saved, {type(opt.optim).__name__} here: pass "
                        f"zero.initialize the optimizer class it was saved with")
    saved = [g["params"] for g in manifest["param_groups"]]
    live = [[opt.names[p] for p in members] for members in opt.group_members]
    if saved != live:
        problems.append(f"other param_groups: saved {[len(g) for g in saved]} parameters per group (first "
                        f"{[g[:1] for g in saved]}), here {[len(g) for g in live]} (first {[g[:1] for g in live]}): "
                        f"build the groups as they were saved")
    return problems


def _read_own(opt, reader, key, into):
    """Read `key` ("weights" or a state) into this rank's owned ranges: into(f, o), flat slice f at own slice o."""
    part, names = opt.partition, opt.names
    for (f, o), b in zip(opt.owned, part.buckets):
        dest = into(f, o)
        for i, lo, hi in b.segments:
            lo, hi = max(lo, f.start), min(hi, f.stop)
            if lo < hi:
                at = reader.params[names[part.params[i]]]["offset"] + lo - part.offsets[i]
                reader.read(key, at, hi - lo, dest[lo - f.start:hi - f.start])


def _read_piece(opt, reader, key, piece, out):
    """Read state `key` of one piece into out (the piece's length), segment by segment of its parameter."""
    part, i = opt.partition, piece.index
    saved_at = reader.params[opt.names[part.params[i]]]["offset"] - part.offsets[i]  # flat here -> flat saved
    for k, lo, hi in part.segments_of[i]:
        f, o = opt.owned[k]
        lo, hi = max(lo, f.start), min(hi, f.stop)
        at = o.start + lo - f.start - piece.own.start  # where flat lo lies in the piece
        if lo < hi and 0 <= at < len(out):
            reader.read(key, saved_at + lo, hi - lo, out[at:at + hi - lo])


def load_checkpoint(path, model, optimizer):
    """Restore, on every rank (a collective), at any Nd, stage or bucket size, what save_checkpoint saved (weights,
    optimizer states, loss scale, buffers, RNG state); returns extra. All is checked before anything is written."""
    (opt, model), path = _engine(model, optimizer), pathlib.Path(path)

    def checks():
        _refuse_pending_gradients(opt, "load_checkpoint", "they would be added to the loaded weights' next step")
        return _read_manifest(path)

    manifest = _all_ranks_call(opt, "load_checkpoint", checks)
    part = opt.partition
    problems = [f"{name}: {why}" for i, name in enumerate(sorted(manifest["files"])) if i % part.nd == part.rank
                for why in [_damage(path / name, *manifest["files"][name])] if why]
    problems += _mismatch(opt, model, manifest)
    reader = CheckpointReader(path, manifest)
    (live, live_extra_states), rest = _buffers_and_extra_states(model), None
    try:  # the small files are unpickled now, so one that fails does before anything is written
        rest, buffers, scalars = reader.rest(part.rank % manifest["nd"]), reader.rest(0)["buffers"], reader.scalars()
        saved = {n: list(buffers[n].shape) for n in reader.rest(0).get("persistent", buffers)}
        here = {n: list(b.shape) for n, b in live.items()}
        problems += [f"another model: buffer {n} is {here.get(n, 'not in this model')} here, "
                     f"{saved.get(n, 'not')} saved"
                     for n in sorted(set(saved) | set(here)) if saved.get(n) != here.get(n)]
        extra_states = reader.rest(0).get("extra_states")  # None: saved before they were; the model's are kept
        if extra_states is not None:
            problems += [f"another model: {n} {'is not saved' if n not in extra_states else 'is not in this model'}"
                         for n in sorted(set(extra_states) ^ set(live_extra_states))]
    except Exception as e:
        files = list(dict.fromkeys([f"rank{part.rank % manifest['nd']}.rest.pt", "rank0.rest.pt"]))  # (once each)
        first_line = str(e).partition("\n")[0]  # (an error without a message has no line)
        problems.append(f"{', '.join(files)} or scalars.pt cannot be read: {type(e).__name__}: {first_line}")
    everyone = [None] * part.nd
    dist.all_gather_object(everyone, problems, group=part.group)
    problems = sorted({p for ps in everyone for p in ps})
    if problems:
        raise CheckpointError(f"cannot load {path}: " + "; ".join(problems), extra=rest and _copied(rest["extra"]))
    opt.parameters.wait()
    if opt.master is not None:  # the master, then the 16-bit parameters from it
        _read_own(opt, reader, "weights", lambda f, o: opt.master[o])
        opt.parameters.copy_owned(opt.owned, opt.master)
    else:
        _read_own(opt, reader, "weights", opt.parameters.owned)
    opt._count_writes(part.params)  # (before after_step records the versions its all-gather is issued at)
    opt.parameters.after_step(frozen_too=True)
    opt.parameters.wait()
    opt._written_since_step()  # writes before the load are overwritten by it, as they should be
    dropped = [opt.names[p] for p in part.params[opt.n_trainable:] if opt.names[p] in scalars]
    if dropped:  # (a gradual unfreezing that freezes at initialize would restart their moments unseen)
        warnings.warn(f"load_checkpoint: {dropped[:3]} ({len(dropped)} parameter(s)) have optimizer state in {path}, "
                      f"but had requires_grad=False at zero.initialize, which keeps no state for them: it is dropped. "
                      f"To keep it, freeze them after zero.initialize")
    opt.optim.state.clear()
    capturable = {w: g.get("capturable", False) for g in opt.optim.param_groups for w in g["params"]}
    for piece, w in zip(opt.pieces, opt.weights):
        name = opt.names[part.params[piece.index]]
        for key in _keys_of(manifest, scalars, name):  # a tensor per state the piece had, as the optimizer makes them
            opt.optim.state[w][key] = torch.zeros_like(w)
            _read_piece(opt, reader, key, piece, opt.optim.state[w][key])
        for key, value in scalars.get(name, {}).items():  # placed as torch.optim's load_state_dict places them:
            if torch.is_tensor(value):  # step in CPU memory (capturable: an fp32 one on the device), others on it
                value = value.clone() if key == "step" and not capturable[w] else \
                    value.to(w.device, torch.float32 if key == "step" else value.dtype, copy=True)
            opt.optim.state[w][key] = value
    for group, saved in zip(opt.param_groups, manifest["param_groups"]):
        group.update({k: _as_held(group.get(k), v) for k, v in saved.items() if k != "params"})
    # a dynamic scale goes on where one was saved; a static one is the number passed
    if opt.scaler and not opt.static_scale and manifest["loss_scale"] is not None:
        opt.loss_scale, opt.clean_steps = _fp32(manifest["loss_scale"]), manifest["clean_steps"]
    for name, b in live.items():
        b.copy_(buffers[name])
    for name, value in (extra_states or {}).items():
        model.get_submodule(name[:-len(EXTRA)].rstrip(".")).set_extra_state(_copied(value))
    if manifest["nd"] == part.nd:  # each rank its own random stream; at another Nd the streams differ
        torch.set_rng_state(rest["rng"])
        if "cuda_rng" in rest and part.device.type == "cuda":
            torch.cuda.set_rng_state(rest["cuda_rng"], part.device)
    return _copied(rest["extra"])


def _keys_of(manifest, scalars, name):
    """The elementwise state keys parameter `name` had when saved (none: it had no state)."""
    if name not in scalars:
        return []
    return manifest["state_keys_of"][name] if "state_keys_of" in manifest else manifest["state_keys"]


def _as_json(option):
    """A param_group option for the manifest: a tensor (lr, betas of tensors) as value and dtype, to load as one."""
    if torch.is_tensor(option):
        return {"tensor": option.tolist(), "dtype": str(option.dtype).removeprefix("torch.")}
    if isinstance(option, (tuple, list)):
        return [_as_json(x) for x in option]
    return option


def _as_held(live, saved):
    """A saved option in the live group's form (live None, in consolidate: tuples come back lists; torch takes both)."""
    if isinstance(saved, dict) and "tensor" in saved:
        device = live.device if torch.is_tensor(live) else "cpu"
        return torch.tensor(saved["tensor"], dtype=getattr(torch, saved["dtype"]), device=device)
    if isinstance(saved, list):
        lives = list(live) if isinstance(live, (tuple, list)) and len(live) == len(saved) else [None] * len(saved)
        held = [_as_held(a, b) for a, b in zip(lives, saved)]
        return tuple(held) if isinstance(live, tuple) else held
    if torch.is_tensor(live):  # a number saved for a tensor option
        return torch.tensor(saved, dtype=live.dtype, device=live.device)
    return saved


def consolidate(path, out=None):
    """A checkpoint as plain torch {"model": state_dict, "optimizer": state_dict}: tied weights under every name, the
    fp32 master where there was one. Reads a tensor at a time, needs no process group; `out`: also torch.save it."""
    path = pathlib.Path(path)
    manifest = _read_manifest(path)
    for name, (size, digest) in manifest["files"].items():
        why = _damage(path / name, size, digest)
        if why:
            raise CheckpointError(f"cannot consolidate {path}: {name}: {why}")
    reader = CheckpointReader(path, manifest)
    model = {}
    for p in manifest["params"]:
        weights = reader.param(p["name"], "weights")
        for name in [p["name"]] + p["aliases"]:  # a tied weight under each of its names
            model[name] = weights
    rest = reader.rest(0)
    for name in rest.get("persistent", rest["buffers"]):  # floating point in fp32 or wider, as full_state_dict
        b = rest["buffers"][name]
        model[name] = b.to(torch.promote_types(b.dtype, torch.float32) if b.is_floating_point() else b.dtype,
                           copy=True)
    model.update(_copied(rest.get("extra_states", {})))
    scalars, state, groups, index = reader.scalars(), {}, [], 0
    for saved in manifest["param_groups"]:
        groups.append({**{k: _as_held(None, v) for k, v in saved.items() if k != "params"},
                       "params": list(range(index, index + len(saved["params"])))})
        for name in saved["params"]:
            entry = {**{k: reader.param(name, k) for k in _keys_of(manifest, scalars, name)},
                     **_copied(scalars.get(name, {}))}
            if entry:
                state[index] = entry
            index += 1
    result = {"model": model, "optimizer": {"state": state, "param_groups": groups}}
    if out is not None:
        torch.save(result, out)
    return result


class CheckpointReader:
    """Reads ranges of the flat space out of the rank files, memory-mapped: only what is asked for is read."""

    def __init__(self, path, manifest):
        self.path, self.manifest, self.files = path, manifest, {}
        self.shard_file = "rank{}.{}.pt" if manifest["format"] == 2 else "rank{}.{}.bin"
        self.starts = [b[0] for b in manifest["buckets"]]
        self.params = {p["name"]: p for p in manifest["params"]}

    def _file(self, name):
        if name not in self.files:
            if name.endswith(".bin"):  # raw elements in the checkpoint's dtype, mapped, not read
                dtype = getattr(torch, self.manifest["dtype"])
                size = (self.path / name).stat().st_size // dtype.itemsize
                self.files[name] = torch.from_file(str(self.path / name), shared=False, size=size, dtype=dtype)
            else:  # torch.save'd, mapped too, in CPU memory wherever they were saved (a GPU's load without one, and
                # no rank puts rank 0's buffers on rank 0's GPU); what leaves the load is copied (see _copied)
                self.files[name] = torch.load(self.path / name, mmap=True, weights_only=True, map_location="cpu")
        return self.files[name]

    def read(self, key, x, n, out):
        """Flat elements [x, x + n) of `key` into out (n,)."""
        done = 0
        while done < n:
            k = bisect.bisect_right(self.starts, x + done) - 1
            start, numel, chunk, own = self.manifest["buckets"][k]
            rank, at = divmod(x + done - start, chunk)
            m = min(n - done, chunk - at, start + numel - (x + done))
            out[done:done + m] = self._file(self.shard_file.format(rank, key))[own + at:own + at + m]
            done += m

    def param(self, name, key):
        p = self.params[name]
        out = torch.empty(math.prod(p["shape"]), dtype=getattr(torch, self.manifest["dtype"]))
        self.read(key, p["offset"], out.numel(), out)
        return out.view(p["shape"])

    def rest(self, rank):
        return self._file(f"rank{rank}.rest.pt")

    def scalars(self):
        return self._file("scalars.pt")


def _copied(value):
    """value with each tensor in it copied out of its mapped file, so that nothing handed out keeps the file open
    (ties, views and Parameters as torch.load gave them)."""
    return copy.deepcopy(value)


def _read_manifest(path):
    if not (path / "manifest.json").is_file():
        slices = sorted(f.parent.name for f in path.glob("tp*/manifest.json"))
        if slices:  # (train.py's step directory at --tp 2 or more)
            raise CheckpointError(f"{path} holds the tensor-parallel slices {slices}, each a checkpoint of its "
                                  f"own: give one, {path / slices[0]}")
        why = "it does not exist" if not path.exists() else \
            "its save did not finish (a .partial directory)" if path.name.endswith(".partial") else \
            "it has no manifest.json, so its save never completed or it is not a zero checkpoint"
        raise CheckpointError(f"{path} is not a checkpoint: {why}; load a directory save_checkpoint wrote")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}/manifest.json cannot be read ({e}): the checkpoint is damaged; load an "
                              f"earlier one") from None
    version = manifest.get("format") if isinstance(manifest, dict) else None
    if version not in (2, FORMAT):
        raise CheckpointError(f"{path} has format {version}; this zero.py reads formats 2 and {FORMAT}: load it with "
                              f"the zero.py that saved it")
    if "sha256" in manifest and manifest["sha256"] != _manifest_digest(manifest):  # (saved before it had one: none)
        raise CheckpointError(f"{path}/manifest.json was changed or damaged (its sha256 differs from the one saved "
                              f"in it): load an earlier checkpoint")
    return manifest


def _manifest_digest(manifest):
    """sha256 of the manifest less its own digest, taken of the JSON form load reads (int keys come back strings)."""
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != "sha256"}))
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _damage(file, size, digest):
    """Why `file` is not the one the manifest lists, or None."""
    if not file.is_file():
        return "missing: the checkpoint is incomplete; load an earlier one"
    if file.stat().st_size != size:
        return f"truncated or changed ({file.stat().st_size} bytes, {size} saved): load an earlier checkpoint"
    with open(file, "rb") as f:
        if hashlib.file_digest(f, "sha256").hexdigest() != digest:
            return "checksum mismatch: the file is damaged; load an earlier checkpoint"
    return None


if __name__ == "__main__":  # python zero.py consolidate CHECKPOINT_DIR OUT.pt
    import sys
    if len(sys.argv) != 4 or sys.argv[1] != "consolidate":
        raise SystemExit("usage: python zero.py consolidate CHECKPOINT_DIR OUT.pt")
    try:
        consolidate(sys.argv[2], sys.argv[3])
    except CheckpointError as e:
        raise SystemExit(f"python zero.py consolidate: {e}") from None
    print(f"wrote {sys.argv[3]}: {{'model': state_dict, 'optimizer': state_dict}} for plain torch")
