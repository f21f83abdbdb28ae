"""train.py -- the main job: a GPT (gpt.py) trained with ZeRO-DP (zero.py), with optional
Megatron tensor parallelism, on a text corpus every machine has: the Python standard library's
own source files (byte-level tokens, no download).

    torchrun --standalone --nproc_per_node=2 train.py --stage 3            # ZeRO-3 over 2 ranks
    torchrun --standalone --nproc_per_node=4 train.py --stage 2 --tp 2     # 2 data x 2 tensor parallel
    python train.py --stage 0                                               # one process
    python train.py --data input.txt --model small --steps 2000            # any text file

Same seed and data give the same loss at every step for stages 0, 1, 2 and 3: ZeRO changes
where the model states live, not the arithmetic. gloo on CPU, NCCL on GPU, picked automatically.
"""
import argparse
import io
import json
import math
import os
import pathlib
import sysconfig
import time
import tokenize
import zlib

import torch
import torch.distributed as dist

import zero
from gpt import GPT, PRESETS, divisors, make_mesh, num_params


def tp_choices(model, world=0):
    """The --tp values a preset splits over (each tp rank takes whole heads and vocab / tp embedding rows) that
    also divide the world size (0: not known), as an error message offers them."""
    return divisors(math.gcd(PRESETS[model].n_head, PRESETS[model].vocab_size, world))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO-DP stage (0 = plain DP)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree; data-parallel = world / tp")
    p.add_argument("--model", default="nano", choices=list(PRESETS), help="gpt.py preset")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch_size", type=int, default=8,
                   help="sequences per data-parallel rank per micro-batch (--grad_accum a step)")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--lr", type=float, default=4e-3, help="peak learning rate (warm-up, then cosine to lr/10)")
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the dtype the model computes in; 16-bit keeps fp32 master weights in the optimizer shard")
    p.add_argument("--grad_accum", type=int, default=1, help="micro-batches per step (each of --batch_size)")
    p.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    p.add_argument("--checkpoint", default="none", choices=["none", "full", "P_a", "P_a+cpu"],
                   help="activation checkpointing of the transformer blocks (ZeRO-R, Section 6.1)")
    p.add_argument("--contiguous", action="store_true", help="M_D: keep the checkpoints in one pre-allocated buffer")
    p.add_argument("--bucket_numel", type=int, default=None,
                   help="C_B: elements per communication bucket (default: zero.default_bucket_numel, 2^22 up to 64 ranks)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True): the same bits on every run (on GPUs, slower)")
    p.add_argument("--eval_every", type=int, default=250, help="validation loss every this many steps")
    p.add_argument("--data", default=None, help="a text file (default: the Python standard library's source)")
    p.add_argument("--out", default=None, help="write the run's log as JSON to this file")
    p.add_argument("--save_dir", default=None, help="save sharded checkpoints into DIR/step_NNNNNN")
    p.add_argument("--save_every", type=int, default=0, help="a checkpoint every this many steps (and at the end)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from a checkpoint (default: the latest complete one in --save_dir)")
    args = p.parse_args(argv)
    if args.save_every < 0:
        p.error(f"--save_every must be 0 (a checkpoint at the end only) or more (got {args.save_every})")
    if args.save_every and not args.save_dir:
        p.error("--save_every needs --save_dir DIR, where the checkpoints go")
    if args.resume == "latest" and not args.save_dir:
        p.error("--resume without a checkpoint needs --save_dir DIR to find the latest one in")
    for name in ("steps", "batch_size", "seq_len", "eval_every", "tp", "grad_accum", "bucket_numel"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    for name, low in (("lr", "above 0"), ("weight_decay", "0 or more"), ("grad_clip", "0 (off) or more")):
        value = getattr(args, name)  # (nan passes no comparison: it fails this one)
        if not (math.isfinite(value) and (value > 0 if name == "lr" else value >= 0)):
            p.error(f"--{name} must be {low}, a finite number (got {value:g})")
    if not 0 <= args.seed < 2**64 // 1000:  # (each dp rank's data stream is seeded seed * 1000 + its rank: 64 bits)
        p.error(f"--seed must be in [0, 2**64 // 1000) (got {args.seed})")
    if args.contiguous and args.checkpoint == "none":
        p.error("--contiguous keeps activation checkpoints in one buffer: add --checkpoint full, P_a or P_a+cpu")
    if args.save_dir and pathlib.Path(args.save_dir).exists() and not pathlib.Path(args.save_dir).is_dir():
        p.error(f"--save_dir {args.save_dir} is a file: give a directory, where step_NNNNNN checkpoints go")
    if args.data and not pathlib.Path(args.data).is_file():
        p.error(f"--data {args.data} is not a file: give a text file (or leave --data out for the standard library)")
    if args.out and pathlib.Path(args.out).is_dir():
        p.error(f"--out {args.out} is a directory: give a file path, e.g. {args.out}/run.json")
    for name in ("save_dir", "out"):  # written after training: a path under a file would fail only then
        above = next((d for d in pathlib.Path(getattr(args, name) or ".").parents if d.exists()), None)
        if above is not None and not above.is_dir():
            p.error(f"--{name} {getattr(args, name)} lies under {above}, a file: give a path in a directory")
    if args.resume not in (None, "latest"):  # a checkpoint has a manifest.json, or one per tp slice in tp*/
        resume = pathlib.Path(args.resume)
        if not (resume / "manifest.json").is_file() and not any(d.is_dir() for d in resume.glob("tp*")):
            p.error(f"--resume {args.resume} is not a checkpoint ("
                    + ("it does not exist" if not resume.exists() else "no manifest.json")
                    + "): give a step directory a run saved (DIR/step_NNNNNN), or --save_dir DIR --resume "
                      "for its latest complete one")
        if (resume / "manifest.json").is_file():  # one tp slice of a --tp N checkpoint has a manifest of its own
            slice_of = tp_slice(resume / "manifest.json")
            if slice_of[1] > 1:
                p.error(f"--resume {args.resume} is tp slice {slice_of[0]} of a checkpoint saved with --tp "
                        f"{slice_of[1]}: resume from its step directory, --resume {resume.parent} --tp {slice_of[1]}")
    n_head, vocab = PRESETS[args.model].n_head, PRESETS[args.model].vocab_size
    fits = tp_choices(args.model, int(os.environ.get("WORLD_SIZE", 0)))  # (torchrun's world size)
    if n_head % args.tp:
        p.error(f"--tp {args.tp} does not divide the {args.model} model's {n_head} attention heads: choose --tp in "
                f"{fits}")
    if vocab % args.tp:
        p.error(f"--tp {args.tp} does not divide the {args.model} model's vocabulary of {vocab} tokens: choose --tp "
                f"in {fits}")
    if args.seq_len > PRESETS[args.model].block_size:
        p.error(f"--seq_len {args.seq_len} exceeds the {args.model} model's block_size "
                f"{PRESETS[args.model].block_size}: use --seq_len {PRESETS[args.model].block_size} or less")
    return args


def setup_distributed():
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or one process on its own."""
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return backend, device


def load_corpus(path):
    """The bytes of --data as they are, or by default the standard library's .py files in sorted
    order, each through strip_source (about 4.7 MB on Python 3.11). Left out: tests, idlelib,
    lib2to3, and the codecs' encodings and pydoc's topics, which are tables and prose, not code."""
    if path is not None:
        return pathlib.Path(path).read_bytes()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "encodings", "pydoc_data"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    return b"".join(strip_source(p.read_bytes()) for p in files)


def broadcast_bytes(data, device, piece=2**24):
    """Rank 0's bytes (data; None elsewhere) on every rank, as a uint8 tensor in CPU memory, sent in pieces of at most
    `piece` bytes through one device buffer: a corpus of any size, never whole on the GPU (NCCL sends from there)."""
    sender = data is not None
    size = torch.tensor([len(data) if sender else 0], device=device)
    dist.broadcast(size, group_src=0)
    if data:
        whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:  # the receivers' (and an empty file's: frombuffer takes no empty buffer)
        whole = torch.zeros(size.item(), dtype=torch.uint8)
    buffer = torch.empty(min(piece, len(whole)), dtype=torch.uint8, device=device)
    for lo in range(0, len(whole), piece):
        part = buffer[:min(piece, len(whole) - lo)]
        if sender:
            part.copy_(whole[lo:lo + len(part)])
        dist.broadcast(part, group_src=0)
        if not sender:
            whole[lo:lo + len(part)] = part
    return whole


def strip_source(src):
    """Python source (bytes) as load_corpus uses it: comments and docstrings removed (a line left
    empty goes), a continuation line inside brackets re-indented to its statement's indentation
    plus 4 spaces (none before a closing bracket), then each line of code indented with tabs, one
    per 4 spaces. Lines inside multi-line strings stay as they are, but for a closing line with code
    after the string (three quotes, then `, 1)`), whose leading spaces become tabs; a file tokenize cannot read is
    kept whole."""
    text = src.decode("utf-8", errors="replace")
    lines = io.StringIO(text).readlines()  # (split as tokenize splits: at \n alone, not at a form feed)
    try:
        toks = list(tokenize.generate_tokens(iter(lines).__next__))  # (the same lines)
    except (tokenize.TokenError, SyntaxError):
        return src
    cut, drop, indent, code_lines = {}, set(), {}, set()  # by 0-based line number
    depth, stmt_indent, prev = 0, "", tokenize.NEWLINE
    layout = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for i, tok in enumerate(toks):
        (r0, c0), (r1, c1) = tok.start, tok.end
        if tok.type not in layout and r0 - 1 not in code_lines:  # the first token of a line
            code_lines.add(r0 - 1)
            line = lines[r0 - 1]
            if depth == 0:
                stmt_indent = line[:len(line) - len(line.lstrip(" \t"))]
            elif not line[:c0].strip():
                indent[r0 - 1] = stmt_indent + ("" if tok.string in ")]}" else "    ")
        if tok.type == tokenize.OP and tok.string in ("(", "[", "{"):
            depth += 1
        elif tok.type == tokenize.OP and tok.string in (")", "]", "}"):
            depth -= 1
        if tok.type == tokenize.COMMENT:
            cut.setdefault(r0 - 1, []).append((c0, None))
        elif (tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
              and toks[i + 1].type in (tokenize.NEWLINE, tokenize.COMMENT)):  # a docstring
            cut.setdefault(r0 - 1, []).append((c0, c1 if r0 == r1 else None))
            if r1 > r0:
                drop.update(range(r0, r1 - 1))
                cut.setdefault(r1 - 1, []).append((0, c1))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    out = []
    for n, line in enumerate(lines):
        if n in drop:
            continue
        if n in cut:
            for c0, c1 in sorted(cut[n], reverse=True):
                line = line[:c0] + ("" if c1 is None else line[c1:])
            if not line.strip():
                continue
            line = line.rstrip() + "\n"
        if n in indent:
            line = indent[n] + line.lstrip(" \t")
        if n in code_lines:
            body = line.lstrip(" ")
            spaces = len(line) - len(body)
            line = "\t" * (spaces // 4) + " " * (spaces % 4) + body
        out.append(line)
    return "".join(out).encode("utf-8")


def decode(ids):
    """Byte ids as text; an id past 255 (a preset's vocabulary is GPT-2's, padded) is no byte: U+FFFD."""
    return b"".join(bytes([i]) if i < 256 else "\ufffd".encode() for i in ids).decode("utf-8", errors="replace")


def get_batch(data, batch_size, seq_len, generator, device):
    ix = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=generator)
    x = torch.stack([data[i:i + seq_len] for i in ix]).long()          # (B, T) byte ids
    y = torch.stack([data[i + 1:i + 1 + seq_len] for i in ix]).long()  # (B, T) next bytes
    return x.to(device), y.to(device)


def lr_at(step, args):
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def data_stream(seed, dp_rank, dp, step=0, saved=None):
    """This dp rank's batch generator: its own stream from the seed, or on resume its saved position.
    Saved at another dp size, the streams are other ranks' (rank r would get saved rank r % dp's and
    repeat its batches), so each rank draws a fresh stream of its own, seeded by the step."""
    gen = torch.Generator()
    if saved is None:
        return gen.manual_seed(seed * 1000 + dp_rank)
    if saved.get("dp") == dp:
        return gen.set_state(saved["data"])
    return gen.manual_seed(zlib.crc32(f"{seed}:{step}:{dp_rank}".encode()))


def checkpoint_part(path, tp, tp_rank):
    """Where this rank's tp slice is saved: at tp > 1 each slice is a checkpoint of its own, in path/tp{tp_rank}."""
    return pathlib.Path(path) / f"tp{tp_rank}" if tp > 1 else pathlib.Path(path)


def tp_slice(manifest):
    """[tp rank, tp size] of the slice a manifest.json describes (one saved before zero recorded it: [0, 1])."""
    return json.loads(pathlib.Path(manifest).read_text()).get("tp", [0, 1])


def saved_tp(path):
    """How many tp slices the checkpoint was saved as: what a slice's manifest says, else the slices there (a slice
    whose save did not finish counts)."""
    said = [tp_slice(m)[1] for m in pathlib.Path(path).glob("tp*/manifest.json")]
    there = len({d.name.removesuffix(".partial") for d in pathlib.Path(path).glob("tp*") if d.is_dir()})
    return max(said + [there, 1])


# The flags that define a run: a resumed run must repeat them (the learning-rate schedule, the
# batches and the optimizer's options follow from them); stage, tp, dp and buckets may change.
RUN_FLAGS = ("model", "steps", "lr", "weight_decay", "batch_size", "seq_len", "grad_accum", "grad_clip", "dtype",
             "seed", "data")


def run_flags(args):
    """The run's flags as a checkpoint keeps them: --data as the file it names, however it was spelled."""
    return {k: os.path.realpath(args.data) if k == "data" and args.data else getattr(args, k) for k in RUN_FLAGS}


def refuse_another_run(path, extra, args, dp):
    """Stop where the checkpoint belongs to a run with other flags (a checkpoint without them: not checked). At
    another dp, --batch_size and --grad_accum may change, so long as a step's sequences stay what they were."""
    saved, now, saved_dp = (extra or {}).get("run", {}), run_flags(args), (extra or {}).get("dp", dp)
    if saved.get("data") and (saved["data"] == args.data or os.path.realpath(saved["data"]) == now["data"]):
        saved = {**saved, "data": now["data"]}  # the same file (an earlier train.py saved it as given)
    batch = []
    if saved_dp != dp and "batch_size" in saved:  # sequences a step: --batch_size x --grad_accum x dp
        sequences, here = saved["batch_size"] * saved["grad_accum"] * saved_dp, args.batch_size * args.grad_accum * dp
        if sequences != here:
            keep = f"--batch_size x --grad_accum = {sequences // dp}" if sequences % dp == 0 else \
                f"a dp that divides {sequences}"
            batch = [f"{sequences} sequences a step at dp {saved_dp} (now {here} at dp {dp}: keep them with {keep})"]
        saved = {**saved, "batch_size": args.batch_size, "grad_accum": args.grad_accum}
    changed = [f"--{k} {saved[k]} (now {now[k]})" for k in RUN_FLAGS if k in saved and saved[k] != now[k]] + batch
    if changed:
        raise SystemExit(f"--resume: {path} belongs to a run with {', '.join(changed)}: resume with the run's "
                         f"flags (its learning-rate schedule, batches and optimizer options follow from them), "
                         f"or start a new run")


def complete(path, tp):
    """Every tp slice's manifest written (a save cut short has none)."""
    return all((checkpoint_part(path, tp, t) / "manifest.json").is_file() for t in range(tp))


def refuse_saving_into(path, tp, resuming):
    """Stop before training where this run would save into `path`, which exists: as the tp it was saved at says
    (a run resumed already is not told to resume)."""
    there = saved_tp(path)
    if not complete(path, there):
        raise SystemExit(f"--save_dir: this run would save {path}, which holds a save that did not finish: "
                         f"delete it, then continue from the latest complete checkpoint with --resume")
    if there != tp:
        fix = f" (a checkpoint saved with --tp {there}): pass another --save_dir"
    else:
        fix = ": " + ("" if resuming else "continue from the latest checkpoint there with --resume, or ") + \
            "pass another --save_dir"
    raise SystemExit(f"--save_dir: this run would save {path}, which exists{fix}")


def latest_checkpoint(save_dir, tp):
    """The highest step in save_dir whose checkpoint is complete."""
    steps = [d for d in pathlib.Path(save_dir).glob("step_*") if d.name[5:].isdigit()]
    done = [d for d in steps if complete(d, tp)]
    if not done:
        other = sorted({saved_tp(d) for d in steps if complete(d, saved_tp(d))} - {tp})
        raise SystemExit(f"--resume: no complete checkpoint saved at --tp {tp} in {save_dir}: "
                         + (f"it holds checkpoints saved with --tp {' or '.join(map(str, other))}: resume with that --tp"
                            if other else "start without --resume"))
    return max(done, key=lambda d: int(d.name[5:]))


def checkpoint_dir(args, step):
    """Where the checkpoint made after `step` goes (every --save_every steps and at the end), or None."""
    if args.save_dir and (step == args.steps - 1 or args.save_every and (step + 1) % args.save_every == 0):
        return pathlib.Path(args.save_dir) / f"step_{step + 1:06d}"
    return None


def deterministic(on):
    """torch.use_deterministic_algorithms(on). On CUDA, cuBLAS then needs a fixed workspace, whose size is read
    from the environment when CUDA starts (it raises at the first matmul without one): set here, before."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)


def main(argv=None):
    args = parse_args(argv)
    deterministic(args.deterministic)
    backend, device = setup_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}: choose --tp in "
                         f"{tp_choices(args.model, world)}")
    dp = world // args.tp
    dp_group, tp_group = make_mesh(dp, args.tp, device.type)
    dp_rank, tp_rank = dist.get_rank(dp_group), dist.get_rank(tp_group)
    log = print if rank == 0 else (lambda *a, **k: None)

    # data: the same bytes on every rank, prepared by rank 0 alone; 90% train, 10% validation
    data = broadcast_bytes(load_corpus(args.data) if rank == 0 else None, device)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    if len(val_data) <= args.seq_len + 1:
        raise SystemExit(f"the corpus ({len(data)} bytes) is too short for --seq_len {args.seq_len}: its last 10% "
                         f"(the validation split) must hold more than seq_len + 1 bytes: use a corpus of "
                         f"{10 * (args.seq_len + 2)} bytes or more, or a shorter --seq_len")

    # memory on CPU is counted from the tensors alive; the corpus is not the model's
    baseline = zero.live_tensor_bytes() if device.type == "cpu" else 0

    # model: built on the meta device (nothing allocated); zero.initialize has each rank
    # initialise it one module at a time, keeping its slice (tp) of its shard (dp) of the weights
    config = PRESETS[args.model]
    model = GPT(config, tp_group=tp_group if args.tp > 1 else None, seed=args.seed, device="meta")
    if args.checkpoint != "none":
        zero.checkpoint_activations(model.h, tp_group=tp_group if args.tp > 1 else None,
                                    partition=args.checkpoint.startswith("P_a"), cpu=args.checkpoint == "P_a+cpu",
                                    contiguous=args.contiguous)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    model, optimizer = zero.initialize(model, torch.optim.AdamW, stage=args.stage, group=dp_group,
                                       param_groups=[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                                       param_dtype=getattr(torch, args.dtype), bucket_numel=args.bucket_numel,
                                       stage3_units=model.h,  # stage 3 gathers a block's parameters at once
                                       init_fn=model.init_weights, device=device, tp_group=tp_group,
                                       lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    # the root's forward and backward, on measured steps; made after zero.initialize, so that the
    # end of forward is measured after stage 3 has freed what it gathered for the forward
    memory = zero.MemoryHooks(model, every_module=False)
    log(f"{backend} on {device.type} | world {world} = dp {dp} x tp {args.tp} | ZeRO stage {args.stage} | {args.dtype} | "
        f"model {args.model}: {num_params(config) / 1e6:.2f}M parameters | corpus {len(data) / 1e6:.1f} MB")
    if args.checkpoint.startswith("P_a") and args.tp == 1:  # P_a keeps 1/tp of a block's input: all of it here
        log(f"--checkpoint {args.checkpoint} at --tp 1 keeps each block's whole input, as --checkpoint full does"
            + (", in CPU memory" if args.checkpoint == "P_a+cpu" else ""))

    gen, first = data_stream(args.seed, dp_rank, dp), 0  # each dp rank its own batches
    if args.resume:  # the model, optimizer, loss scale and RNG, then the step and the data position
        path = latest_checkpoint(args.save_dir, args.tp) if args.resume == "latest" else args.resume
        tp_saved = saved_tp(path)
        if tp_saved != args.tp:  # each tp slice has its own shapes
            raise SystemExit(f"--resume: {path} was saved with --tp {tp_saved}: resume with --tp {tp_saved} "
                             f"(any number of data-parallel ranks)")
        if not complete(path, tp_saved):
            raise SystemExit(f"--resume: the save of {path} did not finish (a tp slice has no manifest.json): "
                             f"resume from an earlier step")
        try:
            extra = zero.load_checkpoint(checkpoint_part(path, args.tp, tp_rank), model, optimizer)
        except zero.CheckpointError as e:  # (another --model or --dtype: named as the flag it is)
            refuse_another_run(path, e.extra, args, dp)
            raise SystemExit(f"--resume: {e}") from None
        refuse_another_run(path, extra, args, dp)
        first = extra["step"]
        if first >= args.steps:
            raise SystemExit(f"--resume: {path} is the end of its run (step {first} of --steps {args.steps}): "
                             f"nothing is left to train")
        gen = data_stream(args.seed, dp_rank, dp, first, extra)
        log(f"resumed from {path} at step {first}" + ("" if extra.get("dp") == dp else
            f" (saved at dp {extra.get('dp', '?')}, now dp {dp}: each rank draws a fresh data stream)"))
    taken = [d for d in (checkpoint_dir(args, step) for step in range(first, args.steps)) if d and d.exists()]
    if taken:
        refuse_saving_into(taken[0], args.tp, resuming=args.resume is not None)
    tokens_per_step = args.batch_size * args.seq_len * dp * args.grad_accum
    history, val_history, stopped = [], [], None  # stopped: why the run ended early, if it did
    # The memory line comes from the first step; on CUDA from the second: a thread's first matmul
    # makes its cuBLAS workspace (32 MiB on Hopper), which the first forward would count as kept.
    memory_step = min(first + (device.type == "cuda"), args.steps - 1)
    for step in range(first, args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        batches = [get_batch(train_data, args.batch_size, args.seq_len, gen, device) for _ in range(args.grad_accum)]
        # on CPU each record walks every tensor
        measure = step in (first, memory_step) or (step + 1) % args.eval_every == 0
        memory.records, memory.recording = [], measure
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        step_loss = torch.zeros((), device=device)
        for x, y in batches:  # micro-batches: each backward adds its averaged gradient to the shard
            _, loss = model(x, y)
            optimizer.backward(loss / args.grad_accum)  # loss.backward(), times the loss scale in fp16
            step_loss += loss.detach() / args.grad_accum
        memory.record("backward end", "")
        if args.grad_clip > 0:
            optimizer.clip_grad_norm_(args.grad_clip)
        stepped = optimizer.step()  # False: fp16 overflow, step skipped on every rank
        memory.record("step end", "")  # AdamW's states exist from the first step on
        state_mb = zero.model_state_bytes(model) / 1e6  # parameters, gradients and optimizer states
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000
        memory.recording = False
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) / 1e6
        else:  # CPU: the largest live-tensor total seen at a module boundary, on measured steps only
            peak = (memory.peak() - baseline) / 1e6 if measure else None
        if step == memory_step:
            log(f"memory at step {step} ({'CUDA allocator' if device.type == 'cuda' else 'live tensors'}): "
                f"activations kept at the end of forward {memory.kept_by_forward() / 1e6:.2f} MB/rank "
                f"(checkpointing: {args.checkpoint}) | peak {peak:.2f} MB/rank")
        dist.all_reduce(step_loss, group=dp_group)  # the loss of the whole batch, over dp ranks
        mean_loss, tok_s = step_loss.item() / dp, tokens_per_step / ms * 1000
        history.append(dict(step=step, loss=mean_loss, ms=ms, tokens_per_s=tok_s, model_state_mb=state_mb, peak_mb=peak))
        log(f"step {step:4d} | loss {mean_loss:.4f} | {ms:7.1f} ms | {tok_s:8.0f} tok/s | "
            f"model states {state_mb:6.2f} MB/rank | peak " + ("     -" if peak is None else f"{peak:6.2f}") + " MB/rank"
            + (" (measured: slower step)" if measure and device.type == "cpu" else "")
            + ("" if stepped else f" | overflow: step skipped, loss scale now {optimizer.loss_scale:g}"))
        if not math.isfinite(mean_loss):  # the same value on every rank: all stop here
            stopped = f"step {step}: the loss is {mean_loss}: training diverged; lower --lr (now {args.lr:g})"
            break
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            val = evaluate(model, val_data, args, device, dp_group, dp)
            val_history.append(dict(step=step, val_loss=val))
            log(f"step {step:4d} | validation loss {val:.4f}")
        path = checkpoint_dir(args, step)
        if path:
            try:  # a collective: it fails on every rank, and then every rank stops here
                save(path, args, tp_group, model, optimizer, step=step + 1, dp=dp, data=gen.get_state(),
                     run=run_flags(args))
            except Exception as e:  # (a full disk, another run saving there): the log so far is kept
                stopped = (f"step {step}: {e}. Make room or pass another --save_dir, and continue from the latest "
                           f"complete checkpoint with --resume")
                break
            log(f"step {step:4d} | saved {path}")

    # a sample: every rank runs the same generation (stage 3 gathers parameters collectively,
    # tp ranks must draw the same tokens), rank 0 prints it
    sample = None
    if not stopped:
        prompt = torch.tensor([list(b"def ")], device=device)
        out = model.generate(prompt, 200, temperature=0.7, top_k=50, generator=torch.Generator().manual_seed(args.seed),
                             context=args.seq_len)  # (the positions it was trained on)
        sample = decode(out[0].tolist())
        log("-" * 40 + " sample " + "-" * 40 + "\n" + sample.expandtabs(4) + "\n" + "-" * 88)  # tabs as 4 spaces
    if args.out and rank == 0:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # --out out/run.json in a fresh clone
        pathlib.Path(args.out).write_text(json.dumps(dict(args=vars(args), world=world, backend=backend,
                                                          log=history, val=val_history, sample=sample,
                                                          stopped=stopped), indent=1))
    dist.destroy_process_group()
    if stopped:
        raise SystemExit(stopped)
    return history


@torch.no_grad()
def save(path, args, tp_group, model, optimizer, **extra):
    """This rank's tp slice into path, a collective over its dp group; at tp > 1 the tp ranks then
    compare, so one slice's failure is every rank's error."""
    error = None
    try:
        zero.save_checkpoint(checkpoint_part(path, args.tp, dist.get_rank(tp_group)), model, optimizer, **extra)
    except Exception as e:  # (one raised before any collective too: the path exists)
        error = e
    if args.tp > 1:
        errors = [None] * args.tp
        dist.all_gather_object(errors, error and str(error), group=tp_group)
        if any(errors):
            raise RuntimeError(f"saving {path} failed: {'; '.join(e for e in errors if e)}") from error
    if error:
        raise error


@torch.no_grad()  # (with a graph, each batch's would be kept until the sum is read)
def evaluate(model, val_data, args, device, dp_group, dp, batches=4):
    gen = torch.Generator().manual_seed(dist.get_rank(dp_group))  # the same validation batches every time
    total = torch.zeros((), device=device)
    for _ in range(batches):
        x, y = get_batch(val_data, args.batch_size, args.seq_len, gen, device)
        total += model(x, y)[1]
    dist.all_reduce(total, group=dp_group)
    return total.item() / (batches * dp)


if __name__ == "__main__":
    main()
