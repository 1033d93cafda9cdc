"""The primitives every cost model uses: each strategy's footprint and step time
(parallel/*/footprint.py, step_time.py) and the planner (plan/) build on them. Imports no
strategy: what tensor parallelism changes in a model comes in from its caller (TensorSharding).

    ranks.py        one rank's plan (RankPlan) and the byte counts every footprint shares
    activations.py  one microbatch through the model in fake tensors: saved activations, peaks, payloads
    op_counts.py    FLOPs and bytes of each op, recorded as it runs
    step_time.py    the pieces every strategy's step time shares: stages, links, collectives, optimizer
    cluster.py      a cluster's description: devices, links, presets
    layer_times.py  each layer's forward and backward, timed on this machine"""
