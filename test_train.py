"""ZeRO x Megatron on a 2D mesh, and train.py end to end.

    python -m pytest -n 2 test_train.py
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import train
import zero
from gpt import GPT, GPTConfig, make_mesh

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
FAST = ["--steps", "1", "--batch_size", "2", "--seq_len", "16", "--data", os.path.join(HERE, "zero.py")]


def on_rank_2d_zero_matches_ddp(stage, units=False):
    """tp 2 x dp 2: each tp rank's slice sharded by ZeRO over its dp group, against the same
    tp 2 model under DDP over the same dp group (2 ranks: DDP's own sum is exact there)."""
    dp_group, tp_group = make_mesh(dp=2, tp=2)
    reference = GPT(CONFIG, tp_group, seed=0)
    ddp = DDP(reference, process_group=dp_group)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    module = GPT(CONFIG, tp_group, seed=0)
    model, opt = zero.initialize(module, torch.optim.AdamW, stage=stage, group=dp_group, lr=1e-2,
                                 weight_decay=0.1, stage3_units=module.h if units else None)
    mismatches = []
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank(dp_group))  # per dp rank; tp ranks share
        x, y = torch.randint(0, 64, (3, 16), generator=g), torch.randint(0, 64, (3, 16), generator=g)
        losses = []
        for m, o in ((ddp, ref_opt), (model, opt)):
            loss = m(x, y)[1]
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.detach())
        if not torch.equal(*losses):
            mismatches.append(f"step {step} loss {losses[0].item()} != {losses[1].item()}")
        state, ref_state = zero.full_state_dict(model), reference.state_dict()
        mismatches += [f"step {step} {k}" for k in ref_state if not torch.equal(state[k], ref_state[k])]
    return mismatches


@pytest.mark.xdist_group("world4")
@pytest.mark.parametrize("stage, units", [(0, False), (1, False), (2, False), (3, False), (3, True)],
                         ids=["0", "1", "2", "3", "3-blocks-as-units"])
def test_zero_on_tp2_x_dp2_matches_ddp_bitwise(world, stage, units):
    assert world(4).run(on_rank_2d_zero_matches_ddp, stage, units) == [[]] * 4


def on_rank_save_into_a_taken_slice(path):
    """dp 1 x tp 2: train.save with tp rank 1's slice directory already there (a second run
    sharing the save directory), which zero.save_checkpoint refuses before any collective."""
    dp_group, tp_group = make_mesh(dp=1, tp=2)
    model, opt = zero.initialize(GPT(CONFIG, tp_group, seed=0), torch.optim.AdamW, stage=1, group=dp_group,
                                 tp_group=tp_group, lr=1e-2)
    if dist.get_rank(tp_group) == 1:
        os.makedirs(f"{path}/tp1")
    dist.barrier()
    try:
        train.save(path, argparse.Namespace(tp=2), tp_group, model, opt, step=1)
    except RuntimeError as e:
        return str(e)


@pytest.mark.xdist_group("world2")
def test_a_slice_that_cannot_save_stops_every_tp_rank_with_its_error(world, tmp_path):
    """One tp slice's save failing before its collectives (its directory exists) is compared
    across the tp ranks like any other failure: both raise it, rather than the other rank
    waiting in the comparison for a rank that left."""
    path = tmp_path / "step_000001"
    for message in world(2).run(on_rank_save_into_a_taken_slice, str(path)):
        print(message)
        assert message == f"saving {path} failed: rank 0 calls zero.save_checkpoint, which another rank refused (its " \
                          f"own error says why), so no rank went on; {path}/tp1 exists: save each checkpoint into a " \
                          f"new directory (e.g. step_000100)", message


def run_train(tmp_path, nproc, *flags):
    out = tmp_path / "out" / f"log{nproc}{'_'.join(flags).replace('-', '')}.json"  # train.py makes out/
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, "train.py"), "--steps", "6", "--eval_every", "3", "--batch_size", "4",
           "--seq_len", "64", "--out", str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.xdist_group("train")
def test_train_stage3_on_2_ranks_runs_and_loss_falls(tmp_path):
    log, stdout = run_train(tmp_path, 2, "--stage", "3")
    losses = [row["loss"] for row in log["log"]]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.5, losses
    assert "validation loss" in stdout and "sample" in stdout and log["sample"].startswith("def ")


@pytest.mark.slow  # two torchrun launches: over a minute on 2 cores
@pytest.mark.xdist_group("train")
def test_train_loss_curves_are_identical_for_stages_0_and_3(tmp_path):
    small = ["--data", os.path.join(HERE, "zero.py")]  # a small corpus: the default takes seconds to prepare
    runs = [run_train(tmp_path, 2, "--stage", s, *small) for s in ("0", "3")]
    curves = [[row["loss"] for row in log["log"]] for log, _ in runs]
    assert curves[0] == curves[1], curves
    # the activations forward keeps are the same at both stages (stage 3's gathered weights are freed by then)
    kept = [re.search(r"activations kept at the end of forward ([\d.]+) MB", stdout).group(1) for _, stdout in runs]
    assert kept[0] == kept[1], kept
    for log, _ in runs:  # model states include AdamW's from step 0; peaks are measured on steps 0, 2 and 5 only
        assert len({row["model_state_mb"] for row in log["log"]}) == 1, log["log"]
        assert [row["peak_mb"] is None for row in log["log"]] == [False, True, False, True, True, False], log["log"]


@pytest.mark.parametrize("flags, message", [
    (["--stage", "4"], "invalid choice: 4"),
    (["--tp", "2"], "--tp 2 does not divide the world size 1"),
    (["--seq_len", "4096"], "exceeds the nano model's block_size 128"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--tp", "3"], "--tp 3 does not divide the nano model's 4 attention heads: choose --tp in {1, 2, 4}"),
    # small: 6 heads, but a vocabulary of 256 bytes splits over tp 1 and 2 only
    (["--model", "small", "--tp", "4"], "--tp 4 does not divide the small model's 6 attention heads: choose --tp in {1, 2}"),
    (["--model", "small", "--tp", "3"], "--tp 3 does not divide the small model's vocabulary of 256 tokens: choose --tp in {1, 2}"),
    (["--lr", "0"], "--lr must be above 0"),
    (["--weight_decay", "-1"], "--weight_decay must be 0 or more"),
    (["--contiguous"], "add --checkpoint full, P_a or P_a+cpu"),
    (["--save_dir", os.path.join(HERE, "README.md")], "README.md is a file: give a directory"),
    (["--data", os.path.join(HERE, ".gitignore"), "--seq_len", "100"], "use a corpus of 1020 bytes or more"),
    (["--data", os.path.join(HERE, "no_such_file.txt")], "no_such_file.txt is not a file: give a text file"),
    # (FAST: were a flag let through, the run would end in seconds, not after 1000 steps)
    (["--lr", "nan"], "--lr must be above 0, a finite number (got nan)"),
    (["--seed", str(2**64 // 1000 + 1)], "--seed must be in [0, 2**64 // 1000) (got 18446744073709552)"),
    (["--grad_clip", "nan", *FAST], "--grad_clip must be 0 (off) or more, a finite number (got nan)"),
    (["--save_every", "-1"], "--save_every must be 0 (a checkpoint at the end only) or more (got -1)"),
    (["--out", os.path.join(HERE, "README.md", "run.json"), *FAST], "README.md, a file: give a path in a directory"),
    (["--save_dir", os.path.join(HERE, "README.md", "ckpt"), *FAST], "README.md, a file: give a path in a directory"),
    (["--resume", os.path.join(HERE, "no_such_checkpoint"), *FAST], "no_such_checkpoint is not a checkpoint (it does not exist)"),
    (["--resume", HERE, *FAST], "is not a checkpoint (no manifest.json): give a step directory a run saved"),
])
def test_train_bad_flags_say_what_to_change(flags, message):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *flags], capture_output=True,
                          text=True, timeout=120, cwd=HERE)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_train_stops_where_the_loss_diverges_and_keeps_its_log(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--lr", "1000", "--steps", "6",
                           "--batch_size", "2", "--seq_len", "32", "--data", os.path.join(HERE, "zero.py"),
                           "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=HERE)
    log = json.loads(out.read_text())
    print(log["stopped"], [row["loss"] for row in log["log"]])
    assert proc.returncode != 0 and "training diverged; lower --lr (now 1000)" in proc.stderr, proc.stderr[-2000:]
    assert not math.isfinite(log["log"][-1]["loss"]) and len(log["log"]) < 6 and log["sample"] is None


def test_a_save_that_fails_stops_the_run_and_keeps_its_log(tmp_path):
    """A save that fails mid-run (here: the disk full at step 4's) ended the run with zero's traceback and no
    --out log; it stops like a diverged run now: the log so far written, the error and the fix said."""
    out, ckpt = tmp_path / "run.json", tmp_path / "ckpt"
    flags = ["--steps", "6", "--eval_every", "6", "--batch_size", "2", "--seq_len", "32", "--data",
             os.path.join(HERE, "zero.py"), "--save_dir", str(ckpt), "--save_every", "2", "--out", str(out)]
    script = ("import runpy, sys, zero\n"
              "real = zero.save_checkpoint\n"
              "def full(path, *args, **kwargs):\n"
              "    if str(path).endswith('step_000004'):\n"
              "        raise OSError(28, 'No space left on device')\n"
              "    return real(path, *args, **kwargs)\n"
              "zero.save_checkpoint = full\n"
              f"sys.argv = ['train.py', *{flags!r}]\n"
              "runpy.run_path('train.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=HERE)
    log = json.loads(out.read_text())
    print(log["stopped"])
    assert proc.returncode != 0 and "No space left on device" in proc.stderr and "Make room or pass another " \
        "--save_dir, and continue from the latest complete checkpoint with --resume" in proc.stderr, proc.stderr[-2000:]
    assert [row["step"] for row in log["log"]] == [0, 1, 2, 3] and log["sample"] is None
    assert (ckpt / "step_000002" / "manifest.json").is_file()


@pytest.mark.slow  # two torchrun launches and five refused resumes: about 2 minutes on 2 cores
@pytest.mark.xdist_group("train")
def test_train_resumed_from_a_checkpoint_gives_the_uninterrupted_losses(tmp_path):
    """40 steps saving at 20, and a run resumed from step 20: the same losses (the model,
    optimizer, learning-rate schedule and data position all carry over)."""
    flags = ["--stage", "3", "--steps", "40", "--eval_every", "40", "--batch_size", "2", "--seq_len", "32",
             "--data", os.path.join(HERE, "zero.py")]  # a small corpus: the default takes seconds to prepare
    whole, _ = run_train(tmp_path, 2, *flags, "--save_dir", str(tmp_path / "a"), "--save_every", "20")
    resumed, stdout = run_train(tmp_path, 2, *flags, "--save_dir", str(tmp_path / "b"),
                                "--resume", str(tmp_path / "a" / "step_000020"))
    assert "resumed from" in stdout and "saved" in stdout
    assert [row["loss"] for row in resumed["log"]] == [row["loss"] for row in whole["log"]][20:]
    # a resume that would silently change the run, or has nothing left to train, stops first (run as one
    # process: dp 1 keeps the run's 4 sequences a step with --batch_size 4)
    one_process = ["--batch_size", "4"]
    for more, message in ((["--weight_decay", "5.0"], "belongs to a run with --weight_decay 0.1 (now 5.0)"),
                          (["--steps", "60"], "--steps 40 (now 60)"),
                          (["--seed", "1"], "--seed 1337 (now 1)"),
                          (["--grad_clip", "0.5"], "--grad_clip 1.0 (now 0.5)"),
                          # another model or dtype cannot load: named as the flag, not as shapes and dtypes
                          (["--model", "tiny"], "belongs to a run with --model nano (now tiny)"),
                          (["--dtype", "bfloat16"], "belongs to a run with --dtype float32 (now bfloat16)")):
        proc = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *flags, *one_process, *more,
                               "--resume", str(tmp_path / "a" / "step_000020")], capture_output=True, text=True,
                              timeout=120, cwd=HERE)
        assert proc.returncode != 0 and message in proc.stderr and "step   20" not in proc.stdout, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *flags, *one_process, "--resume",
                           str(tmp_path / "a" / "step_000040")], capture_output=True, text=True, timeout=120, cwd=HERE)
    assert proc.returncode != 0 and "is the end of its run (step 40 of --steps 40)" in proc.stderr, proc.stderr[-2000:]


def test_a_resume_takes_the_same_data_file_under_another_spelling(monkeypatch):
    """--data is compared as the file it names: ./zero.py and its absolute path are one run's,
    another file is another run's."""
    monkeypatch.chdir(HERE)
    saved = dict(run=train.run_flags(train.parse_args(["--data", "zero.py"])))
    for same in ("./zero.py", os.path.join(HERE, "zero.py")):
        train.refuse_another_run("step_000020", saved, train.parse_args(["--data", same]), 1)
    with pytest.raises(SystemExit, match=r"belongs to a run with --data .*zero.py \(now .*gpt.py\)"):
        train.refuse_another_run("step_000020", saved, train.parse_args(["--data", "gpt.py"]), 1)
    train.refuse_another_run("step_000020", dict(run=dict(data="zero.py")), train.parse_args(["--data", "./zero.py"]),
                             1)


def test_a_resume_at_another_dp_keeps_the_sequences_a_step():
    """--batch_size is per dp rank, so a resume at another dp with the same flags changed the batch under the
    learning-rate schedule, silently, and the flags that would keep it were refused as another run's. Now they
    may change where the product with dp stays; a resume that changes it is refused, naming what keeps it."""
    saved = dict(dp=2, run=train.run_flags(train.parse_args(["--batch_size", "2"])))  # 4 sequences a step
    for flags in (["--batch_size", "4"], ["--batch_size", "2", "--grad_accum", "2"], ["--batch_size", "1",
                                                                                         "--grad_accum", "4"]):
        train.refuse_another_run("step_000020", saved, train.parse_args(flags), 1)
    with pytest.raises(SystemExit, match=r"4 sequences a step at dp 2 \(now 2 at dp 1: keep them with --batch_size "
                                         r"x --grad_accum = 4\)"):
        train.refuse_another_run("step_000020", saved, train.parse_args(["--batch_size", "2"]), 1)
    with pytest.raises(SystemExit, match="now 12 at dp 3: keep them with a dp that divides 4"):
        train.refuse_another_run("step_000020", saved, train.parse_args(["--batch_size", "4"]), 3)
    train.refuse_another_run("step_000020", saved, train.parse_args(["--batch_size", "2"]), 2)  # the same run


def test_resumed_data_streams_are_each_ranks_own_at_any_dp():
    """A checkpoint holds the data position of each dp rank that saved it. At the same dp each
    rank continues its own stream; at another dp each rank draws a fresh stream of its own (else,
    saved at dp 1 and resumed at dp 2, rank 1 would get saved rank 0's position and both ranks
    would train on the same batches)."""
    draw = lambda gen: torch.randint(10**6, (16,), generator=gen)
    running = [train.data_stream(0, r, 2) for r in range(2)]
    saved = [dict(step=5, dp=2, data=gen.get_state()) for gen in running]
    resumed = [train.data_stream(0, r, 2, 5, saved[r]) for r in range(2)]
    assert all(torch.equal(draw(a), draw(b)) for a, b in zip(resumed, running, strict=True))
    at_dp1 = dict(step=5, dp=1, data=train.data_stream(0, 0, 1).get_state())
    first = [draw(train.data_stream(0, r, 2, 5, at_dp1)) for r in range(2)]  # load_checkpoint: rank r gets r % 1
    assert not torch.equal(first[0], first[1]), first
    assert not any(torch.equal(batch, draw(train.data_stream(0, 0, 1))) for batch in first)


@pytest.mark.slow  # five torchrun launches: about 3 minutes on 2 cores
@pytest.mark.xdist_group("train")
def test_train_with_tp_saves_each_slice_and_resumes(tmp_path):
    """At --tp 2 each tp rank's slice of the model is a checkpoint of its own (step_N/tp0, tp1),
    saved over its dp group; resumed, the losses are the uninterrupted run's."""
    flags = ["--stage", "2", "--tp", "2", "--steps", "4", "--eval_every", "4", "--batch_size", "2",
             "--seq_len", "32", "--data", os.path.join(HERE, "zero.py")]
    whole, _ = run_train(tmp_path, 2, *flags, "--save_dir", str(tmp_path / "a"), "--save_every", "2")
    assert all((tmp_path / "a" / "step_000002" / f"tp{t}" / "manifest.json").is_file() for t in range(2))
    resumed, stdout = run_train(tmp_path, 2, *flags, "--save_dir", str(tmp_path / "b"),
                                "--resume", str(tmp_path / "a" / "step_000002"))
    assert "resumed from" in stdout
    assert [row["loss"] for row in resumed["log"]] == [row["loss"] for row in whole["log"]][2:]
    (tmp_path / "a" / "step_000004" / "tp1").rename(tmp_path / "a" / "step_000004" / "tp1.partial")  # a failed save
    for more, message in ((["--save_dir", str(tmp_path / "a")], "this run would save"),  # before training, not after
                          (["--save_dir", str(tmp_path / "a"), "--resume", "--tp", "1"], "saved with --tp 2"),
                          (["--save_dir", str(tmp_path / "a"), "--resume"], "holds a save that did not finish: delete")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(HERE, "train.py"), *flags, *more]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE)
        assert proc.returncode != 0 and message in proc.stderr and "step    0" not in proc.stdout, proc.stderr[-2000:]


def test_resume_from_one_tp_slice_names_its_step_directory(tmp_path, capsys):
    """--resume step_N/tp0 (a slice of a --tp 2 checkpoint, which has a manifest of its own) said
    "saved with --tp 1: resume with --tp 1", and at --tp 1 the load then refused every split shape."""
    part = tmp_path / "step_000002" / "tp0"
    part.mkdir(parents=True)
    (part / "manifest.json").write_text(json.dumps({"tp": [0, 2]}))
    for tp in ("1", "2"):
        with pytest.raises(SystemExit):
            train.parse_args(["--tp", tp, "--resume", str(part)])
        err = capsys.readouterr().err
        assert f"is tp slice 0 of a checkpoint saved with --tp 2: resume from its step directory, --resume " \
               f"{part.parent} --tp 2" in err, err


def test_a_tp_checkpoint_missing_a_slice_is_named_unfinished_not_another_tp(tmp_path):
    """A --tp 2 step directory holding only tp0 (tp1 lost, or its failed save removed) was counted as
    --tp 1, so --resume at --tp 2 said "resume with --tp 1", and at --tp 1 "did not finish": the slices'
    manifests say the tp size."""
    (tmp_path / "tp0").mkdir()
    (tmp_path / "tp0" / "manifest.json").write_text(json.dumps({"tp": [0, 2]}))
    assert train.saved_tp(tmp_path) == 2 and not train.complete(tmp_path, 2)


def test_a_complete_checkpoint_saved_at_another_tp_is_not_named_unfinished(tmp_path):
    """A run at --tp 1 that would save into a step a --tp 2 run saved whole was told the save "did not finish" and
    to delete it: the check asked for this run's tp's manifests."""
    step = tmp_path / "step_000002"
    for t in range(2):
        (step / f"tp{t}").mkdir(parents=True)
        (step / f"tp{t}" / "manifest.json").write_text(json.dumps({"tp": [t, 2]}))
    with pytest.raises(SystemExit, match=r"which exists \(a checkpoint saved with --tp 2\): pass another --save_dir"):
        train.refuse_saving_into(step, 1, resuming=False)
    # at its own tp: continue from it, unless this run resumed already (from an earlier step, into the same dir)
    with pytest.raises(SystemExit, match="which exists: continue from the latest checkpoint there with --resume"):
        train.refuse_saving_into(step, 2, resuming=False)
    with pytest.raises(SystemExit, match="which exists: pass another --save_dir$"):
        train.refuse_saving_into(step, 2, resuming=True)
    (step / "tp1").rename(step / "tp1.partial")  # a save of slice 1 cut short
    with pytest.raises(SystemExit, match="holds a save that did not finish: delete it"):
        train.refuse_saving_into(step, 1, resuming=False)


def test_tp_choices_offered_divide_the_world_size_too(monkeypatch, capsys):
    """Under torchrun (WORLD_SIZE 2) the --tp choices offered for nano's 4 heads are those that also divide
    the world: --tp 4, offered before, was refused next as not dividing it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        train.parse_args(["--tp", "3"])
    assert "does not divide the nano model's 4 attention heads: choose --tp in {1, 2}\n" in capsys.readouterr().err


def on_rank_broadcast_bytes(data, piece):
    sizes, real = [], dist.broadcast

    def recorded(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.broadcast = recorded
    try:
        got = train.broadcast_bytes(data if dist.get_rank() == 0 else None, torch.device("cpu"), piece)
    finally:
        dist.broadcast = real
    return bytes(got.numpy()), sizes


@pytest.mark.xdist_group("world2")
@pytest.mark.parametrize("size", [0, 1, 999, 1000, 2500])
def test_the_corpus_reaches_every_rank_in_bounded_pieces(world, size):
    """Rank 0's corpus arrives whole on every rank, sent in pieces of at most `piece` bytes (a corpus of any
    size never whole in one device buffer), after its length."""
    data = bytes(range(256)) * 10
    data = data[:size]
    for got, sizes in world(2).run(on_rank_broadcast_bytes, data, 1000):
        print(f"{size} bytes: broadcasts of {sizes} elements")
        assert got == data and sizes[0] == 1 and all(n <= 1000 for n in sizes[1:]), (len(got), sizes)
        assert sum(sizes[1:]) == size


def test_source_is_stripped_line_for_line_as_tokenize_reads_it():
    """Comments and docstrings go, a continuation line is indented one level past its statement, and
    code is indented with tabs. Lines are those tokenize numbers (split at line ends alone): a form feed
    (in Debian's email package, for one) split as a line end put every cut after it one line off."""
    src = b'import os  # a comment\n\x0c\ndef f(x):\n    """doc"""\n    return (x +\n            1)  # more\n\ny = 1\n'
    assert train.strip_source(src) == b"import os\n\x0c\ndef f(x):\n\treturn (x +\n\t\t1)\n\ny = 1\n"


def test_an_empty_data_file_is_named_too_short(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--data", str(tmp_path / "empty.txt")],
                          capture_output=True, text=True, timeout=120, cwd=HERE)
    assert proc.returncode != 0 and "the corpus (0 bytes) is too short" in proc.stderr, proc.stderr[-2000:]


def test_p_a_at_tp1_is_logged_as_keeping_the_whole_input():
    """P_a keeps 1/tp of each block's input: at --tp 1 that is all of it, and the log says so."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--checkpoint", "P_a+cpu", *FAST],
                          capture_output=True, text=True, timeout=120, cwd=HERE)
    print(proc.stdout[-600:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--checkpoint P_a+cpu at --tp 1 keeps each block's whole input, as --checkpoint full does, in CPU " \
           "memory" in proc.stdout


def test_latest_checkpoint_is_the_highest_complete_step(tmp_path):
    for done in ["step_999999", "step_1000000", "step_7/tp0", "step_7/tp1", "step_8/tp0"]:
        (tmp_path / done).mkdir(parents=True)
        (tmp_path / done / "manifest.json").write_text("{}")
    (tmp_path / "step_1000001").mkdir()  # a save cut short: no manifest
    (tmp_path / "step_1000002.partial").mkdir()
    assert train.latest_checkpoint(tmp_path, tp=1) == tmp_path / "step_1000000"
    assert train.latest_checkpoint(tmp_path, tp=2) == tmp_path / "step_7"  # step_8 lacks tp1
    with pytest.raises(SystemExit, match="saved with --tp 1 or 2: resume with that --tp"):
        train.latest_checkpoint(tmp_path, tp=4)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    """lr_at: linear warm-up over the first 5% of the steps (from lr / warm-up steps, never 0),
    then a cosine from lr to lr / 10."""
    args = argparse.Namespace(steps=100, lr=1.0)  # 5 warm-up steps
    assert [train.lr_at(s, args) for s in range(6)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    assert math.isclose(train.lr_at(100, args), 0.1, abs_tol=1e-12)  # (the cosine's end, in floats)
    assert 0.1 < train.lr_at(99, args) < 0.101


def test_checkpoints_are_made_every_save_every_steps_and_at_the_end():
    args = argparse.Namespace(save_dir="d", steps=10, save_every=4)
    made = {s: train.checkpoint_dir(args, s) for s in range(10)}
    assert [s for s, d in made.items() if d] == [3, 7, 9] and made[9].name == "step_000010"
    args.save_every = 0  # only at the end
    assert [s for s in range(10) if train.checkpoint_dir(args, s)] == [9]


def test_the_sample_prints_an_id_past_255_as_a_replacement_character():
    """The byte-level model's sample: ids 0-255 are bytes (UTF-8 decoded); a preset's vocabulary is GPT-2's
    (50,304), whose ids past 255 are no byte (before, bytes() raised after training and --out was lost)."""
    assert train.decode(list("déf".encode()) + [300, 50303, 10]) == "déf\ufffd\ufffd\n"


def test_deterministic_sets_cublas_workspace_before_cuda_starts(monkeypatch):
    """--deterministic on CUDA needs CUBLAS_WORKSPACE_CONFIG before CUDA starts, or the first matmul raises:
    train.py sets it (test_cuda.py runs --deterministic without it in the environment); a value given is kept."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        train.deterministic(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.are_deterministic_algorithms_enabled()
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        train.deterministic(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        train.deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()
