"""The parallel strategies: one folder per family, each holding its spec (torch-free), its engine,
its communication and what it costs (footprint: memory and messages; step_time: seconds).

    dp/         data parallelism: bucketed all-reduce overlapped with backward
    zero/       ZeRO 1-3: optimizer state, gradients and parameters sharded over the replica
    tensor/     Megatron-style layers split inside, over a tp group
    pipeline/   a model cut into stages, run by a schedule of microbatches
    hybrid/     the (pp, dp, cp, tp) grid composing tensor, pipeline and context parallelism: tp, pp, hybrid
    ps/         parameter servers: sync, async and bounded staleness
    federated/  simulated clients, FedAvg / FedProx / FedAdam, secure aggregation
    codecs/     gradient compression (bf16, fp16, top-k, PowerSGD)

`registry.py` is the one list of strategies; `spec.py` what a spec declares; `base.py` the contract
every engine keeps. Nothing outside this package asks a strategy's name: it asks its spec."""
