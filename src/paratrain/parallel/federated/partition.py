"""The training set dealt to `clients` simulated clients, deterministically from the seed.

    iid        a seeded permutation cut into near-equal parts (sizes differ by at most one);
    dirichlet  per class, proportions over the clients drawn from Dir(alpha), and that class's
               samples (in a seeded order) cut at those proportions: skewed label mixes and sizes.

One draw, never a re-draw loop: a draw that leaves a client with fewer than `min_samples` samples
is refused (ConfigError on federated.alpha, naming the smallest client), so the user picks a larger
alpha, a smaller min_samples, fewer clients or another seed. Cuts are integer positions within a
class, so a class that runs out leaves clients empty of it, never a NaN proportion.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from paratrain.errors import ConfigError

PARTITION_FILE = "partitions.json"


def deal_clients(cfg, dataset) -> tuple[list[np.ndarray], dict]:
    """The run's partition of `dataset` and its report, from the [federated] table and train.seed."""
    fed = cfg.federated
    # Labels of a dataset without tensors cost a pass over every item: only where dirichlet needs them.
    labels = labels_of(dataset) if fed.partition == "dirichlet" or hasattr(dataset, "tensors") else None
    parts = partition(len(dataset), labels, fed.clients, fed.partition, fed.alpha, fed.min_samples, cfg.train.seed)
    return parts, report(parts, labels)


def labels_of(dataset) -> np.ndarray | None:
    """Integer class labels of every sample, or None where targets are not one class each."""
    tensors = getattr(dataset, "tensors", None)
    targets = tensors[1] if tensors is not None else [dataset[i][1] for i in range(len(dataset))]
    labels = np.asarray(targets)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        return None
    return labels.astype(np.int64)


def partition(
    n_samples: int, labels: np.ndarray | None, clients: int, scheme: str, alpha: float, min_samples: int, seed: int
) -> list[np.ndarray]:
    """Sample indices of each client (sorted)."""
    if clients * min_samples > n_samples:
        raise ConfigError(
            "federated.clients",
            f"{clients} clients of at least federated.min_samples = "
            f"{min_samples} need {clients * min_samples} samples; "
            f"the training set has {n_samples}",
        )
    rng = np.random.default_rng([seed, 0xFED])
    if scheme == "iid":
        parts = np.array_split(rng.permutation(n_samples), clients)
    else:
        if labels is None:
            raise ConfigError(
                "federated.partition",
                "dirichlet deals samples by class label, and the "
                "dataset's targets are not one class index each: use iid",
            )
        buckets: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            shares = rng.dirichlet(np.full(clients, alpha))
            cuts = np.round(np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
            for c, piece in enumerate(np.split(members, cuts)):
                buckets[c].append(piece)
        parts = [np.concatenate(b) for b in buckets]
        smallest = min(range(clients), key=lambda c: len(parts[c]))
        if len(parts[smallest]) < min_samples:
            raise ConfigError(
                "federated.alpha",
                f"the Dirichlet({alpha:g}) draw for train.seed {seed} leaves client {smallest} "
                f"with {len(parts[smallest])} samples, fewer than federated.min_samples = "
                f"{min_samples} (not re-drawn): raise alpha, lower min_samples, or use fewer clients",
            )
    return [np.sort(p) for p in parts]


def report(parts: list[np.ndarray], labels: np.ndarray | None) -> dict:
    """Per client: samples and label histogram (JSON-ready)."""
    classes = [int(c) for c in np.unique(labels)] if labels is not None else []
    rows = []
    for c, idx in enumerate(parts):
        row = {"client": c, "samples": int(len(idx))}
        if labels is not None:
            row["labels"] = np.bincount(labels[idx], minlength=max(classes) + 1).tolist()
        rows.append(row)
    sizes = np.array([len(p) for p in parts])
    return {
        "clients": len(parts),
        "classes": classes,
        "min_samples": int(sizes.min()),
        "max_samples": int(sizes.max()),
        "per_client": rows,
    }


def write_report(run_dir: Path, summary: dict) -> Path:
    path = Path(run_dir) / PARTITION_FILE
    path.write_text(json.dumps(summary, indent=1))
    return path


def describe(summary: dict, most: int = 5) -> str:
    """A few lines for the console: sizes, and the first clients' label histograms."""
    lines = [
        f"federated: {summary['clients']} clients, {summary['min_samples']}-{summary['max_samples']} "
        f"samples each (per client samples and label histogram: {PARTITION_FILE})"
    ]
    for row in summary["per_client"][:most]:
        hist = f" labels {row['labels']}" if "labels" in row else ""
        lines.append(f"  client {row['client']}: {row['samples']} samples{hist}")
    if summary["clients"] > most:
        lines.append(f"  ... {summary['clients'] - most} more")
    return "\n".join(lines)


def local_batches(
    indices: np.ndarray, steps: int, batch_size: int, seed: int, round_index: int, client: int
) -> list[np.ndarray]:
    """The client's batches for one round: its samples in a seeded order per (seed, round, client),
    cycled (a client with fewer than steps*batch_size samples sees some twice)."""
    rng = np.random.default_rng([seed, 0xB47C, round_index, client])
    need = steps * batch_size
    order = np.concatenate([rng.permutation(indices) for _ in range(-(-need // len(indices)))])
    return [order[s * batch_size : (s + 1) * batch_size] for s in range(steps)]
