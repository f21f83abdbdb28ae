"""bench.py end to end on the tiny GPT: two systems in their own process groups, one turn each;
then the same on two emulated nodes (bench.py --nodes, as root with iproute2).

    python -m pytest test_bench.py
"""
import os
import subprocess
import sys
import time

import pytest

import bench
from gpt import PRESETS, num_params


@pytest.mark.slow  # two launches of three spawned process groups (ddp, zero3, the clock)
def test_bench_ddp_and_zero3_share_the_loss_and_meet_sections_5_and_7_at_world_2():
    rows = bench.main(["--model", "tiny", "--batch_size", "2", "--seq_len", "32", "--steps", "1",
                       "--warmup", "0", "--repeats", "1", "--launches", "2", "--systems", "ddp", "zero3", "--json"])
    psi, nd = num_params(PRESETS["tiny"]), 2
    ddp, zero3 = rows["ddp"], rows["zero3"]
    assert len(ddp["vs_clock"]) == 2 and len(zero3["vs_ddp_per_launch"]) == 2  # a round from each launch
    # at world 2 every sum order gives the same bits; each launch trains afresh on the same data
    assert ddp["loss_per_launch"] == zero3["loss_per_launch"] == [ddp["loss"]] * 2
    # Section 5, fp32 AdamW (K = 8): 16Ψ replicated, 16Ψ/Nd at P_os+g+p. Beyond the formula: AdamW's
    # 4-byte step counters and stage 3's padding of Ψ to a multiple of Nd, a few hundred bytes.
    assert ddp["model_states"] == pytest.approx(16 * psi, rel=1e-4)
    assert zero3["model_states"] == pytest.approx(16 * psi / nd, rel=1e-4)
    # Section 7, per rank per step in fp32: an all-reduce sends 2 x (Nd-1)/Nd x 4Ψ bytes; stage 3
    # sends 3 x (Nd-1)/Nd x 4Ψ (two gathers and a reduce-scatter), less the units the forward keeps
    # for backward, which backward does not gather again (the tied embedding, the output layer
    # being the last module; then, within the prefetch budget of one block, ln_f and the last
    # block), plus a flag all-reduce of a few bytes
    config = PRESETS["tiny"]
    block = 12 * config.n_embd ** 2 + 13 * config.n_embd  # attention and MLP weights, biases, 2 LayerNorms
    kept = config.vocab_size * config.n_embd + 2 * config.n_embd + block
    assert ddp["sent"] == pytest.approx(2 * (nd - 1) / nd * 4 * psi, rel=1e-9)
    assert zero3["sent"] == pytest.approx((nd - 1) / nd * 4 * (3 * psi - kept), rel=1e-3)


@pytest.mark.slow  # three spawned process groups (ddp, zero3, the clock) on two emulated nodes
def test_bench_on_two_emulated_nodes_gives_one_loss_and_leaves_no_namespace_behind():
    problem = bench.nodes_problem()  # not root, no iproute2, or namespaces not permitted here
    if problem:
        pytest.skip(f"{bench.NEEDS} ({problem})")
    rows = bench.main(["--nodes", "2", "--link", "1gbit", "--model", "tiny", "--batch_size", "2", "--seq_len", "32",
                       "--steps", "1", "--warmup", "0", "--repeats", "1", "--launches", "1",
                       "--systems", "ddp", "zero3", "--json"])
    ddp, zero3 = rows["ddp"], rows["zero3"]
    assert ddp["loss_per_launch"] == zero3["loss_per_launch"] == [ddp["loss"]]  # world 2: the same bits
    # every namespace bench.main made (named zb<its pid>-...) is gone, and with them their links
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"zb{os.getpid()}-" not in left


@pytest.mark.parametrize("flags, message", [
    # every system chosen is skipped: drive() divided by the number left, 0 (ZeroDivisionError)
    (["--systems", "deepspeed1", "deepspeed3"], "deepspeed is not installed (pip install deepspeed): "
                                                "add a system that does not need it to --systems"),
    # a system named twice took two turns a round: twice the rounds the legend says
    (["--systems", "ddp", "zero3", "ddp"], "--systems names ddp more than once: name each system once"),
    # --nodes sets --world: its check named --world, a flag not given
    (["--nodes", "0", "--link", "1gbit"], "--nodes must be at least 1 (got 0)"),
    # node r is 10.213.0.<r+1>/24: node 255 got the broadcast address, node 256 an invalid one
    (["--nodes", "255", "--link", "1gbit"], "--nodes must be at most 254 (got 255)"),
])
def test_bench_bad_flags_say_what_to_change(monkeypatch, capsys, flags, message):
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name, package=None: None)  # no deepspeed
    with pytest.raises(SystemExit):
        bench.parse_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.slow  # bench.py --nodes run to its ranks' warm-up, then killed
def test_bench_nodes_killed_with_sigkill_leaves_no_rank_and_the_next_run_deletes_its_namespaces():
    problem = bench.nodes_problem()
    if problem:
        pytest.skip(f"{bench.NEEDS} ({problem})")
    run = subprocess.Popen([sys.executable, "bench.py", "--nodes", "2", "--link", "1gbit", "--model", "tiny",
                            "--batch_size", "2", "--seq_len", "32", "--steps", "1", "--warmup", "0", "--repeats", "1",
                            "--launches", "1", "--systems", "zero1"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    try:
        for line in run.stderr:  # the ranks are up once warmed up
            if "started and warmed up" in line:
                break
        ranks = subprocess.run(["pgrep", "-P", str(run.pid)], capture_output=True, text=True).stdout.split()
        run.kill()  # SIGKILL: no Python runs in bench.py any more
        run.wait()
        # the ranks waited for orders forever: a rank would have held its namespace's links. The
        # clock's ranks start just after that line: one still importing torch when bench.py died
        # exits when it reaches its setup (enter_namespace), seconds later on a busy machine (CI
        # measured more than 10 s); the resource tracker goes with the last of them
        deadline = time.monotonic() + 120
        while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ranks and not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
        bench.remove_stale()  # what the next run does first
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert f"zb{run.pid}-" not in left
    finally:
        run.kill()
        for ns in ("br", "0", "1"):
            subprocess.run(["ip", "netns", "del", f"zb{run.pid}-{ns}"], capture_output=True)


@pytest.mark.slow  # bench.py on loopback run to its ranks' warm-up, then sent SIGTERM
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks die with bench.py through prctl (Linux)")
def test_bench_terminated_leaves_no_rank_running():
    """SIGTERM (an orchestrator's, `kill PID`) runs no Python in bench.py's ranks: without --nodes they waited for
    orders forever, each holding its model (five processes left running, their parent init)."""
    import signal
    run = subprocess.Popen([sys.executable, "bench.py", "--model", "tiny", "--batch_size", "2", "--seq_len", "32",
                            "--steps", "1", "--warmup", "0", "--repeats", "1", "--launches", "1", "--systems", "zero1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
    children = []
    try:
        for line in run.stderr:  # the ranks are up once warmed up
            if "started and warmed up" in line:
                break
        children = subprocess.run(["pgrep", "-P", str(run.pid)], capture_output=True, text=True).stdout.split()
        run.terminate()
        run.wait()
        deadline = time.monotonic() + 120  # (the clock's ranks may still be importing torch: see the test above)
        while any(os.path.exists(f"/proc/{pid}") for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children and not [pid for pid in children if os.path.exists(f"/proc/{pid}")], children
    finally:
        run.kill()
        for pid in children:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_nodes_whose_removal_a_second_ctrl_c_cut_short_are_still_listed_for_atexit(monkeypatch):
    """A namespace leaves Nodes' list once deleted, not before: a Ctrl-C that cuts `ip netns del` short leaves
    it listed, so the atexit removal deletes it (iproute2 stood in for)."""
    nodes = bench.Nodes(2, "1gbit")
    nodes.made = ["zb1-br", "zb1-0"]
    deleted = []

    def run(cmd, **kwargs):
        deleted.append(cmd[-1])
        if len(deleted) == 1:
            raise KeyboardInterrupt
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", run)
    with pytest.raises(KeyboardInterrupt):
        nodes.remove()
    assert nodes.made == ["zb1-br", "zb1-0"], nodes.made
    nodes.remove()  # atexit's
    assert nodes.made == [] and deleted == ["zb1-0", "zb1-0", "zb1-br"], (nodes.made, deleted)


@pytest.mark.parametrize("rate", ["fast", "0mbit"])
def test_bench_nodes_bad_link_names_the_flag_and_leaves_no_namespace(rate):
    problem = bench.nodes_problem()
    if problem:
        pytest.skip(f"{bench.NEEDS} ({problem})")
    with pytest.raises(SystemExit) as exit:  # tc said only `illegal value for "rate"` or `"rate" is mandatory`
        with bench.Nodes(2, rate):
            pass
    assert f"--link {rate}: give a rate above 0 in tc's units (200mbit, 1gbit)" in str(exit.value.code)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"zb{os.getpid()}-" not in left
