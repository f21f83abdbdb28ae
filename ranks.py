"""
ranks.py -- ranks on this machine (gloo; NCCL, one GPU each, where asked), for the tools that measure zero.py: conftest.py keeps a
pool of them for the tests, memory_table.py runs its measured sections on them, bench.py runs
each system in a process group of its own (on emulated nodes: bench.Nodes.placement).

    run_on_ranks(2, fn, *args)   # fn(*args) on 2 spawned gloo ranks: [rank 0's result, rank 1's]
    settled(lambda: zero.live_tensor_bytes())   # live bytes once finished collectives let go

fn must be a module-level function (spawn pickles it by name). Each rank sees the environment
torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""
import os
import queue
import signal
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOOPBACK = "127.0.0.1"


def free_port():
    """A TCP port no one listens on now, for rank 0's store."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def init_ranks(rank, nd, port, master=LOOPBACK, timeout=None, env=None, backend="gloo"):
    """Join a process group of nd ranks as `rank`, through torchrun's variables (env://), so
    that code reading them (DeepSpeed, train.py) sees what torchrun would have set.
    timeout: a datetime.timedelta after which a collective that not every rank joined raises
    (None: torch's default); env: more variables for this rank (GLOO_SOCKET_IFNAME);
    backend "nccl": rank r on GPU r."""
    torch.set_num_threads(1)  # nd ranks share the cores; also avoids OpenMP hangs in spawned children
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(nd), **(env or {}))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", timeout=timeout)


def rank_main(rank, nd, port, fn, args, results, master=LOOPBACK, setup=None, env=None, backend="gloo"):
    """The body of one rank: setup() if given (bench.py moves into a network namespace before
    any socket opens), init_ranks, then fn(*args). Puts (rank, True, its result) on `results`,
    or (rank, False, the traceback) if any of it raised, and sees it written before going on:
    destroying the process group can wait on a collective a failed peer never joins, and the
    thread that writes the queue needs the interpreter lock that wait may hold."""
    try:
        if setup is not None:
            setup()
        init_ranks(rank, nd, port, master, env=env, backend=backend)
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()   # the report is in the pipe
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(nd, fn, *args, timeout=600, backend="gloo", master=LOOPBACK, port=None, setups=None, envs=None):
    """fn(*args) on nd new ranks; their results in rank order. A rank's failure kills them all and
    is raised; a rank that ends without a result (a signal, a crash) kills them all and raises
    RankEnded within a second. timeout: seconds to wait for each result (None: no limit, for bench.py's long-lived
    ranks). bench.py's emulated nodes (bench.Nodes.placement) give rank 0's address and store port,
    and per rank a setup to run first and more environment variables."""
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), port or free_port()
    procs = [ctx.Process(target=rank_main, args=(r, nd, port, fn, args, results, master,
                                                 None if setups is None else setups[r],
                                                 None if envs is None else envs[r], backend))
             for r in range(nd)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, ok, value = _next_result(results, procs, out, timeout)
        if not ok:  # the other ranks may wait forever in a collective this one left
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} of {nd} failed:\n{value}")
        out[rank] = value
    for p in procs:
        p.join()
    return [out[r] for r in range(nd)]


class RankEnded(RuntimeError):
    """A rank ended without putting a result: killed by a signal, or exited from under fn."""


def _next_result(results, procs, out, timeout):
    """The next (rank, ok, value) on results. Raises RankEnded, after killing the others, if a
    rank not in `out` ended without one, and queue.Empty, after killing them all, after `timeout` seconds (None:
    never) without one."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        # read before the get: a rank writes its report to the pipe before it ends
        gone = {r: p.exitcode for r, p in enumerate(procs) if r not in out and p.exitcode is not None}
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if gone:
                for p in procs:
                    p.kill()
                raise RankEnded(f"{len(procs)} ranks: " + ", ".join(
                    f"rank {r} ended without a result ({_exit_name(code)})" for r, code in gone.items())) from None
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:  # (left waiting, they would also keep this process from exiting)
                    p.kill()
                raise


def _exit_name(code):
    """A process's exit code in words: "exit code 1", "killed by SIGSEGV"."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def settled(measure, readings=3, interval=0.05, timeout=5.0):
    """measure() once it reads the same `readings` times in a row, `interval` s apart (at most
    `timeout` s): for live bytes read right after collectives. gloo marks a collective complete
    before its worker thread lets go of the collective's tensors, which needs the GIL, and each
    process group has worker threads of its own, so a barrier does not wait for them either
    (5,000 all-reduces a rank at world 2: about 1 in 4 outputs still held right after, 1 in 5
    after a barrier, none after a 1 ms sleep). A buffer that stays is counted: only ones on
    their way out are waited for."""
    deadline, last, same = time.monotonic() + timeout, None, 0
    while True:
        now = measure()
        same = same + 1 if now == last else 1
        if same == readings or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(interval)
