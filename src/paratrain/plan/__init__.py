"""The planner and simulator behind `paratrain plan`: what each rank holds, sends and how long a step
takes, predicted before any worker starts. It asks each strategy's spec (its footprint and step
time) and names none; the primitives those use are in cost/.

    planner.py      the rank plan of a config, the fit against the devices' memory, the rendering
    predict.py      the predicted figures of a plan on a cluster
    search.py       `--search`: the fastest layouts that fit
    traces.py       fake-tensor traces played once per distinct shape within a plan or a search
    calibrate.py    `--calibrate`: this machine's figures, measured"""
