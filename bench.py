"""
bench.py -- zero.py against its peers on one GPT (gpt.py), fp32 AdamW, CPU and gloo: torch DDP,
DDP + ZeroRedundancyOptimizer, FSDP2, DeepSpeed ZeRO-1/2/3 (when installed), zero.py stages 0-3.
Per system: median step time and its ratio to DDP; model-state bytes per rank beside Section 5's
formula; a sampled peak; bytes sent per rank per step beside Section 7; the final loss, which
every system must share (same seed, same weights, same data). docs/benchmarks.md says how it
measures and shows its output.

    python bench.py                                              # world 2, small preset, every system
    python bench.py --world 2 --steps 1 --warmup 1 --repeats 1 --launches 1   # smoke: each row once
    python bench.py --nodes 4 --link 200mbit                     # 4 emulated nodes (root, iproute2)

Progress goes to stderr.
"""
import argparse
import atexit
import contextlib
import ctypes
import functools
import importlib.util
import itertools
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

import memory_table
import ranks
import zero
from gpt import GPT, PRESETS, num_params

MB = 1e6
# system: (label, the ZeRO stage whose Section 5 formula it should meet, Section 7 volume in Ψ)
SYSTEMS = {
    "ddp": ("torch DDP", 0, 2),
    "zero_optimizer": ("DDP + ZeroRedundancyOptimizer", 1, 3),  # all-reduce 2Ψ, then owners broadcast Ψ
    "fsdp2": ("FSDP2 (fully_shard per block)", 3, 3),
    "deepspeed1": ("DeepSpeed ZeRO-1", 1, 2),
    "deepspeed2": ("DeepSpeed ZeRO-2", 2, 2),
    "deepspeed3": ("DeepSpeed ZeRO-3", 3, 3),
    "zero0": ("zero.py stage 0 (baseline DP)", 0, 2),
    "zero1": ("zero.py stage 1 (P_os)", 1, 2),
    "zero2": ("zero.py stage 2 (P_os+g)", 2, 2),
    "zero3": ("zero.py stage 3 (P_os+g+p)", 3, 3),
}
FORMULA = ["16Ψ", "4Ψ+4Ψ+8Ψ/Nd", "4Ψ+12Ψ/Nd", "16Ψ/Nd"]  # Section 5 in fp32: K = 8 (AdamW's two moments)
SEED = 1337


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, help="ranks: the data-parallel degree Nd (default 2; --nodes N: N)")
    p.add_argument("--nodes", type=int, help="run the ranks as N emulated nodes, one rank each (sets --world; "
                   "needs root and iproute2)")
    p.add_argument("--link", metavar="RATE", help="with --nodes: every node's link capped at RATE each way, "
                   "in tc's units (200mbit, 1gbit)")
    p.add_argument("--model", default="small", choices=list(PRESETS), help="gpt.py preset")
    p.add_argument("--steps", type=int, default=1, help="timed steps per turn, after its one untimed lead-in step")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the first turn")
    p.add_argument("--repeats", type=int, default=4, help="rounds per launch: turns of each system, interleaved")
    p.add_argument("--launches", type=int, default=4,
                   help="times every system (and the clock) is started in new processes, --repeats rounds each")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--json", action="store_true", help="print the rows as one JSON object instead of the table")
    args = p.parse_args(argv)
    if args.nodes is not None:
        if args.nodes < 1:  # checked here: it becomes --world, whose check below would name --world
            p.error(f"--nodes must be at least 1 (got {args.nodes})")
        if args.nodes > 254:  # node r is SUBNET.<r+1>/24: .255 is the broadcast address, .256 none
            p.error(f"--nodes must be at most 254 (got {args.nodes}): the nodes' addresses are {SUBNET}.1-254")
        if args.world is not None and args.world != args.nodes:
            p.error(f"--world {args.world} differs from --nodes {args.nodes}: one rank per node (leave out --world)")
        if args.link is None:
            p.error("--nodes needs --link RATE, the cap on every link (e.g. --link 200mbit)")
        args.world = args.nodes
    elif args.link is not None:
        p.error("--link needs --nodes N")
    if args.world is None:
        args.world = 2
    twice = [s for s in SYSTEMS if args.systems.count(s) > 1]  # each would take two turns a round
    if twice:
        p.error(f"--systems names {', '.join(twice)} more than once: name each system once")
    if unavailable(args.systems) == args.systems:  # none would be left to run
        p.error(f"--systems {' '.join(args.systems)}: deepspeed is not installed (pip install deepspeed): "
                "add a system that does not need it to --systems")
    for name in ("world", "steps", "warmup", "repeats", "launches", "batch_size", "seq_len"):
        least = 0 if name == "warmup" else 1
        if getattr(args, name) < least:
            p.error(f"--{name} must be at least {least} (got {getattr(args, name)})")
    if args.seq_len > PRESETS[args.model].block_size:
        p.error(f"--seq_len {args.seq_len} exceeds the {args.model} model's block_size "
                f"{PRESETS[args.model].block_size}: use --seq_len {PRESETS[args.model].block_size} or less")
    return args


def unavailable(systems):
    """The systems that cannot run here: DeepSpeed's, where deepspeed is not installed."""
    return [s for s in systems if s.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None]


# ---------------------------------------------------------------------------
# The systems: each gives (model, backward, step, settle) for the same GPT and the same AdamW;
# settle() waits for what a step leaves in flight (zero.py stages 1-2: the parameters' all-gather).
# ---------------------------------------------------------------------------
def build(system, args):
    model = GPT(PRESETS[args.model], seed=SEED)  # the same weights on every rank, for every system
    adamw = dict(lr=1e-3, weight_decay=0.1)  # one group, for every system; torch's defaults otherwise
    if system in ("ddp", "zero_optimizer"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        # gradient_as_bucket_view: p.grad is a view of DDP's bucket, 16Ψ in all as in the paper. By
        # default the buckets are a second 4Ψ copy of the gradients (20Ψ, measured with the hook below).
        ddp = DDP(model, gradient_as_bucket_view=True)
        # DDP's reducer calls the process group from C++, past any Python wrapper; torch's own
        # allreduce_hook does the same all-reduce (divide by Nd, sum) through dist.all_reduce
        ddp.register_comm_hook(None, allreduce_hook)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **adamw) \
            if system == "zero_optimizer" else torch.optim.AdamW(model.parameters(), **adamw)
        # set_to_none=False keeps p.grad on the buckets, so every memory sample sees them
        return ddp, torch.Tensor.backward, lambda: (opt.step(), opt.zero_grad(set_to_none=False)), lambda: None
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (args.world,))
        for block in model.h:
            fully_shard(block, mesh=mesh)  # per block: an all-gather in forward and in backward, a reduce-scatter
        fully_shard(model, mesh=mesh)      # the root (embeddings, ln_f, tied output): kept whole until backward
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        return model, torch.Tensor.backward, lambda: (opt.step(), opt.zero_grad()), lambda: None
    if system.startswith("deepspeed"):    # only when importable (see main); ran here with DeepSpeed 0.19.8
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed
        with contextlib.redirect_stdout(sys.stderr):  # its build messages would spoil --json on stdout
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **adamw),
                                              config={"train_micro_batch_size_per_gpu": args.batch_size,
                                                      "zero_allow_untested_optimizer": True,
                                                      # DeepSpeed clips the gradient norm to 1.0 unless told
                                                      # not to (GRADIENT_CLIPPING_DEFAULT); no other system clips
                                                      "gradient_clipping": 0.0,
                                                      "zero_optimization": {"stage": int(system[-1])}})
        return engine, engine.backward, engine.step, lambda: None  # engine.step also zeroes the gradients
    model, opt = zero.initialize(model, torch.optim.AdamW, stage=int(system[-1]), stage3_units=model.h, **adamw)
    return model, torch.Tensor.backward, lambda: (opt.step(), opt.zero_grad()), opt.wait_params


def get_batch(gen, args):
    tokens = torch.randint(PRESETS[args.model].vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # inputs, next tokens: (B, T) each


# ---------------------------------------------------------------------------
# Every system lives in its own process group, all started at once; its ranks then wait for
# orders. The systems take turns, round after round, each turn timed against a DDP clock run
# just before and after it, so that the machine's drift cancels (drive).
# ---------------------------------------------------------------------------
def serve_rank(system, args, inboxes, outbox):
    """On each rank of the system's process group: build, warm up, then run what the inbox says:
    "turn" (a lead-in step, --steps timed steps, report), or "probe" (one step, measured, return)."""
    # one torch thread a rank (ranks.init_ranks; 2 ranks x 2 threads on 2 cores ran 1.5-1.8x slower)
    rank = dist.get_rank()
    if hasattr(os, "sched_setaffinity"):  # rank r on core r (mod cores): steadier than letting ranks migrate
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    gen = torch.Generator().manual_seed(SEED * 1000 + rank)  # each rank its own batches, every system
    baseline = zero.live_tensor_bytes()  # before the model: what torch and the process group hold already
    model, backward, step, settle = build(system, args)

    def train_step():
        x, y = get_batch(gen, args)
        backward(model(x, y)[1])
        step()

    for _ in range(args.warmup):
        train_step()
    outbox.put((rank, "ready"))
    while inboxes[rank].get() == "turn":
        # the lead-in step, untimed: back the caches another system's turn took, and zero.py's
        # stage 1-2 parameter gather in flight, so every timed step is a step in steady state
        train_step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            train_step()
        ms = (time.perf_counter() - t0) * 1000 / args.steps
        settle()  # untimed: nothing of this turn overlaps another system's
        outbox.put((rank, ms))

    # One more step, untimed and probed: each sample is the live tensors less the baseline and
    # this step's batch. After backward that is the model states (parameters, gradients, AdamW's
    # exp_avg, exp_avg_sq and step; besides them only the scalar loss); after forward, plus activations.
    x, y = get_batch(gen, args)

    def live():
        dist.barrier()
        return ranks.settled(lambda: zero.live_tensor_bytes() - baseline - x.nbytes - y.nbytes)

    # Section 7: bytes handed to each torch.distributed collective (memory_table's ring convention)
    with memory_table.CommCounter() as counter:
        loss = model(x, y)[1]
        after_forward = live()
        backward(loss)
        after_backward = live()
        step()
        after_step = live()
    sent = Counter()
    for (phase, name), n in counter.bytes.items():
        sent[name] += float(n)
    return dict(loss=loss.item(), model_states=after_backward,
                peak=max(after_forward, after_backward, after_step), sent=dict(sent))


class Server:
    """One system's process group, run from a thread of this process; ask() sends an order to
    every rank and returns their replies in rank order. nodes: the emulated nodes (--nodes) the
    ranks run on, one each; None: plain processes on this machine's loopback."""

    def __init__(self, system, args, nodes=None):
        ctx = mp.get_context("spawn")
        self.system, self.nd = system, args.world
        self.inboxes, self.outbox, self.result, self.error = [ctx.Queue() for _ in range(self.nd)], ctx.Queue(), None, None
        where = dict(setups=[functools.partial(die_with, os.getpid())] * self.nd) if nodes is None else \
            nodes.placement()
        self.thread = threading.Thread(target=self._run, args=(args, where), daemon=True)
        self.thread.start()

    def _run(self, args, where):
        try:  # the ranks live as long as the benchmark
            self.result = ranks.run_on_ranks(self.nd, serve_rank, self.system, args, self.inboxes, self.outbox,
                                             timeout=None, **where)
        except Exception as e:  # a rank failed: ask() reports it
            self.error = e

    def replies(self):
        out = {}
        while len(out) < self.nd:
            try:
                rank, value = self.outbox.get(timeout=1)
                out[rank] = value
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError(f"{self.system} stopped: {self.error!r}")
        return [out[r] for r in range(self.nd)]

    def ask(self, order):
        for inbox in self.inboxes:
            inbox.put(order)
        return self.replies()


# ---------------------------------------------------------------------------
# Emulated nodes (--nodes N --link RATE): each rank in a network namespace of its own, node r
# holding veth<r> at SUBNET.<r+1>/24, whose peer port<r> sits on a bridge in one more namespace;
# both ends capped at RATE (tc tbf). Every name starts with zb<pid>-, and everything is made with
# `ip -n NS` inside the new namespaces: the root namespace gets no address, link or route.
# ---------------------------------------------------------------------------
SUBNET = "10.213.0"  # private, and only inside this run's namespaces
PREFIX = "zb"  # a run's namespaces are zb<its pid>-<name> (remove_stale reads the pid back)
NEEDS = "--nodes needs root and iproute2 (apt-get install iproute2) to create network namespaces"
CLONE_NEWNET = 0x40000000  # <sched.h>: setns into a network namespace


def nodes_problem():
    """Why emulated nodes cannot be made here, in a few words; None: a namespace was made and deleted."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    finally:  # (a Ctrl-C here would leave it)
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return f"ip netns add: {made.stderr.strip()}" if made.returncode else None


class Nodes:
    """with Nodes(n, rate) as nodes: n emulated nodes with links capped at rate, made on entering
    and deleted on leaving, whatever happens: an error, Ctrl-C, SIGTERM or SIGHUP (made to raise
    SystemExit meanwhile). One set serves every system and the clock; past the warm-up only one of
    them runs at a time (drive)."""

    def __init__(self, n, rate):
        prefix = f"{PREFIX}{os.getpid()}"
        self.names, self.bridge = [f"{prefix}-{r}" for r in range(n)], f"{prefix}-br"
        self.addrs = [f"{SUBNET}.{r + 1}" for r in range(n)]
        self.rate, self.handlers = rate, {}
        self.made = []  # namespaces to delete: each is listed before it is made
        # Store ports: only this run's ranks listen in these namespaces, so counting up gives a free
        # port each time (below the ephemeral range, where gloo's own sockets go)
        self.ports = itertools.count(29500)

    def __enter__(self):
        problem = nodes_problem()
        if problem:
            sys.exit(f"{NEEDS} ({problem})")
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self.handlers[sig] = signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
        atexit.register(self.remove)  # the last resort, should a second Ctrl-C cut a removal short
        remove_stale()
        try:
            for ns in [self.bridge] + self.names:
                self.made.append(ns)
                self._cmd("ip", "netns", "add", ns)
                self._cmd("ip", "-n", ns, "link", "set", "lo", "up")  # rank 0 reaches its own store by its address
            self._cmd("ip", "-n", self.bridge, "link", "add", "name", "br0", "type", "bridge")
            self._cmd("ip", "-n", self.bridge, "link", "set", "br0", "up")
            for r, (ns, addr) in enumerate(zip(self.names, self.addrs)):
                # the pair is made in the bridge's namespace with its peer straight in the node's
                self._cmd("ip", "-n", self.bridge, "link", "add", "name", f"port{r}", "type", "veth",
                          "peer", "name", f"veth{r}", "netns", ns)
                self._cmd("ip", "-n", self.bridge, "link", "set", f"port{r}", "master", "br0", "up")
                self._cmd("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", f"veth{r}")
                self._cmd("ip", "-n", ns, "link", "set", f"veth{r}", "up")
                for where, dev in ((ns, f"veth{r}"), (self.bridge, f"port{r}")):  # node's upload, its download
                    try:
                        self._cmd("tc", "-n", where, "qdisc", "add", "dev", dev, "root",
                                  "tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms")
                    except RuntimeError as e:  # tc names the value it refused, not the flag
                        raise RuntimeError(f"{e}\n--link {self.rate}: give a rate above 0 in tc's units (200mbit, "
                                           "1gbit); the kernel needs the tbf qdisc (modprobe sch_tbf)") from None
        except BaseException as e:
            self.__exit__()
            if isinstance(e, RuntimeError):  # an ip or tc command failed (_cmd)
                sys.exit(f"cannot make {len(self.names)} emulated nodes: {e}")
            raise
        return self

    def __exit__(self, *exc):
        self.remove()
        atexit.unregister(self.remove)
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)

    @staticmethod
    def _cmd(*cmd):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")

    def remove(self):
        while self.made:  # a namespace's veth ends go with it, and the bridge with its namespace
            subprocess.run(["ip", "netns", "del", self.made[-1]], capture_output=True)
            self.made.pop()  # (after: a second Ctrl-C that cuts the deletion short leaves it listed for atexit)

    def placement(self):
        """ranks.run_on_ranks's options: rank r in node r, talking over veth<r>, rank 0's store on a
        new port (queues are pipes: they work across namespaces)."""
        return dict(master=self.addrs[0], port=next(self.ports),
                    setups=[functools.partial(enter_namespace, name, os.getpid()) for name in self.names],
                    envs=[dict(GLOO_SOCKET_IFNAME=f"veth{r}") for r in range(len(self.names))])


def remove_stale():
    """Delete the namespaces a bench.py killed with SIGKILL left (zb<its pid>-..., no process of that
    pid now; or this process's pid, reused: it has made none yet), saying so on stderr."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in listed:
        pid = ns[len(PREFIX):].partition("-")[0]
        if not (ns.startswith(PREFIX) and "-" in ns and pid.isdigit()):
            continue  # not bench.py's
        if int(pid) != os.getpid() and os.path.exists(f"/proc/{pid}"):
            continue  # a run still going (or a process that reused the pid): left alone
        print(f"deleting namespace {ns}, left by a bench.py (pid {pid}) that was killed", file=sys.stderr)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def die_with(bench):
    """A rank's first step: die with bench.py (pid `bench`), even of SIGTERM or SIGKILL, which run no
    Python there: a rank waiting for orders would wait forever (its queue's pipe is its own too),
    holding its model and, under --nodes, its namespace's links. Linux only (prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "prctl"):
        return libc
    # PR_SET_PDEATHSIG: SIGKILL when the thread that started this process ends (Server's: it
    # outlives the ranks, waiting for them)
    libc.prctl(1, signal.SIGKILL)
    if os.getppid() != bench:  # bench.py died before prctl: no signal will come
        sys.exit(f"bench.py (pid {bench}) is gone")
    return libc


def enter_namespace(name, bench):
    """Move this process into the network namespace `name` before any socket opens; threads it
    starts from then on inherit it (after die_with: Nodes cannot remove the links of a rank that
    lives on)."""
    libc = die_with(bench)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:  # Python 3.11 has no os.setns
            raise OSError(ctypes.get_errno(), f"setns into {name}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# The table. Time: rank 0's ms per step in each round's turn, median and interquartile range. A
# ratio: one per round against the DDP clock, the same way; marked ≈ where its range holds 1.
# ---------------------------------------------------------------------------
def spread(values):
    """(median, lo, hi): the median and the interquartile range (one value: itself)."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return statistics.median(values), q[0], q[-1]


def ratio(rounds):
    """A ratio per round, as the median [interquartile range]; ≈ where that range holds 1."""
    r, lo, hi = spread(rounds)
    return f"{'≈ ' if lo <= 1 <= hi else ''}{r:.2f} [{lo:.2f}-{hi:.2f}]"


def summarize(system, launches, args, psi):
    """One system's row: its rounds pooled over the launches (each (times, vs_clock, results) from
    drive); bytes and loss from the first launch's probe (every launch ran the same steps on the
    same data)."""
    label, stage, volume = SYSTEMS[system]
    rounds = [ms for times, _, _ in launches for ms in times[system]]
    vs_clock = [v for _, ratios, _ in launches for v in ratios[system]]
    per_rank = launches[0][2][system]
    ms, ms_lo, ms_hi = spread(rounds)
    return dict(system=system, label=label, ms=ms, ms_lo=ms_lo, ms_hi=ms_hi, rounds=rounds, vs_clock=vs_clock,
                model_states=max(r["model_states"] for r in per_rank), formula_name=FORMULA[stage],
                formula=sum(memory_table.dtype_terms(psi, args.world, stage, "fp32")),
                peak=max(r["peak"] for r in per_rank),
                # DeepSpeed calls its collectives through deepspeed.comm: wrapping torch.distributed
                # sees only part of them (measured: ZeRO-1/2 the gradient all-reduce only, ZeRO-3 none)
                sent=None if system.startswith("deepspeed") else max(sum(r["sent"].values()) for r in per_rank),
                sent_by_collective=per_rank[0]["sent"], section7=volume * (args.world - 1) / args.world * 4 * psi,
                loss=sum(r["loss"] for r in per_rank) / len(per_rank),  # the ranks' mean
                vs_ddp=ratio(vs_clock),
                vs_ddp_per_launch=[statistics.median(ratios[system]) for _, ratios, _ in launches],
                loss_per_launch=[sum(r["loss"] for r in results[system]) / args.world for _, _, results in launches])


def table(rows, args, psi, notes):
    lines = [[r["label"], f"{r['ms']:.0f} [{r['ms_lo']:.0f}-{r['ms_hi']:.0f}]", r["vs_ddp"],
              f"{r['model_states'] / MB:.2f}", f"{r['formula'] / MB:.2f} = {r['formula_name']}",
              f"{r['model_states'] / r['formula']:.4f}", f"{r['peak'] / MB:.1f}",
              "n/a" if r["sent"] is None else f"{r['sent'] / MB:.2f}",
              f"{r['section7'] / MB:.2f}",
              "not seen (deepspeed.comm)" if r["sent"] is None else
              ", ".join(f"{k} {v / MB:.1f}" for k, v in r["sent_by_collective"].items() if v >= 0.05 * MB),
              f"{r['loss']:.6f}"] for r in rows]
    headers = ["system", "ms/step [spread]", "vs DDP", "states MB", "Section 5 MB", "ratio", "peak MB",
               "sent MB", "Section 7 MB", "sent by collective, MB", "final loss"]
    legend = [f"world {args.world} (gloo, CPU, 1 thread/rank, pinned) | {args.model}: Ψ = {psi / 1e6:.2f}M | "
              f"batch {args.batch_size} x {args.seq_len} per rank | {args.launches} launch(es), each {args.warmup} "
              f"warm-up steps, then {args.repeats} round(s) of one turn per system: a lead-in step, {args.steps} timed",
              "ms/step: median over the rounds [interquartile range]; vs DDP: per round, the system's time over the "
              "mean of the DDP clock's turns just before and after it: median [interquartile range]; "
              "≈: that range holds 1, a difference within the noise; the DDP row is DDP against the clock (A/A)",
              "states: live tensors after backward less a baseline taken before the model and less the batch; "
              "peak: the largest of 3 samples (after forward, backward, step)",
              "sent: bytes handed to torch.distributed per step (ring algorithms; a broadcast (Nd-1)/Nd of it per rank); Section 7: (Nd-1)/Nd x 2Ψ x 4 B, "
              "3Ψ for P_os+g+p, FSDP2 and ZeroRedundancyOptimizer (all-reduce + broadcast); all per rank, worst rank"]
    if args.nodes:
        legend.insert(1, f"network: {args.nodes} emulated nodes, each link capped at {args.link} each way (tc tbf), "
                         f"gloo over veth + bridge; the nodes share this machine's {os.cpu_count()} cores")
    return tabulate(lines, headers, disable_numparse=True) + "\n" + "\n".join(legend + notes)


def drive(args, launch, nodes):
    """Start every system and the clock (on the emulated nodes, if any), run the rounds and the
    probes: (times, vs_clock, results), each {system: ...}."""
    t0 = time.perf_counter()
    servers = {s: Server(s, args, nodes) for s in args.systems}  # all start (and warm up) at once
    for server in servers.values():
        server.replies()  # "ready"
    print(f"launch {launch + 1}/{args.launches}: {len(servers)} systems x {args.world} ranks started and warmed up "
          f"in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    # The clock: one more DDP process group, timed but not reported. A system's ratio in a round is
    # its time over the mean of the clock's turns just before and after it (seconds apart).
    times = {s: [] for s in args.systems}  # per round: rank 0's ms per step in its turn
    vs_clock = {s: [] for s in args.systems}
    clock = servers["clock"] = Server("ddp", args, nodes)
    clock.replies()
    for repeat in range(args.repeats):
        first = (launch * args.repeats + repeat) % len(args.systems)
        order = args.systems[first:] + args.systems[:first]  # rotated, round after round, launch after launch
        before = clock.ask("turn")[0]
        for s in order:
            times[s].append(servers[s].ask("turn")[0])
            after = clock.ask("turn")[0]
            vs_clock[s].append(times[s][-1] / ((before + after) / 2))
            before = after
        print(f"launch {launch + 1}, round {repeat + 1}/{args.repeats}: " + ", ".join(f"{s} {times[s][-1]:.0f}" for s in order)
              + " ms/step", file=sys.stderr)
    for server in servers.values():  # the probe step, one system at a time (the clock's is not used)
        for inbox in server.inboxes:
            inbox.put("probe")
        server.thread.join()
        if server.error:
            raise server.error
    return times, vs_clock, {s: server.result for s, server in servers.items()}


def main(argv=None):
    args = parse_args(argv)
    skipped = unavailable(args.systems)
    args.systems = [s for s in args.systems if s not in skipped]
    psi = num_params(PRESETS[args.model])
    # Every launch starts every system afresh: one process group can run a few percent faster or
    # slower than an identical one for as long as it lives, so the rounds of several launches are pooled.
    launches = []
    # --nodes: made here, deleted on the way out, whatever happens
    with Nodes(args.nodes, args.link) if args.nodes else contextlib.nullcontext() as nodes:
        for launch in range(args.launches):
            try:
                launches.append(drive(args, launch, nodes))
            except BaseException:
                for p in mp.active_children():  # ranks left waiting for orders would keep this process alive
                    p.kill()
                raise
    rows = {s: summarize(s, launches, args, psi) for s in args.systems}
    first = next(iter(rows.values()))["loss"]
    differ = [r["label"] for r in rows.values() if any(loss != first for loss in r["loss_per_launch"])]
    notes = [f"final loss: differs for {', '.join(differ)}" if differ else
             f"final loss: the same float for every system{' in every launch' if args.launches > 1 else ''}"]
    if "ddp" in rows and args.launches > 1:
        notes.append("DDP against the clock (A/A), median in each launch: "
                     + ", ".join(f"{x:.2f}" for x in rows["ddp"]["vs_ddp_per_launch"]))
    if "fsdp2" in rows and "zero3" in rows:
        notes.append("zero.py stage 3 / FSDP2 step time: "
                     + ratio([a / b for a, b in zip(rows["zero3"]["vs_clock"], rows["fsdp2"]["vs_clock"])]))
    if skipped:
        notes.append(f"skipped {', '.join(skipped)}: deepspeed is not installed (pip install deepspeed)")
    if args.json:
        print(json.dumps(dict(args=vars(args), psi=psi, rows=list(rows.values()), notes=notes), ensure_ascii=False))
    else:
        print(table(rows.values(), args, psi, notes))
    return rows


if __name__ == "__main__":
    main()
