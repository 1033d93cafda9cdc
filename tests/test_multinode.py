"""A real two-node run: two network namespaces joined by a veth pair, c10d rendezvous across it."""
import subprocess
import sys

import pytest

from helpers import CPU_ONLY, check_ok, final_weights, max_rel_error, run_cli, write_config
from reference import DIGITS_MLP

from paratrain import netns

CFG = DIGITS_MLP.replace("steps = 20", "steps = 12").replace("log_every = 10", "log_every = 4")

ok, why = netns.available()


@pytest.mark.skipif(not ok, reason=f"two-host test skipped: {why}")
def test_two_nodes_over_veth_equal_one_node(tmp_path):
    cfg = write_config(tmp_path / "c.toml", CFG)
    check_ok(run_cli("run", str(cfg), "--nproc", "2", "--run-dir", str(tmp_path / "single")))
    with netns.TwoHosts(rate="1gbit") as hosts:
        endpoint = f"{hosts.addr(0)}:29517"
        procs = []
        for node in (0, 1):
            argv = [sys.executable, "-m", "paratrain.cli", "run", str(cfg), "--nnodes", "2", "--nproc", "1",
                    "--node-rank", str(node), "--rdzv", endpoint, "--run-dir", str(tmp_path / "multi")]
            procs.append(hosts.popen(node, argv, env={**hosts.env(node), **CPU_ONLY, "PYTHONUNBUFFERED": "1"},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        try:
            outs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out
    assert "done: 12 steps" in outs[0]
    assert max_rel_error(final_weights(tmp_path / "multi"), final_weights(tmp_path / "single")) <= 1e-4
    # this test's own namespaces: other test processes may be probing for namespaces of theirs
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(hosts.names) & set(left), "namespaces were not torn down"
