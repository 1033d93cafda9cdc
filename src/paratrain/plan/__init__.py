"""The planner and simulator behind `paratrain plan`: what each rank holds, sends and how long a step
takes, predicted before any worker starts. It asks each strategy's spec (its footprint and step
time) and names none.

    planner.py      the rank plan of a config, the fit against the devices' memory, the rendering
    ranks.py        one rank's plan (RankPlan) and the byte counts every footprint shares
    activations.py  one microbatch through the model in fake tensors: saved activations, peaks, payloads
    op_counts.py    FLOPs and bytes of each op, recorded as it runs
    step_time.py    the pieces every strategy's step time shares: stages, links, collectives, optimizer
    predict.py      the predicted figures of a plan on a cluster
    search.py       `--search`: the fastest layouts that fit
    cluster.py      a cluster's description: devices, links, presets
    calibrate.py    `--calibrate`: this machine's figures, measured
    layer_times.py  each layer's forward and backward, timed on this machine"""
