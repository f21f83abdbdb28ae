"""Test harness: one pool of gloo ranks per world size, kept alive across many tests.

Spawning ranks costs about 2.4 s at 2 ranks and 12.5 s at 8 here, so every test that needs
Nd ranks borrows the same pool: `world(nd).run(fn, *args)` runs the module-level function
`fn(*args)` on every rank of an initialised gloo process group and returns the Nd results in
rank order. An exception on any rank fails the test with that rank's traceback; a rank that
dies fails it at once, and one that hangs (a collective some ranks never joined) after
`timeout` seconds; then the pool is replaced.
"""
import datetime
import os
import queue
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

from ranks import free_port, init_ranks


def _rank_main(rank, nd, port, inbox, outbox):
    """A rank of the pool: run each (fn, args) from the inbox, until None, reporting on outbox."""
    init_ranks(rank, nd, port, timeout=datetime.timedelta(seconds=300))
    while (job := inbox.get()) is not None:
        fn, args = job
        try:
            result = fn(*args)
            if torch._C._len_torch_function_stack():  # it would slow down, or fail, every later test here
                raise RuntimeError(f"{fn.__name__} left a TorchFunctionMode active")
            try:  # a result that cannot be pickled would be lost in the queue's thread, and the test wait
                ForkingPickler.dumps(result)
            except Exception as e:
                raise TypeError(f"{fn.__name__} returned {result!r}, which cannot be sent back: {e}") from e
            outbox.put((rank, True, result))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class World:
    """Nd live gloo ranks that run module-level functions on request."""

    def __init__(self, nd):
        ctx = mp.get_context("spawn")
        self.nd, port = nd, free_port()
        self.inboxes = [ctx.Queue() for _ in range(nd)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, args=(r, nd, port, self.inboxes[r], self.outbox),
                                  daemon=True) for r in range(nd)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout=600):
        for q in self.inboxes:
            q.put((fn, args))
        results, errors, done = [None] * self.nd, [], 0
        deadline = time.monotonic() + timeout
        while done < self.nd:
            try:
                rank, ok, value = self.outbox.get(timeout=1)
            except queue.Empty:
                dead = [f"rank {r} died (exit code {p.exitcode})" for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:  # a crashed rank, or one stuck in a collective
                    self.broken = True
                    raise AssertionError("\n".join(errors + dead + [
                        f"{fn.__name__}: {self.nd - done} of {self.nd} ranks did not finish"]))
                continue
            results[rank], done = value, done + 1
            if not ok:
                errors.append(f"rank {rank}:\n{value}")
                # the others may wait in a collective the failed rank never joined
                deadline = min(deadline, time.monotonic() + 20)
        if errors:
            # the ranks that did not fail may be out of step with the failed one: start afresh
            self.broken = True
            raise AssertionError("\n".join(errors))
        return results

    def close(self):
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="session")
def world():
    pools = {}

    def get(nd):
        if nd in pools and pools[nd].broken:
            pools.pop(nd).close()
        if nd not in pools:
            pools[nd] = World(nd)
        return pools[nd]

    yield get
    for pool in pools.values():
        pool.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: world-size-8 and other long cases, run as CI's second step")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
