"""Every failure path of a run, one module each. Which failure goes where:

    a worker that may crash without ending the job    guard.py      an expendable rank (an async
      (async ps, federated clients); NaN and hang                   parameter-server worker) runs
      reports on the way out                                        under a guard that outlives it
    SIGTERM: a scheduler preempting the job           stop.py       every rank stops at one agreed
                                                                    step, after a checkpoint there
    a lost rank under fault.on_failure = "continue":
      the launcher's side (start, watch, restart)     supervise.py  each node's supervisor, in place
                                                                    of the elastic agent
      the run's membership (who trains, generations)  leader.py     node 0's supervisor decides
      a worker's side (regroup, rejoin, take state)   survive.py    the survivors finish the step
    a lost rank under on_failure = "restart"          (the elastic agent, runtime/launch.py; the
                                                      newest valid checkpoint, checkpoint/)
    a collective that times out or breaks             comm/collectives.py names the rank and call

Fault injection (making a rank fail on purpose, for tests and benchmarks) is not here: it is
paratrain/testing/faults.py, which reaches the training code through runtime/fault_points.py.
"""
