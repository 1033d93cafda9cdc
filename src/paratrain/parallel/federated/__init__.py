"""Federated learning: many simulated clients with private, non-IID data; only updates leave a
client; optional secure aggregation. The strategy is `engine.Federated`; `spec` checks the
[federated] table without importing torch (before any worker starts).

    partition.py  the training set dealt to clients (iid | dirichlet), reported per client
    client.py     one client's local training (fedavg | fedprox)
    server.py     client sampling, aggregation weighted by samples, the server optimizer (fedadam)
    secagg.py     pairwise masks over integers mod 2^32, dropouts recovered from Shamir shares
    spec.py       the [federated] table's checks, torch-free
    rounds.py     a round as point-to-point messages, the server's and a worker's side
    engine.py     the rounds over ranks: rank 0 serves, the others simulate clients in turn
"""
