"""
gpt.py -- the GPT-2 decoder that zero trains, with Megatron-style tensor parallelism.

ZeRO (Rajbhandari et al. 2020) runs ZeRO-DP alongside model parallelism (MP): the paper's
largest models combine it with Megatron-LM's tensor slicing (Shoeybi et al. 2019). This is that
model: a GPT-2 (pre-LN blocks, causal attention, 4x GELU MLP, learned positions, embedding tied
to the output layer, no dropout) whose linear layers split over a `tp_group`; with
tp_group=None it is a plain one-process model that needs no process group.

At every tp, and built whole or on the meta device (init_weights, one module at a time, as
zero.initialize's init_fn), the model starts from the tp=1 model's weights for the same seed.

    from gpt import GPT, PRESETS, num_params, make_mesh
    model = GPT(PRESETS["tiny"], seed=0)                  # one process, tp = 1
    logits, loss = model(idx, targets)                    # idx, targets: (B, T) int64
    out = model.generate(idx, 100, top_k=10, generator=torch.Generator().manual_seed(0))

    # under torchrun --nproc_per_node=4: 2-way data parallel x 2-way tensor parallel
    dp_group, tp_group = make_mesh(dp=2, tp=2)
    model = GPT(PRESETS["tiny"], tp_group=tp_group, seed=0)

    GPT(PRESETS["7.5b"], device="meta")                   # allocates nothing, initialises nothing
    num_params(PRESETS["7.5b"])                           # psi, without building anything
"""
import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 128   # longest sequence T
    vocab_size: int = 256   # V; must divide by tp (pad it: 50257 -> 50304)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128       # C
    bias: bool = True       # biases in the linears and LayerNorms, like GPT-2


PRESETS = {
    # train.py's default: byte-level code, 2 blocks, 1000 steps on 2 CPU cores (0.45M parameters)
    "nano": GPTConfig(block_size=128, vocab_size=256, n_layer=2, n_head=4, n_embd=128),
    # byte-level text; trains on 2 CPU cores in a couple of minutes (0.84M parameters)
    "tiny": GPTConfig(block_size=128, vocab_size=256, n_layer=4, n_head=4, n_embd=128),
    # nanoGPT's shakespeare-char shape with a byte vocabulary (10.8M parameters)
    "small": GPTConfig(block_size=256, vocab_size=256, n_layer=6, n_head=6, n_embd=384),
    # GPT-2 XL (1.56B), the paper's Section 3 example (16 psi = 24 GB of model states); vocab
    # 50257 is GPT-2's own and divides by no tp > 1: use vocab_size=50304 for tensor parallelism
    "gpt2-1.5b": GPTConfig(block_size=1024, vocab_size=50257, n_layer=48, n_head=25, n_embd=1600),
    # the three models of the paper's Table 1: 7.5B (7.46B here; also Figure 1's psi), 128B
    # (127.5B) and 1T (1.008T, Megatron-LM's 1T shape); vocab padded to a multiple of 128
    "7.5b": GPTConfig(block_size=1024, vocab_size=50304, n_layer=36, n_head=32, n_embd=4096),
    "128b": GPTConfig(block_size=2048, vocab_size=50304, n_layer=70, n_head=96, n_embd=12288),
    "1t": GPTConfig(block_size=2048, vocab_size=50304, n_layer=128, n_head=160, n_embd=25600),
}


def num_params(config, tp_size=1):
    """Parameters held by one tp rank, by arithmetic; tp_size=1 gives the paper's psi (the tied
    embedding counted once)."""
    C, L, V, T, b = config.n_embd, config.n_layer, config.vocab_size, config.block_size, int(config.bias)
    ln = (1 + b) * C                                          # a LayerNorm: weight (+ bias)
    split = V * C + L * (12 * C * C + b * (3 * C + 4 * C))    # wte; 4 weights; qkv and MLP-up biases
    replicated = T * C + L * (2 * ln + b * 2 * C) + ln        # wpe; 2 LNs, 2 row biases; ln_f
    return split // tp_size + replicated


def make_mesh(dp, tp, device_type="cpu"):
    """(dp_group, tp_group) of a (dp, tp) mesh; tp groups are consecutive ranks (Megatron's
    layout): at dp=2, tp=2 the tp groups are {0, 1} and {2, 3}, the dp groups {0, 2} and {1, 3}."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"].get_group(), mesh["tp"].get_group()


def _tp(group):
    """(tp_size, tp_rank); no group means tp=1 and needs no torch.distributed at all."""
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def divisors(n):
    """n's divisors as an error message offers them: "{1, 2, 4}"."""
    return "{" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


def _check_divisible(what, n, tp_size):
    if n % tp_size:
        raise ValueError(f"{what}={n} is not divisible by tp={tp_size}: choose tp in {divisors(n)}")


# ---------------------------------------------------------------------------
# Megatron's conjugate operators f and g (Shoeybi et al. 2019, Figure 3)
# f opens a tensor-parallel region, g closes it; each is the other's transpose.
# ---------------------------------------------------------------------------

class CopyToTPRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward.

        forward:   X ----+----> X  (rank 0: X @ A_0)        placed before a ColumnParallelLinear:
                         +----> X  (rank 1: X @ A_1)        every rank needs the whole input
        backward:  dX = dX_0 + dX_1  (all-reduce)           each rank's partial dX sums to dX
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # (B, T, C) summed over tp: 2(tp-1)/tp x its bytes sent
        return grad, None


class ReduceFromTPRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity gradient backward.

        forward:   Y_0 (rank 0) --+
                                  +--> Y = Y_0 + Y_1 on every rank (all-reduce)
                   Y_1 (rank 1) --+                         placed after a RowParallelLinear
        backward:  dY_0 = dY_1 = dY                         the sum's gradient goes to every term
    """

    @staticmethod
    def forward(ctx, y, group):
        ctx.mark_dirty(y)                        # reduced in place, like Megatron
        dist.all_reduce(y, group=group)          # (B, T, C) partial sums -> full sum on every rank
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp_region(x, group):       # f
    return x if _tp(group)[0] == 1 else CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(y, group):   # g
    return y if _tp(group)[0] == 1 else ReduceFromTPRegion.apply(y.contiguous(), group)


# ---------------------------------------------------------------------------
# Megatron's parallel layers. Y = X A: ColumnParallelLinear splits A by columns (nn.Linear's
# output rows), RowParallelLinear splits it by rows (input columns). Column then Row needs one
# all-reduce forward (g) and one backward (f) per MLP or attention block.
# Parameters are left uninitialised: load_full_ copies in this rank's slice of a full weight.
# ---------------------------------------------------------------------------

def _mark_split(param, dim, stride=1):
    """Megatron's attributes: a split parameter (replicated ones have none), along dim, in stride blocks."""
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, stride


@torch.no_grad()
def load_full_(param, full, tp_group=None):
    """Copy this rank's slice of a full tp=1 tensor into param (a replicated param takes it whole).
    A stride s > 1 means full is s blocks stacked along partition_dim, e.g. [q; k; v]: the rank
    keeps 1/tp of each block, [q_r; k_r; v_r], so it holds whole heads of q, k and v."""
    if getattr(param, "tensor_model_parallel", False):
        tp_size, tp_rank, dim = *_tp(tp_group), param.partition_dim
        blocks = full.chunk(param.partition_stride, dim)                          # (3C, C) -> 3 x (C, C)
        full = torch.cat([blk.chunk(tp_size, dim)[tp_rank] for blk in blocks], dim)  # -> (3C/tp, C)
    param.copy_(full)


class ColumnParallelLinear(nn.Module):
    """Y_r = f(X) A_r + b_r: each rank holds out/tp output features; the output stays split."""

    def __init__(self, in_features, out_features, tp_group=None, bias=True, stride=1, device=None):
        super().__init__()
        self.tp_group, (self.tp_size, _) = tp_group, _tp(tp_group)
        _check_divisible("out_features" if stride == 1 else f"out_features/{stride}", out_features // stride,
                         self.tp_size)
        self.weight = nn.Parameter(torch.empty(out_features // self.tp_size, in_features, device=device))
        _mark_split(self.weight, 0, stride)                    # (out/tp, in)
        self.bias = nn.Parameter(torch.empty(out_features // self.tp_size, device=device)) if bias else None
        if bias:
            _mark_split(self.bias, 0, stride)                  # (out/tp,)

    def forward(self, x):
        x = copy_to_tp_region(x, self.tp_group)                # f: (B, T, in), full on every rank
        return F.linear(x, self.weight, self.bias)             # (B, T, in) -> (B, T, out/tp)


class RowParallelLinear(nn.Module):
    """Y = g(X_r A_r) + b: the input arrives split (in/tp features); the output is all-reduced."""

    def __init__(self, in_features, out_features, tp_group=None, bias=True, device=None):
        super().__init__()
        self.tp_group, (self.tp_size, _) = tp_group, _tp(tp_group)
        _check_divisible("in_features", in_features, self.tp_size)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp_size, device=device))
        _mark_split(self.weight, 1)                            # (out, in/tp)
        # the bias is replicated and added once, after the sum (adding it on every rank would add it tp times)
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x):
        y = F.linear(x, self.weight)                           # (B, T, in/tp) -> (B, T, out), a partial sum
        y = reduce_from_tp_region(y, self.tp_group)            # g: all-reduce over tp
        return y if self.bias is None else y + self.bias      # same code at tp=1: matmul, then + bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds vocab rows [r V/tp, (r+1) V/tp); other tokens embed to zero, then g sums."""

    def __init__(self, num_embeddings, embedding_dim, tp_group=None, device=None):
        super().__init__()
        self.tp_group, (self.tp_size, tp_rank) = tp_group, _tp(tp_group)
        if num_embeddings % self.tp_size:
            m = 64 * self.tp_size
            raise ValueError(f"vocab_size={num_embeddings} is not divisible by tp={self.tp_size}: pad the "
                             f"vocabulary, e.g. vocab_size={-(-num_embeddings // m) * m} (a multiple of 64*tp)")
        self.vocab_per_rank = num_embeddings // self.tp_size
        self.vocab_start = tp_rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, embedding_dim, device=device))
        _mark_split(self.weight, 0)                            # (V/tp, C)

    def forward(self, idx):
        if self.tp_size == 1:
            return F.embedding(idx, self.weight)               # (B, T) -> (B, T, C)
        torch._assert_async(((idx >= 0) & (idx < self.vocab_per_rank * self.tp_size)).all(),
                            "token id outside [0, vocab_size)")  # F.embedding raises at tp=1; here it would embed to 0
        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.vocab_per_rank)
        local_idx = (idx - self.vocab_start).masked_fill(outside, 0)         # (B, T) in [0, V/tp)
        x = F.embedding(local_idx, self.weight).masked_fill(outside[..., None], 0.0)  # (B, T, C)
        return reduce_from_tp_region(x, self.tp_group)         # g: exactly one rank holds each row


def _all_reduce(t, op, group):
    if _tp(group)[0] > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from logits split over the vocabulary; never gathers (N, V).
    loss_i = log sum_v exp(z_iv - m_i) - (z_it - m_i), m_i = max_v z_iv, with the max, the sum
    of exponentials and the target logit each one all-reduce of a (N,) vector over tp ranks.
    A target outside this rank's slice (or -1, ignored) picks nothing here."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        # logits: (N, V/tp), this rank's vocabulary slice; target: (N,) in [0, V) or -1
        logits_max = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)   # (N,)
        logits = logits - logits_max[:, None]                                           # (N, V/tp)
        outside = (target < vocab_start) | (target >= vocab_start + logits.size(-1))
        local_target = (target - vocab_start).masked_fill(outside, 0)                   # (N,)
        target_logit = logits.gather(1, local_target[:, None]).squeeze(1).masked_fill(outside, 0.0)
        target_logit = _all_reduce(target_logit, dist.ReduceOp.SUM, group)              # (N,)
        exp_logits = logits.exp()                                                       # (N, V/tp)
        sum_exp = _all_reduce(exp_logits.sum(dim=-1), dist.ReduceOp.SUM, group)         # (N,)
        softmax = exp_logits.div_(sum_exp[:, None])                                     # (N, V/tp)
        ctx.save_for_backward(softmax, local_target, outside)
        return sum_exp.log() - target_logit                                             # (N,)

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss_i / d z_iv = softmax_iv - [v == t_i], on this rank's slice only: no collective
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()                                                          # (N, V/tp)
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        return grad * grad_loss[:, None], None, None, None


def vocab_parallel_cross_entropy(logits, target, vocab_start, group):
    """Mean cross entropy over the targets that are not -1 (like F.cross_entropy(ignore_index=-1))."""
    V = logits.size(-1) * _tp(group)[0]   # F.cross_entropy raises on these at tp=1; here no rank would pick them
    torch._assert_async(((target >= -1) & (target < V)).all(), "target outside [0, vocab_size) and not -1")
    loss = VocabParallelCrossEntropy.apply(logits, target, vocab_start, group)          # (N,)
    keep = target != -1                                 # torch.where, not loss * keep: an ignored row's
    return torch.where(keep, loss, 0.0).sum() / keep.sum()  # gradient is 0 even when no row is kept (0/0)


# ---------------------------------------------------------------------------
# The transformer: pre-LN blocks, x + attn(ln_1(x)), then x + mlp(ln_2(x)) (GPT-2)
# ---------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    """QKV column-parallel by whole heads (n_head/tp heads per rank), out projection row-parallel."""

    def __init__(self, config, tp_group, device):
        super().__init__()
        self.n_local_head = config.n_head // _tp(tp_group)[0]
        self.c_attn = ColumnParallelLinear(config.n_embd, 3 * config.n_embd, tp_group, config.bias,
                                           stride=3, device=device)   # local rows [q_r; k_r; v_r]
        self.c_proj = RowParallelLinear(config.n_embd, config.n_embd, tp_group, config.bias, device=device)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)              # (B, T, 3C/tp) -> 3 x (B, T, C/tp)
        q, k, v = (t.view(B, T, self.n_local_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh/tp, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh/tp, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)                # (B, T, C/tp): this rank's heads
        return self.c_proj(y)                                  # (B, T, C), summed over tp by g


class MLP(nn.Module):
    def __init__(self, config, tp_group, device):
        super().__init__()
        self.c_fc = ColumnParallelLinear(config.n_embd, 4 * config.n_embd, tp_group, config.bias, device=device)
        self.c_proj = RowParallelLinear(4 * config.n_embd, config.n_embd, tp_group, config.bias, device=device)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))               # (B, T, C) -> (B, T, 4C/tp) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, config, tp_group, device):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias, device=device)   # replicated on tp ranks
        self.attn = CausalSelfAttention(config, tp_group, device)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias, device=device)
        self.mlp = MLP(config, tp_group, device)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config, tp_group=None, seed=0, device=None):
        super().__init__()
        self.config, self.tp_group, self.seed = config, tp_group, seed
        self.tp_size = _tp(tp_group)[0]
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}: "
                             f"choose n_head in {divisors(config.n_embd)}")
        _check_divisible("n_head", config.n_head, self.tp_size)  # then n_embd and 4*n_embd divide by tp too
        C = config.n_embd
        self.wte = VocabParallelEmbedding(config.vocab_size, C, tp_group, device=device)  # (V/tp, C)
        self.wpe = nn.Embedding(config.block_size, C, device=device)                      # replicated
        self.h = nn.ModuleList(Block(config, tp_group, device) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(C, bias=config.bias, device=device)
        # the output layer is wte itself (logits = f(h) @ wte.weight^T, vocab-parallel), a module of its
        # own so that stage 3, which gathers a module's parameters around its forward, sees it used here
        self.lm_head = ColumnParallelLinear(C, config.vocab_size, tp_group, bias=False, device=device)
        self.lm_head.weight = self.wte.weight                                             # (V/tp, C)
        # a parameter's name (a tied weight: its first) by (id of its module, attribute): not by the
        # parameter's id, since to_empty or a wrapper (FSDP2's fully_shard) replaces parameters and a
        # new one can reuse a freed one's id; nor the parameters themselves, which would stay alive
        first, self.names = {}, {}
        for mname, m in self.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                self.names[id(m), pname] = first.setdefault(id(p), f"{mname}.{pname}" if mname else pname)
        for module in self.modules():
            self.init_weights(module)

    @torch.no_grad()
    def init_weights(self, module):
        """GPT-2's init of `module`'s own parameters (not its children's): each drawn full-size (tp=1)
        on the CPU from a generator seeded by the model's seed and the parameter's name, then sliced
        to this rank, so the values are the same at every tp and built whole or one module at a time."""
        proj_std = 0.02 / math.sqrt(2 * self.config.n_layer)  # GPT-2: residual projections scaled down
        for pname, param in module.named_parameters(recurse=False):
            name = self.names[id(module), pname]
            if param.is_meta:  # built on meta: zero.initialize(..., init_fn=model.init_weights) fills it
                continue
            if isinstance(module, nn.LayerNorm) or name.endswith(".bias"):  # torch's LayerNorm init: 1 and 0
                param.fill_(1.0 if isinstance(module, nn.LayerNorm) and name.endswith(".weight") else 0.0)
                continue
            shape = list(param.shape)  # the full tp=1 shape: a split dimension times tp
            if getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= self.tp_size
            gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
            std = proj_std if name.endswith("c_proj.weight") else 0.02
            load_full_(param, torch.empty(shape, device="cpu").normal_(0.0, std, generator=gen), self.tp_group)

    def forward(self, idx, targets=None):
        """idx: (B, T) token ids -> (logits, loss). With targets (B, T) (-1 = ignore): the mean cross
        entropy, and logits (B, T, V/tp), this rank's slice. Without: loss None, and the full
        (B, 1, V) logits of the last position, gathered over tp (for generate)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length T={T} exceeds block_size={self.config.block_size}: "
                             f"crop the input to its last {self.config.block_size} tokens")
        pos = torch.arange(T, device=idx.device)                          # (T,)
        x = self.wte(idx) + self.wpe(pos)                                 # (B, T, C)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)                                                  # (B, T, C)
        if targets is None:
            x = x[:, [-1], :]                                             # (B, 1, C): only the last position
        logits = self.lm_head(x)                                          # f, then (B, T, V/tp)
        if targets is not None:
            flat = logits.view(-1, logits.size(-1)).float()              # (B*T, V/tp); the loss in fp32 even
            if self.tp_size == 1:                                         # when the model computes in 16 bits
                loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-1)
            else:
                loss = vocab_parallel_cross_entropy(flat, targets.reshape(-1), self.wte.vocab_start, self.tp_group)
            return logits, loss
        if self.tp_size > 1:  # all-gather the vocabulary slices: (B, 1, V/tp) x tp -> (B, 1, V); no autograd
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits, None

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None, context=None):
        """Append max_new_tokens to idx (B, T): greedy at temperature=0, else sampled, each from the last
        `context` tokens (default block_size; a model trained on shorter sequences knows no later position).
        At tp > 1 tp rank 0 draws each token and the others take it, whatever their random state."""
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} must be at least 1, or None to sample from every token")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -(context or self.config.block_size):])  # (B, 1, V)
            logits = logits[:, -1, :]                                       # (B, V)
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)              # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))  # (B, k)
                    logits[logits < v[:, [-1]]] = -float("inf")
                probs = F.softmax(logits, dim=-1)
                # drawn where the generator lives (a CPU generator: the same tokens on CPU and GPU)
                where = generator.device if generator is not None else probs.device
                idx_next = torch.multinomial(probs.to(where), num_samples=1, generator=generator).to(idx.device)  # (B, 1)
                if self.tp_size > 1:  # every tp rank must feed back the same token: tp rank 0's draw
                    dist.broadcast(idx_next, group_src=0, group=self.tp_group)  # (B, 1) to every tp rank
            idx = torch.cat((idx, idx_next), dim=1)                         # (B, T+1)
        return idx
