"""The link model's parser and arithmetic (minidist/comm/links.py), Spearman's rank
correlation and the layouts of minidist/lessons/plan_measure.py, and a malformed MINIDIST_LINKS
ending a job with one message and exit 2 on every rank."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import mpirun_cmd, needs_mpirun
from minidist.comm import links
from minidist.lessons import plan_measure as measure

ROOT = Path(__file__).resolve().parents[1]


def test_parse_reads_every_item():
    lk = links.parse("nodes=2x4, intra=1e-6:4e11, inter=2e-6:5e10, scale=10, wait=spin", 8)
    assert (lk.nodes, lk.per_node, lk.scale, lk.wait) == (2, 4, 10.0, "spin")
    assert lk.links == {"intra": (1e-6, 4e11), "inter": (2e-6, 5e10)}
    assert [lk.node(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert lk.link(3, 2) == "intra" and lk.link(3, 4) == "inter"
    assert lk.delay(0, 5, 1000) == pytest.approx(2e-6 + 1000 * 10 / 5e10)
    assert lk.delay(1, 2, 1000) == pytest.approx(1e-6 + 1000 * 10 / 4e11)
    again = links.parse(lk.spec(), 8)
    assert (again.links, again.scale, again.wait) == (lk.links, lk.scale, lk.wait)


def test_parse_defaults():
    lk = links.parse("nodes=1x3,intra=0:1e9")
    assert lk.links["inter"] == lk.links["intra"] == (0.0, 1e9)
    assert (lk.scale, lk.wait) == (1.0, "sleep")


@pytest.mark.parametrize("text, says", [
    ("", "nodes= is missing"),
    ("nodes=2x4", "intra= is missing"),
    ("nodes=2x4,intra=0:1e9,speed=3", "unknown item"),
    ("nodes=2x4,intra=0:1e9,intra=0:1e9", "given twice"),
    ("nodes=2by4,intra=0:1e9", "NODESxRANKS_PER_NODE"),
    ("nodes=0x4,intra=0:1e9", "NODESxRANKS_PER_NODE"),
    ("nodes=2x4,intra=1e9", "ALPHA:BANDWIDTH"),
    ("nodes=2x4,intra=0:fast", "must be a number"),
    ("nodes=2x4,intra=0:0", "bandwidth > 0"),
    ("nodes=2x4,intra=-1:1e9", "alpha >= 0"),
    ("nodes=2x4,intra=0:inf", "finite"),
    ("nodes=2x4,intra=0:1e9,scale=0", "scale must be more than 0"),
    ("nodes=2x4,intra=0:1e9,wait=nap", "sleep or spin"),
    ("nodes=2x3,intra=0:1e9", "places 6 ranks, but the world has 8"),
])
def test_parse_refuses_with_a_clear_line(text, says):
    with pytest.raises(links.LinkError, match=says.replace("(", r"\(")):
        links.parse(text, 8)


def test_unset_variable_changes_nothing(monkeypatch):
    from mpi4py import MPI
    monkeypatch.delenv(links.ENV, raising=False)
    assert links.from_environment() is MPI.COMM_WORLD


def test_spearman_by_hand():
    assert measure.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert measure.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take their mean rank: x ranks 1, 2.5, 2.5, 4 against y ranks 1, 3, 2, 4
    assert measure.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / 22.5 ** 0.5)
    assert measure.spearman([5, 1, 3], [0.5, 0.1, 0.3]) == pytest.approx(1.0)   # ranks, not values
    assert measure.spearman([1, 1, 1], [1, 2, 3]) is None


def test_factorisations_and_placement():
    got = measure.factorisations(8)
    assert len(got) == len(set(got)) == 10 and all(t * p * d == 8 for t, p, d in got)
    # Megatron's order (tp, dp, pp): the two stages of pp=2 x dp=4 sit on one node each
    assert measure.megatron_placement(1, 2, 4, 4) == [0, 1, 0, 1, 0, 1, 0, 1]
    assert measure.megatron_placement(2, 1, 4, 4) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert measure.megatron_placement(1, 1, 8, 4) == [0] * 4 + [1] * 4


def test_table_fits_100_columns():
    rows = [{"tp": t, "pp": p, "dp": d, "micro_batches": 4, "measured_step_s": 123.4 * t,
             "predicted_step_s": 99.9 * p, "predicted": dict.fromkeys(
                 ("compute_s", "tp_s", "pp_s", "dp_s", "bubble_s", "optimizer_s"), 12345.6),
             "bytes_match": (t, p) != (2, 2)}
            for t, p, d in measure.factorisations(8)]
    result = {"measured": rows, "spearman": 0.5, "best_measured": "1x1x8",
              "best_predicted_two": ["1x2x4", "2x2x2"]}
    lines = measure.table(result)
    assert len(lines) == len(rows) + 6 and max(map(len, lines)) <= 100, max(lines, key=len)
    assert "DIFFERENT on 2x2x2" in lines[-3] and sum("DIFF" in line for line in lines[2:-4]) == 1


@needs_mpirun
def test_malformed_variable_exits_2_with_one_line():
    env = dict(os.environ, OMP_NUM_THREADS="1", MINIDIST_LINKS="nodes=2x4,intra=0:1e9")
    proc = subprocess.run([*mpirun_cmd(2), sys.executable, "-m", "minidist.lessons.01_collectives"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "MINIDIST_LINKS" in line]
    assert len(errors) == 1 and "places 8 ranks, but the world has 2" in errors[0], proc.stderr


def test_cpu_cluster_carries_the_link_model_into_the_planner():
    from minidist.plan.cost import ACT_BYTES
    lk = links.Links(2, 4, (1e-6, 4e11), (2e-6, 5e10), scale=1000.0)
    c = measure.cpu_cluster(2e10, 5e9, lk, alpha=3e-4, itemsize=4, size=8, efficiency=0.25)
    k = ACT_BYTES / 4               # the planner counts 2-byte values, the run sends 4-byte ones
    assert (c.gpus, c.gpus_per_node) == (8, 4)
    assert c.intra_bw == pytest.approx(4e11 / 1000 * k)
    assert c.inter_bw == pytest.approx(5e10 / 1000 * k)
    assert c.intra_alpha == pytest.approx(1e-6 + 3e-4)
    assert c.inter_alpha == pytest.approx(2e-6 + 3e-4)
    assert (c.gpu.peak_flops, c.gpu.matmul_efficiency) == (2e10, 0.25)
    steps = {t: measure.predict(c, t, 1, 8 // t, 2).step_time_s for t in (1, 2, 8)}
    tp = {t: measure.predict(c, t, 1, 8 // t, 2).tp_s for t in (1, 2, 8)}
    assert all(v > 0 for v in steps.values()) and tp[1] == 0 < tp[2] < tp[8], tp
