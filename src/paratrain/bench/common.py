"""What every `paratrain bench X` shares: start its worker module on N processes with the options
the user gave, through the same elastic launch as training."""

from __future__ import annotations

import argparse

from paratrain.errors import error
from paratrain.runtime.machine import machine


def at_least(low, kind=int):
    """An argparse type: a number of `kind` no smaller than `low` (a bad one exits 2 naming the option)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def positive(text: str) -> float:
    """An argparse type: a number above 0."""
    value = at_least(0.0, float)(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    value = positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def one_or_more_of(allowed):
    """An argparse type: a comma-separated list of `allowed` names, or of values that `allowed`
    parses when it is itself a type such as COUNT; returned as given, once checked."""

    def parse(text: str) -> str:
        items = text.split(",")
        for item in items:
            if callable(allowed):
                allowed(item)
            elif item not in allowed:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(allowed)}")
        return text

    parse.__name__ = "list"
    return parse


COUNT, NONNEG, POSITIVE = at_least(1), at_least(0), positive


def register(which, name: str, help: str, add_options, run, procs: tuple[str, int] = ("--nproc", 2)):
    """Add `paratrain bench NAME`: its own options, how many processes it starts, what runs it."""
    p = which.add_parser(name, help=help)
    add_options(p)
    flag, default = procs
    p.add_argument(flag, type=COUNT, default=default)
    p.set_defaults(func=run)
    return p


def add_round_options(p, steps: int, rounds: int, warmup: int | None, steps_help: str) -> None:
    """The timing every interleaved bench takes: K steps per round per contender, R rounds, after
    a warm-up."""
    p.add_argument("--steps", type=COUNT, default=steps, help=steps_help)
    p.add_argument("--rounds", type=COUNT, default=rounds)
    if warmup is not None:
        p.add_argument("--warmup", type=NONNEG, default=warmup)


def relaunch(module: str, args, add_options, nproc: int, run_id: str) -> int:
    """`python -m module` on `nproc` workers, passing on every option `add_options` defines."""
    from paratrain.runtime.launch import launch
    from paratrain.runtime.worker_failure import WorkerFailure

    probe = argparse.ArgumentParser(add_help=False)
    add_options(probe)
    argv = []
    for dest in vars(probe.parse_args([])):
        value, flag = getattr(args, dest, None), "--" + dest.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv.append(f"{flag}={value}")
    try:
        launch(module, argv, nproc=nproc, run_id=run_id)
    except WorkerFailure as exc:
        error(f"benchmark failed: {exc}")
        return 1
    return 0


def machine_line(m: dict) -> str:
    return (
        f"machine: {m['cpu']} ({m['cores']} cores, capability {m['cpu_capability']}, "
        f"{'native' if m['cpu_native_bf16'] else 'no native'} bf16), torch {m['torch']}, "
        f"GPU {m['gpu'] or 'none'}"
    )


def heading_with_machine(run):
    """A bench's `run(args)` that first prints the machine line, so that it heads the bench's table."""

    def run_on_this_machine(args):
        print(machine_line(machine()), flush=True)
        return run(args)

    return run_on_this_machine


def add_json_option(p) -> None:
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="also write the results as JSON (to stdout without PATH)",
    )


def timed_steps(step_fn, n: int) -> list[float]:
    """Seconds of each of `n` calls of `step_fn`, every rank starting each together (a barrier)."""
    import time

    import torch.distributed as dist

    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t0)
    return times


# -- the long-sequence and MoE benchmarks' gpt (bench cp, bench ep) ------------------------------------
GPT_VOCAB = 96  # the corpus's characters: the size of the built-in gpt's usual vocabulary


def bench_gpt(args, **extra):
    """The built-in gpt of `args` (--layers, --heads, --d-model, --seq) from the shared seed."""
    import torch

    from paratrain.models.gpt import gpt

    torch.manual_seed(0)
    return gpt(GPT_VOCAB, n_layer=args.layers, n_head=args.heads, d_model=args.d_model, block_size=args.seq, **extra)


def gpt_dp_engine(model, rt, batch_size: int, lr: float, parallel: dict):
    """paratrain dp over the world on `model` (SGD at `lr`), with the [parallel] keys given."""
    from paratrain import config as config_mod
    from paratrain.optim import cross_entropy
    from paratrain.parallel.dp.engine import DataParallel

    cfg = config_mod.from_dict(
        {"data": {"batch_size": batch_size}, "train": {"optimizer": "sgd", "lr": lr}, "parallel": parallel}
    )
    return DataParallel(model, cross_entropy, cfg, rt)
