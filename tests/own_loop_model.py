"""The own loop of the API tests (`train`: what tests/own_loop_script.py runs under plain python,
`paratrain launch` and torchrun, and the gang's members run in-process), its model, optimizer and
data, and the plain-PyTorch loop it must equal (`reference`)."""

import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

BATCH = 12
VOCAB, BLOCK = 15, 6  # an odd vocabulary: tp=2 splits the gpt's head unevenly
# a tiny Llama at random init (nothing downloaded): its own base_model_tp_plan, a gathered head
LLAMA = dict(
    model_type="llama",
    vocab_size=16,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=BLOCK,
)


def make_model(kind: str) -> nn.Module:
    """mlp: regression on 5 features; gpt (the built-in model's own tp plan) and llama (transformers'):
    next-token prediction on VOCAB ids; lora: the llama wrapped by peft, as a user does (only the
    adapters on q_proj and v_proj train)."""
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(make_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    if kind == "gpt":
        from paratrain.models.gpt import GPT

        return GPT(VOCAB, n_layer=1, n_head=2, d_model=8, block_size=BLOCK)
    if kind == "llama":
        from paratrain.models.hf import hf

        return hf(config=LLAMA)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def loss_of(model: nn.Module, x, y, labels: str = "") -> torch.Tensor:
    """The batch's mean loss; `labels` ("all" or "masked": masked_labels) a transformers model's
    own over its label tokens, as `out = model(**batch); out.loss` computes it."""
    if labels:
        return model(input_ids=x, labels=x if labels == "all" else masked_labels(x)).loss
    out = model(x)
    if x.dtype != torch.long:
        return nn.functional.mse_loss(out, y)
    logits = getattr(out, "logits", out)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def masked_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels with every id divisible by 4 masked (-100): each row, and each rank's share, counts
    its own number of label tokens."""
    return ids.masked_fill(ids % 4 == 0, -100)


def label_tokens(ids: torch.Tensor) -> int:
    """The tokens a causal LM's loss over masked_labels(ids) averages (its labels shift by one)."""
    return int((masked_labels(ids)[:, 1:] != -100).sum())


def build(optimizer: str, groups: bool = True, drop_last: bool = True, model: str = "mlp", trainable_only=False):
    """A small model, its optimizer (in two param groups: no weight decay on biases; over all the
    model's parameters, frozen ones too, unless `trainable_only`), a shuffled loader."""
    torch.manual_seed(0)
    kind, model = model, make_model(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only]
    decay = [p for n, p in named if n.endswith("weight")]
    rest = [p for n, p in named if not n.endswith("weight")]
    groups = (
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        if groups
        else [{"params": decay + rest}]
    )
    opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9) if optimizer == "sgd" else torch.optim.AdamW(groups, lr=0.01)
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":  # (the rest: next-token prediction)
        data = TensorDataset(torch.randn(40, 5, generator=g), torch.randn(40, 3, generator=g))
    else:
        ids = torch.randint(VOCAB, (40, BLOCK + 1), generator=g)
        data = TensorDataset(ids[:, :-1], ids[:, 1:])
    return model, opt, DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=drop_last)


def reference(
    optimizer: str,
    steps: int,
    clip: float = 0.0,
    groups: bool = True,
    drop_last: bool = True,
    bf16: bool = False,
    model: str = "mlp",
    labels: str = "",
    trainable_only: bool = False,
) -> dict:
    """One process, plain PyTorch, the batches in the documented order: epoch e is the
    permutation torch.randperm(N) draws from seed 0 * 1_000_003 + e, cut into batches. `bf16`: the
    forward under bf16 autocast."""
    model, opt, loader = build(optimizer, groups, drop_last, model, trainable_only)
    x_all, y_all = loader.dataset.tensors
    n, step, epoch = len(x_all), 0, 0
    while step < steps:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).numpy()
        for b in range(len(loader)):
            ids = perm[np.arange(b * BATCH, min((b + 1) * BATCH, n))]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_of(model, x_all[ids], y_all[ids], labels)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            step += 1
            if step == steps:
                break
        epoch += 1
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(
    strategy,
    optimizer,
    out,
    steps=6,
    ckpt=None,
    save_at=0,
    die_at=0,
    clip=0.0,
    drop_last=True,
    run_dir=None,
    bf16=False,
    model="mlp",
    labels="",
    backward="pt",
    clip_with="pt",
    trainable_only=False,
    **keys,
):
    """The user's own loop: resume from `ckpt` if it holds a checkpoint, save there at step
    `save_at`, rank 1 dies at step `die_at` on the first attempt; the weights to OUT (pt.export).
    `bf16`: train.precision = "bf16", the forward under bf16 autocast. `labels`: as loss_of's. `backward`: "pt"
    (pt.backward(loss)), "plain" (loss.backward(), as a transformers loop writes it), "grad-on-main"
    (rank 0 inspects torch.autograd.grad(loss, params) first, then loss.backward()) or "weighted"
    (pt.backward(loss, weight=n): the loss a mean over n label tokens); `clip_with`: "pt"
    (pt.clip_grad_norm_) or "torch" (torch.nn.utils.clip_grad_norm_(model.parameters(), c))."""
    if bf16:
        keys["train"] = {"precision": "bf16"}
    pt = paratrain.init(strategy=strategy, bucket_mb=0.0005, run_dir=run_dir, **keys)
    model, opt, loader = build(optimizer, drop_last=drop_last, model=model, trainable_only=trainable_only)
    model, opt = pt.setup(model, opt)
    loader = pt.setup_dataloader(loader)
    meta = pt.load(ckpt) if ckpt else None
    step = meta["step"] if meta else 0
    while step < steps:
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_of(model, x, y, labels)
            if backward == "grad-on-main" and pt.is_main:  # returns gradients: nothing to reduce
                torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            if backward in ("plain", "grad-on-main"):
                loss.backward()
            elif backward == "weighted":
                pt.backward(loss, weight=label_tokens(x))
            else:
                pt.backward(loss)
            if clip and clip_with == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            elif clip:
                pt.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
            step += 1
            pt.log(step, loss=loss)
            if ckpt and step == save_at:
                pt.save(ckpt, step=step)
            if step == die_at and pt.rank == 1 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
                os._exit(9)  # a dead worker, on the first attempt only
            if step == steps:
                break
    pt.export(out, step=step)
    return pt, model


def job(rt, **kwargs):
    """The gang's form of `train` (its members have joined their process group already)."""
    return train(**kwargs)[0].world_size


def lora_job(rt, optimizer, trainable_only, **kwargs):
    """`train` of the peft-wrapped llama (its frozen parameters given no gradient), then what this
    rank holds: its optimizer state's numbers (Adam's moments), and how many of the frozen
    parameters' numbers in units (zero3 shards them too)."""
    pt, model = train(optimizer=optimizer, model="lora", trainable_only=trainable_only, **kwargs)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    state = sum(t.numel() for s in pt.strategy.optimizer.state.values() for t in s.values() if t.dim())
    frozen = getattr(pt.strategy, "frozen_units", [])
    return state, sum(u.shard_numel for u in frozen)


def pipeline_job(rt, out, steps, run_dir):
    """pp through train_step (one param group: pp builds its optimizer from [train]); the exit code
    an own-loop call gets under it (its line: the member's output)."""
    pt = paratrain.init(strategy="pp", pp=2, microbatches=2, run_dir=run_dir)
    model, opt, loader = build("sgd", groups=False)
    model, opt = pt.setup(model, opt, loss=nn.functional.mse_loss)
    loader = pt.setup_dataloader(loader)
    step = 0
    while step < steps:
        for batch in loader:
            pt.train_step(batch)
            step += 1
            if step == steps:
                break
    pt.export(out, step=step)
    try:
        pt.backward(torch.zeros((), requires_grad=True))
    except SystemExit as exc:
        return exc.code
    return "no error"


def tp_setup_job(rt, model="mlp"):
    """tp's pt.setup of a model it refuses (the mlp: no plan of its own and none given; a peft
    model): its exit code (its line: the output)."""
    pt = paratrain.init(strategy="tp", tp=2)
    try:
        pt.setup(*build("sgd", model=model)[:2])
    except SystemExit as exc:
        return exc.code
    return "no error"


def step_job(rt, run_dir):
    """The step the collectives of each own-loop backward are logged with, which a hang's report
    names: the optimizer steps taken, then the step pt.log was given."""
    from paratrain.comm import collectives

    pt = paratrain.init(strategy="zero2", bucket_mb=0.0005, run_dir=run_dir)
    model, opt, loader = build("sgd")
    model, opt = pt.setup(model, opt)
    seen = []
    for x, y in pt.setup_dataloader(loader):
        pt.backward(loss_of(model, x, y))
        seen.append(collectives.LOG.last.describe())
        opt.step()
        opt.zero_grad()
        if len(seen) == 2:
            pt.log(10)
    return seen


def evaluation_job(rt, strategy, **keys):
    """pt.eval_step on the first global batches of the data in order, its output gathered whole
    (outputs=True), then one pt.train_step: every rank's numbers, which one process's must equal."""
    pt = paratrain.init(strategy=strategy, **keys)
    model, opt, loader = build("sgd", groups=False)
    model, opt = pt.setup(model, opt, loss=nn.functional.mse_loss)
    in_order = pt.setup_dataloader(DataLoader(loader.dataset, batch_size=BATCH))
    losses, outputs = [], []
    for batch in in_order:
        loss, output = pt.eval_step(batch, outputs=True)
        losses.append(loss.item())
        outputs.append(pt.gather_for_metrics(output).cpu())
    trained = pt.train_step(next(iter(pt.setup_dataloader(loader))))
    return losses, torch.cat(outputs), trained.item()


def gather_job(rt, strategy, batch_size, run_dir):
    """An evaluation set of 27 with even_batches=False (its last batch short, perhaps of fewer
    samples than ranks): each sample's index as gather_for_metrics returns it, and pt.log's mean of
    each rank's number."""
    pt = paratrain.init(strategy=strategy, run_dir=run_dir)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(27, 5, generator=g), torch.arange(27))
    pt.setup(*build("sgd")[:2], loss=lambda out, ids: out.pow(2).mean())  # the target: each sample's index
    loader = pt.setup_dataloader(DataLoader(data, batch_size=batch_size, shuffle=True), even_batches=False)
    gathered = []
    for batch in loader:
        pt.eval_step(batch)  # a forward on every rank, an empty share's too (zero3 gathers in it)
        gathered += pt.gather_for_metrics(batch[1]).tolist()
    pt.log(1, rank=torch.tensor(float(pt.rank)))
    return gathered


class FusedGateUp(nn.Module):
    """An MLP whose gate and up projections are one Linear, chunked in two (Phi3's gate_up_proj)."""

    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(5, 32), nn.Linear(16, 3)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


def fused_gate_up_job(rt):
    """tp splitting the fused gate_up colwise: shapes fit, values do not. The first backward's exit
    code (its line: the output)."""
    pt = paratrain.init(strategy="tp", tp=2, tp_plan={"0.gate_up": "colwise", "0.down": "rowwise"})
    model = nn.Sequential(FusedGateUp())  # the block checked: the module whose children the plan splits
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = next(iter(pt.setup_dataloader(build("sgd")[2])))
    try:
        pt.backward(loss_of(model, x, y))
    except SystemExit as exc:
        return exc.code
    return "no error"


def tree_job(rt):
    """comm.scalars.broadcast_tree (how pp's eval_step hands the last stage's output to the
    others) of a Hugging Face output from rank 1: its structure, dtypes and values, no pickle."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from paratrain.comm.scalars import broadcast_tree

    sent = CausalLMOutputWithPast(loss=torch.tensor(2.5), logits=torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    got = broadcast_tree(sent if rt.rank == 1 else None, 1, rt.device, "test-tree")
    return type(got).__name__, got.loss.item(), got.logits.dtype == torch.bfloat16, got.logits.tolist()


class Uncut(nn.Module):
    """A model with no pipeline_layers(): pp cannot cut it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x):
        return self.linear(x)


def refused_job(rt, call, ckpt=None):
    """The exit code of what the API refuses (its line: the member's output). "pp-plain-backward":
    a loss.backward() and a step of the user's own under pp; "pp-optimizer": an optimizer pp
    cannot build from [train] (two param groups); "pp-uncut": a model pp cannot cut;
    "dp-loads-zero3": CKPT, a checkpoint zero3 wrote, loaded under dp; "dp-setup-twice";
    "dp-save-extras": extras pt.save cannot write as JSON."""
    try:
        if call.startswith("dp-"):
            pt = paratrain.init(strategy="dp")
            pt.setup(*build("adamw")[:2])
            if call == "dp-loads-zero3":
                pt.load(ckpt)
            elif call == "dp-setup-twice":
                pt.setup(*build("adamw")[:2])
            else:
                pt.save(ckpt, step=1, model=nn.Linear(1, 1))
            return 0
        pt = paratrain.init(strategy="pp", pp=2, microbatches=2)
        if call == "pp-uncut":
            pt.setup(Uncut(), loss=nn.functional.mse_loss)
            return 0
        model, opt, _ = build("sgd", groups=call == "pp-optimizer")
        model, opt = pt.setup(model, opt, loss=nn.functional.mse_loss)
        if call == "pp-plain-backward":
            sum(p.sum() for p in model.parameters() if not p.is_meta).backward()
            opt.step()
    except SystemExit as exc:
        return exc.code
    return 0
