"""parallel.ep under dp with the experts' weights split: each rank keeps (and steps) only its own
experts, and training still equals one process: gradients averaged over the ranks keeping the same
experts, the clipping norm counting each expert once, checkpoints and final/ the dense model's at
any ep."""

import pytest
import torch
import torch.nn.functional as F
from helpers import final_weights, rel_error, write_config
from reference import train_reference
from test_context_expert import GPT, MOE, STEPS, check_equal, train, train_moe_reference

from paratrain.data import load_batch
from paratrain.data.datasets import corpus
from paratrain.models.gpt import gpt

EP2 = ["parallel.ep=2", *MOE]


def expert_bytes(rt, config: str, overrides: list[str]) -> dict:
    """A gang member's job: build the run's strategy, take one step, and count this rank's bytes of
    expert and dense parameters and of optimizer state."""
    from pathlib import Path
    from tempfile import mkdtemp

    from paratrain import preflight, trainer

    cfg = preflight.load(config, overrides)
    cfg.train.device = rt.device.type
    strategy = trainer.Trainer(cfg, Path(mkdtemp()), rt).strategy
    named = list(strategy.model.named_parameters())
    counts = {"experts": 0, "dense": 0, "optimizer": 0}
    for name, p in named:
        counts["experts" if ".experts." in name else "dense"] += p.numel() * p.element_size()
    x = torch.randint(0, 64, (4, 16))
    strategy.train_step((x, x))
    for state in strategy.optimizer.state.values():
        counts["optimizer"] += sum(
            t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim()
        )  # not adamw's step count
    return counts


def test_each_rank_keeps_its_own_experts_alone(tmp_path, gang):
    """ep 2 at world 2 (adamw): a rank's expert parameters and their optimizer state are half of
    ep 1's; the dense parameters are whole on each."""
    cfg = str(write_config(tmp_path / "gpt.toml", GPT))
    sets = [*MOE, "train.optimizer='adamw'"]
    whole = gang(2).run("test_expert_weights:expert_bytes", config=cfg, overrides=sets)
    split = gang(2).run("test_expert_weights:expert_bytes", config=cfg, overrides=[*sets, "parallel.ep=2"])
    for one, half in zip(whole, split):
        assert half["experts"] * 2 == one["experts"] > 0
        assert half["dense"] == one["dense"]
        assert one["optimizer"] - half["optimizer"] == 2 * half["experts"]  # adamw's two moments


def held_bytes(rt, config: str, overrides: list[str]) -> dict:
    """A gang member's job: build the run's strategy and take one step; this rank's storage bytes
    of parameters, gradients and optimizer state, each storage once (as tests/fake_ranks.py counts
    what `paratrain plan` must predict), and the experts' parameters it keeps."""
    from pathlib import Path
    from tempfile import mkdtemp

    from paratrain import preflight, trainer

    cfg = preflight.load(config, overrides)
    cfg.train.device = rt.device.type
    strategy = trainer.Trainer(cfg, Path(mkdtemp()), rt).strategy
    x = torch.randint(0, 64, (4, 16))
    strategy.train_step((x, x))
    seen: set[int] = set()

    def storage_bytes(tensors) -> int:
        fresh = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
        total = sum(n for ptr, n in fresh.items() if n and ptr not in seen)
        seen.update(fresh)
        return total

    params = [p for g in strategy.optimizer.param_groups for p in g["params"]] + list(strategy.model.parameters())
    shards = [u.shard.grad for u in strategy.units]  # ZeRO's gradient shards
    state = [t for st in strategy.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    return {
        "param_bytes": storage_bytes(params),
        "grad_bytes": storage_bytes([p.grad for p in params] + shards),
        "optimizer_bytes": storage_bytes(state),
        "experts": [n for n, _ in strategy.model.named_parameters() if ".experts." in n],
    }


def planned(config: str, world: int, overrides: list[str]) -> dict:
    """`paratrain plan`'s rank 0 for the run."""
    from paratrain.config import load
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.plan.planner import make_plan

    cfg = load(config, overrides)
    with torch.device("meta"):
        model = build_model(cfg, build_dataset(cfg, "train"))
    return make_plan(cfg, model, world, 1, "cpu")["ranks"][0]


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_holds_and_plans_a_rank_s_experts(tmp_path, gang, strategy):
    """World 4, ep 2 (adamw): each rank keeps 2 of a layer's 4 experts, ZeRO-sharded over the 2
    ranks keeping the same ones; what a rank holds (parameters, gradients, optimizer state) is what
    `paratrain plan` says (whose ep 1 tests/test_plan.py checks). Under zero1 and zero2, whose
    parameters are whole on every rank, a rank holds half the experts' bytes of ep 1 (optimizer
    state: 1/4 of them either way, and zero3's parameters too)."""
    cfg = str(write_config(tmp_path / "gpt.toml", GPT))
    sets = [*MOE, "train.optimizer='adamw'", f"parallel.strategy='{strategy}'"]
    held = gang(4).run("test_expert_weights:held_bytes", config=cfg, overrides=[*sets, "parallel.ep=2"])
    plan, whole = planned(cfg, 4, [*sets, "parallel.ep=2"]), planned(cfg, 4, sets)
    for rank in held:
        assert len(rank["experts"]) == 2 * 2 * 4  # 2 of 4 experts in 2 layers, 4 tensors each: no others
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert rank[key] == plan[key], (key, rank[key], plan[key])
    experts = 4 * sum(p.numel() for n, p in gpt_with_experts().named_parameters() if ".experts." in n)
    drop = {key: whole[key] - plan[key] for key in ("param_bytes", "optimizer_bytes")}
    assert drop["param_bytes"] == pytest.approx(0 if strategy == "zero3" else experts / 2, abs=0.01 * experts)
    assert drop["optimizer_bytes"] == pytest.approx(0, abs=0.01 * experts)


def gpt_with_experts():
    data = corpus("train", block_size=16, max_chars=20000)
    with torch.device("meta"):
        return gpt(data.vocab_size, n_layer=2, n_head=2, d_model=16, block_size=16, n_experts=4, top_k=2)


def own_loop_state_keys(rt, config: str, overrides: list[str]) -> list[str]:
    """A gang member's job: the strategy the Python API builds (own_loop), its model's state keys."""
    from paratrain import preflight
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.optim import build_loss
    from paratrain.parallel.registry import build_for_training

    cfg = preflight.load(config, overrides)
    cfg.train.device = rt.device.type
    model = build_model(cfg, build_dataset(cfg, "train"))
    return list(build_for_training(model, build_loss(cfg), cfg, rt, own_loop=True).model.state_dict())


def test_the_python_api_keeps_every_expert(tmp_path, gang):
    """The user's own loop holds the model and an optimizer over all of its parameters: under dp
    with ep 2 every rank keeps every expert there, so model.state_dict() is the dense model's."""
    cfg = str(write_config(tmp_path / "gpt.toml", GPT))
    dense = gang(2).run("test_expert_weights:own_loop_state_keys", config=cfg, overrides=MOE)
    split = gang(2).run("test_expert_weights:own_loop_state_keys", config=cfg, overrides=EP2)
    assert split == dense and any(".experts.3." in k for k in dense[0])


def test_clipping_with_experts_split_equals_one_process(tmp_path, gang):
    """A clip that binds every step: the global norm counts each expert once (its ep group's
    ranks keep different experts, each of an expert's keepers the same gradient), at world 2 (each
    expert kept by one rank) and world 4 (by two, its gradient averaged over them, two micro-batches
    a step)."""
    train(gang, tmp_path, "clip", 2, *EP2, "train.clip_grad_norm=0.05")
    # world 4: each expert kept by 2 ranks, its gradients averaged over them; in 2 micro-batches
    # (the reducers quiet until the last one's backward)
    train(gang, tmp_path, "clip4", 4, *EP2, "train.clip_grad_norm=0.05", "train.grad_accum=2")
    data = corpus("train", block_size=16, max_chars=20000)
    x, y = load_batch(data, torch.arange(STEPS * 8) % len(data))
    torch.manual_seed(0)
    model = gpt(
        data.vocab_size, n_layer=2, n_head=2, d_model=16, block_size=16, n_experts=4, top_k=2, moe_aux_loss=0.05
    )

    def cross_entropy(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    from paratrain.models.moe import with_auxiliary_losses

    weights = train_reference(
        model, x, y, steps=STEPS, batch_size=8, lr=0.1, clip=0.05, loss_fn=with_auxiliary_losses(cross_entropy, model)
    )
    assert rel_error(final_weights(tmp_path / "clip"), weights) <= 1e-4
    assert rel_error(final_weights(tmp_path / "clip4"), weights) <= 1e-4


@pytest.mark.parametrize("strategy", ["dp", "zero2", "zero3"])
def test_checkpoints_resume_across_ep(tmp_path, gang, strategy):
    """A checkpoint written at ep 2 (each expert by the rank keeping it; under zero2 and zero3 by
    the ranks holding its shards) resumes alone at ep 1, and that run's checkpoint resumes at ep 2:
    every final/ equals one process's, keyed as the model."""
    reference = train_moe_reference(0.05)
    cfg = write_config(tmp_path / "gpt.toml", GPT)
    every = ["checkpoint.every=4", *MOE, f"parallel.strategy='{strategy}'"]
    gang(2).train(cfg, tmp_path / "ep2", [*every, "parallel.ep=2"])
    gang(1).train(cfg, tmp_path / "ep1", every, resume=str(tmp_path / "ep2" / "checkpoints" / "step-4"))
    gang(2).train(
        cfg, tmp_path / "back", [*every, "parallel.ep=2"], resume=str(tmp_path / "ep1" / "checkpoints" / "step-8")
    )
    for name in ("ep2", "ep1", "back"):
        assert final_weights(tmp_path / name).keys() == reference[0].keys()
        check_equal(tmp_path, name, reference)


ADAMW = ["train.optimizer='adamw'", "train.lr=0.01"]


@pytest.mark.parametrize(
    "strategy, world, sets",
    [
        ("zero1", 2, EP2),
        ("zero2", 2, [*EP2, *ADAMW]),
        ("zero3", 2, EP2),
        ("zero1", 4, [*EP2, "train.clip_grad_norm=0.05", "train.grad_accum=2"]),
        ("zero2", 4, ["parallel.cp=2", *EP2]),
        ("zero3", 4, ["parallel.ep=4", *MOE, *ADAMW]),
        ("zero3", 4, [*EP2, "parallel.replicas=2", "train.clip_grad_norm=0.05"]),
    ],
    ids=[
        "zero1-w2",
        "zero2-w2-adamw",
        "zero3-w2",
        "zero1-w4-clip-accum",
        "zero2-w4-cp2",
        "zero3-w4-ep4-adamw",
        "zero3-w4-hsdp-clip",
    ],
)
def test_zero_with_experts_split_equals_one_process(tmp_path, gang, strategy, world, sets):
    """zero1-3 keep each expert on its ep rank's ranks alone (zero/experts.py); the dense
    parameters sharded as ever: training equals one process, sgd and adamw, a binding clip over
    two micro-batches, cp x ep, HSDP (2 replicas of 2 ranks, each expert sharded inside its
    replica and averaged across them) with a binding clip."""
    train(gang, tmp_path, strategy, world, f"parallel.strategy='{strategy}'", *sets)
    adamw = "train.optimizer='adamw'" in sets
    clip = 0.05 if "train.clip_grad_norm=0.05" in sets else 0.0
    weights = train_moe_reference(0.05, "adamw" if adamw else "sgd", 0.01 if adamw else 0.1, clip)[0]
    got = final_weights(tmp_path / strategy)
    assert got.keys() == weights.keys()  # the dense model, keyed as the user's
    # adamw: the key bias's gradient is zero but for rounding noise (helpers.rel_error), which adam's
    # normalised step turns into steps of lr (~1.7 relative, dp alike); the attention ignores it
    keys = [k for k in weights if not (adamw and k.endswith("attn.k.bias"))]
    assert rel_error({k: got[k] for k in keys}, {k: weights[k] for k in keys}) <= 1e-4
