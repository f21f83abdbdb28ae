"""What the tests share: Net, the model with every awkward case, and the helpers that train it
beside torch's DDP and compare the results bit for bit. Functions here run on spawned ranks
(conftest.py), which find them by module name: keep this file importable from the repository root.
"""
import torch
import torch.distributed as dist
import torch.nn as nn

VOCAB, DIM, HIDDEN = 23, 9, 13


class Net(nn.Module):
    """Every awkward case at once: odd sizes (Ψ = 751, so shards straddle parameters and need
    padding at every Nd > 1), a tied weight, a frozen layer, two layers used only in some
    steps, and a buffer that forward updates and the output depends on."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.sometimes = nn.Linear(DIM, DIM)  # unused on some ranks in some steps
        self.rarely = nn.Linear(DIM, DIM)  # unused on every rank in even steps
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("seen", torch.zeros(DIM))

    def forward(self, idx, use_sometimes, use_rarely):
        h = self.emb(idx)  # (B, T, DIM)
        if self.training:  # a running mean of the embeddings: differs per rank until synchronised
            self.seen.mul_(0.9).add_(h.detach().mean((0, 1)), alpha=0.1)
        h = h + self.fc2(torch.tanh(self.fc1(self.ln(h))))
        h = self.frozen(h)
        if use_sometimes:
            h = h + self.sometimes(h)
        if use_rarely:
            h = h + self.rarely(h)
        return self.head(h + self.seen)  # (B, T, VOCAB)


def usage(step, rank, symmetric):
    """Which optional layers run. Stage 3 gathers each module's parameters collectively, so
    there every rank must run the same modules (symmetric); stages 0-2 also allow a layer that
    only some ranks use."""
    sometimes = step % 3 != 1 if symmetric else (step + rank) % 3 != 1
    return sometimes, step % 2 == 1


def make_model():
    torch.manual_seed(100 + dist.get_rank())  # ranks start different: both sides take rank 0's
    return Net()


def pairwise_sum(parts):
    """The sum of parts (one per rank, in rank order) in zero.py's exact order, written out here:
    neighbours added pairwise, level by level, an odd last one carried up as it is:
    (g_0 + g_1) + g_2 at Nd 3, (g_0 + g_1) + (g_2 + g_3) at Nd 4."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def average_gradients(module):
    """DDP's averaging in plain torch, for a model whose forward does not go through one module (parts
    called on their own): each gradient divided by Nd, then summed over the ranks. At world size 2 every
    order of summation gives the same bits, so this is DDP's result there."""
    for p in module.parameters():
        if p.grad is not None:
            p.grad.div_(dist.get_world_size())
            dist.all_reduce(p.grad)


def pairwise_hook(state, bucket):
    """DDP's own all_reduce, at world size 3 and more, sums each element in an order that
    depends on the bucket layout (gloo's ring; and DDP rebuilds its buckets after the first
    step), which no other layout reproduces. This comm hook makes DDP average as zero.py does:
    each rank's gradients divided by Nd, then summed in pairwise_sum's order. DDP hands a hook the
    undivided local gradients."""
    nd = dist.get_world_size()
    t = bucket.buffer().div_(nd)
    parts = [torch.empty_like(t) for _ in range(nd)]
    dist.all_gather(parts, t)
    fut = torch.futures.Future()
    fut.set_result(pairwise_sum(parts))
    return fut


def compare(where, got, want):
    """Where got differs from want (tensors, or dicts of them), each tensor by torch.equal; [] if nowhere."""
    if isinstance(want, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(got)} != {sorted(want)}"]
        return [m for k in want for m in compare(f"{where}.{k}", got[k], want[k])]
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
        return [f"rank {dist.get_rank()} {where}: not equal (max abs diff {diff})"]
    return []


def missed_errors(cases, errors, match=lambda pattern, text: pattern in text):
    """cases: {pattern: call}. Each call must raise one of `errors` whose message matches
    `pattern` (by default: contains it). Returns what missed, [] if nothing did."""
    missed = []
    for pattern, call in cases.items():
        try:
            call()
            missed.append(f"no error for {pattern!r}")
        except errors as e:
            if not match(pattern, str(e)):
                missed.append(f"{pattern!r} not in {e}")
    return missed
