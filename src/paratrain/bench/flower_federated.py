"""The Flower side of `paratrain bench federated`, run by the Python of Flower's own venv (it
imports flwr, never paratrain): FedAvg in Flower's Ray simulation on the task the bench hands over
in an .npz (no pickles): the digits split, each client's sample indices, the initial weights.

    python flower_federated.py TASK.npz ROUNDS PER_ROUND LOCAL_STEPS BATCH LR OUT.json
"""

import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def mlp(shapes) -> nn.Module:
    """Linear layers with ReLUs between them, shaped like the weights handed over."""
    layers = []
    for out_f, in_f in shapes:
        layers += [nn.Linear(in_f, out_f), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def set_weights(model: nn.Module, arrays) -> None:
    with torch.no_grad():
        for p, a in zip(model.parameters(), arrays):
            p.copy_(torch.from_numpy(np.asarray(a)))


def main(task_path, rounds, per_round, local_steps, batch, lr, out_path) -> None:
    import flwr as fl

    task = np.load(task_path, allow_pickle=False)
    x, y = torch.from_numpy(task["x_train"]), torch.from_numpy(task["y_train"])
    xv, yv = torch.from_numpy(task["x_val"]), torch.from_numpy(task["y_val"])
    clients = int(task["clients"])
    parts = [task[f"part_{c}"] for c in range(clients)]
    init = [task[f"w{i}"] for i in range(int(task["tensors"]))]
    shapes = [w.shape for w in init if w.ndim == 2]
    rounds, per_round, local_steps, batch, lr = int(rounds), int(per_round), int(local_steps), int(batch), float(lr)

    class Client(fl.client.NumPyClient):
        def __init__(self, cid: int):
            self.idx = torch.from_numpy(parts[cid])
            self.model = mlp(shapes)

        def fit(self, parameters, config):
            set_weights(self.model, parameters)
            opt = torch.optim.SGD(self.model.parameters(), lr=lr)
            loader: torch.utils.data.DataLoader = torch.utils.data.DataLoader(
                self.idx,  # type: ignore[arg-type]  # a tensor is a map-style dataset; torch's stub wants Dataset
                batch_size=batch,
                shuffle=True,
            )
            steps = 0
            while steps < local_steps:  # local_steps batches, epochs over the client's data as needed
                for idx in loader:
                    opt.zero_grad()
                    F.cross_entropy(self.model(x[idx]), y[idx]).backward()
                    opt.step()
                    steps += 1
                    if steps == local_steps:
                        break
            return [p.detach().numpy() for p in self.model.parameters()], len(self.idx), {}

    def client_fn(context):
        return Client(int(context.node_config["partition-id"])).to_client()

    accuracy, ends = [], []
    model = mlp(shapes)

    def evaluate(server_round, parameters, config):
        set_weights(model, parameters)
        with torch.no_grad():
            out = model(xv)
        ends.append(time.perf_counter())
        acc = float((out.argmax(1) == yv).float().mean())
        accuracy.append(acc)
        return float(F.cross_entropy(out, yv)), {"accuracy": acc}

    strategy = fl.server.strategy.FedAvg(
        fraction_fit=per_round / clients,
        fraction_evaluate=0.0,
        min_fit_clients=per_round,
        min_evaluate_clients=0,
        min_available_clients=clients,
        evaluate_fn=evaluate,
        initial_parameters=fl.common.ndarrays_to_parameters(init),
    )
    t0 = time.perf_counter()
    fl.simulation.start_simulation(
        client_fn=client_fn,
        num_clients=clients,
        config=fl.server.ServerConfig(num_rounds=rounds),
        strategy=strategy,
        client_resources={"num_cpus": 1, "num_gpus": 0.0},
    )
    wall = time.perf_counter() - t0
    # evaluate() runs once before round 1 (on the initial weights), then after each round
    with open(out_path, "w") as fh:
        json.dump(
            {
                "wall_s": wall,
                "accuracy": accuracy[1:],
                "elapsed": [t - ends[0] for t in ends[1:]],
                "flwr": fl.__version__,
            },
            fh,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
