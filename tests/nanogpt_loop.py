"""A nanoGPT-shaped own loop, with the habits of nanoGPT's train.py kept as they are: a GPT whose
embedding and head share their weight, AdamW over decay / no-decay param groups, gradient
accumulation, torch's own clip_grad_norm_(model.parameters()), the next batch fetched before the
backward (and before saving), evaluation and `model.state_dict()` checkpoints written by
torch.save, and `model.load_state_dict()` of a plain state dict after setup.

`train(strategy, out, ...)` runs it under paratrain (world 1 under plain python, or as a gang's
member, `paratrain launch` or torchrun worker); `reference(...)` is the same loop in one process of
plain PyTorch, the batches in the documented order. Run as a script:

    nanogpt_loop.py STRATEGY OUT [--steps N] [--ckpt DIR --save-at K] [--eval-on all|main]
"""

import argparse
import math
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 17, 8, 16, 2, 2
# under tp: each block's MLP split (its attention splits q, k, v by hand, as nanoGPT's does)
TP_PLAN = {"transformer.h.*.mlp.0": "colwise", "transformer.h.*.mlp.2": "rowwise"}
BATCH, ACCUM, SAMPLES = 8, 2, 48  # a global batch of 8 per micro-step, 2 micro-steps per step
CLIP = 0.1  # small enough to clip every step: the clipped norm must be the global one
EVAL_EVERY = 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(EMBD), nn.LayerNorm(EMBD)
        # no bias on q, k, v (nanoGPT's bias=False): the key bias's gradient is zero but for rounding
        # (softmax ignores a shift shared by all keys), noise AdamW scales up to differ by summation order
        self.c_attn, self.c_proj = nn.Linear(EMBD, 3 * EMBD, bias=False), nn.Linear(EMBD, EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, EMBD),
                wpe=nn.Embedding(BLOCK, EMBD),
                h=nn.ModuleList([Block() for _ in range(LAYERS)]),
                ln_f=nn.LayerNorm(EMBD),
            )
        )
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def data() -> TensorDataset:
    ids = torch.randint(VOCAB, (SAMPLES, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def initial_state() -> dict:
    """The weights every run starts from, as a plain state dict (what a user loads after setup)."""
    torch.manual_seed(0)
    return GPT().state_dict()


def planned_batches():
    """The global batches in the documented order: epoch e is the permutation seed e draws."""
    x, y = data().tensors
    epoch = 0
    while True:
        perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch)).numpy()
        for b in range(SAMPLES // BATCH):
            ids = perm[np.arange(b * BATCH, (b + 1) * BATCH)]
            yield x[ids], y[ids]
        epoch += 1


def loop(model, optimizer, get_batch, backward, steps, start=0, on_eval=None, evaluate=True, zero_grad_of=None):
    """nanoGPT's loop: evaluation every EVAL_EVERY steps (then `on_eval(step)`: the checkpoint),
    ACCUM micro-steps each fetching the next batch before its backward, torch's clip_grad_norm_,
    the gradients let go by the optimizer's zero_grad (or `zero_grad_of`'s, e.g. the model's)."""
    x, y = get_batch()
    step = start
    while True:
        if step % EVAL_EVERY == 0:
            if evaluate:
                model.eval()
                with torch.no_grad():
                    model(x, y)
                model.train()
            if on_eval is not None:
                on_eval(step)
        if step == steps:
            return
        for _ in range(ACCUM):
            _, loss = model(x, y)
            x, y = get_batch()  # fetched while the forward's work would still be on the GPU
            backward(loss / ACCUM)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert math.isfinite(norm.item()) and norm.item() > CLIP, norm  # clipping is active
        optimizer.step()
        (zero_grad_of or optimizer).zero_grad(set_to_none=True)
        step += 1


def reference(steps: int, save_at: int = -1) -> tuple[dict, dict]:
    """Plain PyTorch in one process: the final state dict, and the one at step `save_at`."""
    model = GPT()
    model.load_state_dict(initial_state())
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    batches = planned_batches()
    saved = {}

    def on_eval(step):
        if step == save_at:
            saved.update({k: v.clone() for k, v in model.state_dict().items()})

    loop(model, optimizer, lambda: next(batches), lambda loss: loss.backward(), steps, on_eval=on_eval)
    return {k: v.clone() for k, v in model.state_dict().items()}, saved


def train(strategy, out, steps=6, ckpt=None, save_at=-1, eval_on="all", zero_grad_of="optimizer", **keys):
    """The loop under paratrain: resume from `ckpt` where it holds a checkpoint, else start from
    initial_state() loaded after setup into a model built from another seed; at step `save_at`,
    pt.save to `ckpt` and torch.save(model.state_dict()) to OUT/step-K.pt; at the end OUT/final.pt.
    `eval_on="main"`: nanoGPT's evaluation on rank 0 alone; `zero_grad_of="model"`: model.zero_grad()
    lets the gradients go instead of the optimizer's zero_grad()."""
    import paratrain

    pt = paratrain.init(strategy=strategy, bucket_mb=0.002, **keys)
    torch.manual_seed(1234)  # not the initial weights: load_state_dict after setup must bring them
    model = GPT()
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    model, optimizer = pt.setup(model, optimizer)
    named = [(n, p.shape) for n, p in model.named_parameters()]  # under tp and zero3 too
    assert named == shapes, (named, shapes)
    loader = pt.setup_dataloader(DataLoader(data(), batch_size=BATCH, shuffle=True, drop_last=True))
    meta = pt.load(ckpt) if ckpt else None
    if meta is None:
        model.load_state_dict(initial_state())
    out = Path(out)
    if pt.is_main:
        out.mkdir(parents=True, exist_ok=True)
    batches = None

    def get_batch():
        nonlocal batches
        try:
            return next(batches)
        except (TypeError, StopIteration):  # no iterator yet, or the epoch ended
            batches = iter(loader)
            return next(batches)

    def save(step, name):
        state = {k: v.clone() for k, v in model.state_dict().items()}  # on every rank; rank 0 writes
        if pt.is_main:
            torch.save({"model": state, "iter_num": step}, out / name)

    def on_eval(step):
        if step == save_at and meta is None:
            pt.save(ckpt, step=step)
            save(step, f"step-{step}.pt")

    start = meta["step"] if meta else 0
    evaluate = eval_on == "all" or pt.is_main
    loop(model, optimizer, get_batch, pt.backward, steps, start, on_eval, evaluate, {"model": model}.get(zero_grad_of))
    save(steps, "final.pt")
    return pt.world_size


def job(rt, **kwargs):
    """The gang's form of `train`."""
    return train(**kwargs)


def load_state_job(rt, strategy, out, bf16=False):
    """model.load_state_dict(initial_state()) right after setup, into a model built from another
    seed; then pt.export (under bf16 its fp32 masters: what was loaded, not its bf16 rounding)."""
    import paratrain

    pt = paratrain.init(strategy=strategy, bucket_mb=0.002, train={"precision": "bf16" if bf16 else "fp32"})
    torch.manual_seed(1234)
    model = GPT()
    model, _ = pt.setup(model, model.configure_optimizers(0.1, 1e-2, (0.9, 0.95)))
    model.load_state_dict(initial_state())
    pt.export(out)


def split_keys(strategy: str) -> dict:
    """The [parallel] keys that split the GPT under `strategy` (none for the data-parallel ones)."""
    return {"tp": 2, "tp_plan": TP_PLAN} if strategy == "tp" else {}


def norms_job(rt, strategy):
    """After one backward (every rank on the same batch: the global mean gradient is its own):
    torch's get_total_norm of p.grad, then pt.clip_grad_norm_'s norm, then torch's again."""
    import paratrain

    pt = paratrain.init(strategy=strategy, bucket_mb=0.002, **split_keys(strategy))
    model = GPT()
    model, _ = pt.setup(model, model.configure_optimizers(0.1, 1e-2, (0.9, 0.95)))
    model.load_state_dict(initial_state())
    x, y = data().tensors
    pt.backward(model(x[:4], y[:4])[1])
    norm = lambda: torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()  # noqa: E731
    return norm(), pt.clip_grad_norm_(CLIP).item(), norm()


def refused_job(rt, strategy, call):
    """The exit code of a call paratrain refuses (its line: the member's output)."""
    import paratrain

    pt = paratrain.init(strategy=strategy, bucket_mb=0.002, timeout_s=2, **split_keys(strategy))
    model = GPT()
    model, optimizer = pt.setup(model, model.configure_optimizers(0.1, 1e-2, (0.9, 0.95)))
    idx = torch.zeros(2, BLOCK, dtype=torch.long)
    try:
        if call == "grad-arithmetic":
            pt.backward(model(idx, idx)[1])
            print(sum(p.grad.abs().sum() for p in model.parameters()))
        elif call == "eval-on-main":
            if pt.is_main:
                with torch.no_grad():
                    model(idx)
            pt.backward(model(idx, idx)[1])
        elif call == "state-dict-on-main":
            if pt.is_main:
                model.state_dict()
            pt.backward(model(idx, idx)[1])
        elif call == "parameter-read":  # its values are sharded (tp: split): no rank holds them whole
            print((model.transformer.h[0].mlp[0] if strategy == "tp" else model.lm_head).weight.sum())
        elif call == "optimizer-state-on-main":  # nanoGPT's checkpoint holds it
            if pt.is_main:
                optimizer.state_dict()
        elif call == "forward-on-main-then-done":  # the others wait for no forward: the check times out
            if pt.is_main:
                model(idx)
    except SystemExit as exc:
        return exc.code
    return 0


def pipeline_job(rt, call, out=None):
    """Under pp = 2 (a Sequential: each rank holds one stage's layers), after two pt.train_steps:
    "state-dict": every rank's model.state_dict() (then pt.export to OUT, for the test to compare);
    "load": model.load_state_dict(initial) after setup, then pt.export to OUT;
    "forward": model(x) on every rank, refused (the exit code)."""
    import paratrain

    pt = paratrain.init(strategy="pp", pp=2, microbatches=2, timeout_s=5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=F.mse_loss)
    if call == "load":
        with torch.no_grad():
            for p in model.parameters():
                if not p.is_meta:
                    p.zero_()
        model.load_state_dict(initial)
        pt.export(out)
        return None
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        pt.train_step((torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)))
    try:
        if call == "forward":
            model(torch.randn(4, 8))
        state = {k: v.clone() for k, v in model.state_dict().items()}
    except SystemExit as exc:
        return exc.code
    pt.export(out)
    return state


HYBRID_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}


def hybrid_model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def hybrid_batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(2)]


def hybrid_job(rt):
    """tp 2 x pp 2: two pt.train_steps; whether named_parameters() kept the unsplit shapes, and the
    state dict (every rank's)."""
    import paratrain

    pt = paratrain.init(strategy="hybrid", tp=2, pp=2, microbatches=2, tp_plan=HYBRID_PLAN)
    model = hybrid_model()
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    model, _ = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=F.mse_loss)
    for batch in hybrid_batches():
        pt.train_step(batch)
    return [(n, p.shape) for n, p in model.named_parameters()] == shapes, model.state_dict()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("strategy")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--eval-on", default="all")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    train(args.strategy, args.out, args.steps, args.ckpt, args.save_at, args.eval_on)


def fused_qkv_job(rt, plan):
    """tp on the GPT with its fused c_attn split colwise by `plan`: each rank's slice holds 24 of
    q, k and v's 48 rows, which the block's `.split(EMBD)` cuts in two. The first forward's exit
    code (its line: the output)."""
    import paratrain

    pt = paratrain.init(strategy="tp", tp=2, tp_plan=plan)
    model = GPT()
    model, optimizer = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, _ = next(iter(pt.setup_dataloader(DataLoader(data(), batch_size=BATCH))))
    try:
        model(x)
    except SystemExit as exc:
        return exc.code
    return "no error"
