"""Lesson 09 (mixture of experts, expert parallelism) runs end to end under mpirun at 2, 3
and 4 ranks, matches one process routing the same groups, prints the load table and the
all-to-all bytes equal to their formula, and refuses bad input once on every rank (exit 2,
one message, and on the next line a command that works; no line wider than 100 columns)."""
import json
import os
import subprocess
import sys

import pytest

from minidist.report import REPORT_KEYS

from launcher import mpirun_cmd, needs_mpirun  # MINIDIST_MPIRUN, or the .venv's mpirun

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
LESSON = "minidist.lessons.09_moe"
pytestmark = needs_mpirun


def mpirun(n, flags, timeout=120):
    return subprocess.run([*mpirun_cmd(n), sys.executable, "-m", LESSON, *flags],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.parametrize("n, flags, drops", [
    (4, [], None),                                              # the command: 8 experts, top-2
    (4, ["--top-k", "1", "--capacity-factor", "1.0"], True),    # Switch's top-1 at capacity 1.0: drops
    (3, ["--experts", "6", "--drop-policy", "probs", "--pad-to-capacity"], None),   # odd world, padded
    (2, ["--top-k", "1", "--capacity-factor", "1.0"], True),
    (2, ["--capacity-factor", "none", "--moe-every", "1", "--z-loss", "0.001"], False),   # dropless
], ids=["n4-default", "n4-top1-cf1", "n3-e6-probs-padded", "n2-top1-cf1", "n2-dropless"])
def test_lesson_09_matches_one_process(tmp_path, n, flags, drops):
    out = tmp_path / "report.json"
    proc = mpirun(n, [*flags, "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(REPORT_KEYS) <= set(report) and report["match"] is True, report
    assert report["max_rel_diff"] <= 1e-10
    f = report["figures"]
    assert f["a2a_bytes_measured"] == f["a2a_bytes_formula"] > 0, f
    assert report["comm"]["bytes_sent"] == report["comm"]["expected_bytes"]
    par, n_embd, itemsize = report["parallel"], 64, 8
    assert par["drop_policy"] == ("probs" if "probs" in flags else "position")
    if par["pad_to_capacity"]:      # (N-1)/N x E x capacity x C x bytes, 4 all-to-alls per block and step
        ep, E = par["ep"], par["experts"]
        want = (ep - 1) * E // ep * f["capacity"] * n_embd * itemsize * 4 * len(report["moe_layers"])
        assert f["a2a_bytes_measured"] == f["a2a_bytes_padded_formula"] == want * report["steps"], f
        assert f["a2a_bytes_variable_formula"] < f["a2a_bytes_measured"], f
    else:
        assert f["a2a_bytes_padded_formula"] == -1 and f["a2a_bytes_variable_formula"] == f["a2a_bytes_formula"]
    # the load table: per step and MoE block, every routing choice is processed or dropped
    top_k, tokens = report["parallel"]["top_k"], f["tokens_per_step"]
    assert len(report["tokens_per_expert"]) == report["steps"] == len(report["dropped_tokens"])
    for per_block, dropped in zip(report["tokens_per_expert"], report["dropped_tokens"]):
        assert len(per_block) == len(report["moe_layers"]) == len(dropped)
        for load, d in zip(per_block, dropped):
            assert len(load) == report["parallel"]["experts"]
            assert sum(load) + d == top_k * tokens, (load, d)
    total_dropped = sum(map(sum, report["dropped_tokens"]))
    if drops is True:
        assert total_dropped > 0, "capacity factor 1.0 with top-1 should drop some choices"
    elif drops is False:
        assert total_dropped == 0, "dropless routing dropped choices"
    assert f["params_active_per_token"] < f["params_total"]
    assert f["flops_per_token_moe"] < f["flops_per_token_dense_same_total"]
    assert "expert load" in proc.stdout and "verdict: MATCH" in proc.stdout
    assert "DIFFERS" not in proc.stdout and "  NO" not in proc.stdout


@pytest.mark.parametrize("n, flags, message", [
    (4, ["--experts", "6"], "--experts 6 does not split evenly over the 4 ranks"),
    (2, ["--experts", "2", "--top-k", "3"], "--top-k 3: this MoE routes each token to 1 expert"),
    (4, ["--capacity-factor", "0"], "--capacity-factor 0: must be above 0"),
    (3, ["--capacity-factor", "-1.5"], "--capacity-factor -1.5: must be above 0"),
    (3, ["--ep", "2"], "--ep 2 must divide the 3 ranks: the expert-parallel groups"),
    (2, ["--experts", "1", "--top-k", "2", "--ep", "1"], "--top-k 2 is more than the 1 experts"),
    (2, ["--moe-every", "3"], "--moe-every 3 with 2 layers makes no block an MoE block"),
    (4, ["--batch-size", "10"], "--batch-size 10 does not divide among 4 ranks"),
    (2, ["--pad-to-capacity", "--capacity-factor", "none"], "--pad-to-capacity needs a capacity"),
])
def test_bad_input_is_refused_once_with_exit_2(n, flags, message):
    proc = mpirun(n, flags)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count(message) == 1, proc.stderr
    assert proc.stderr.count("error") == 1 and "this works: mpirun -n" in proc.stderr, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith(("error: ", "  this works: "))]
    assert [line.split(":")[0] for line in said] == ["error", "  this works"], proc.stderr   # one each
    wide = [line for line in said if len(line) > 100]
    assert not wide, "lines wider than 100 columns:\n" + "\n".join(wide)
    assert "Traceback" not in proc.stderr and "Lesson" not in proc.stdout


def test_the_hint_runs():
    """The command the refusal prints fixes every flag at once: it runs and matches."""
    proc = mpirun(4, ["--experts", "2", "--top-k", "3", "--steps", "1"])
    assert proc.returncode == 2, proc.stderr
    said = next(line for line in proc.stderr.splitlines() if "this works: " in line)   # not the launcher's banner
    hint = said.split("this works: ")[1].split()
    assert hint[:6] == ["mpirun", "-n", "4", "python", "-m", LESSON], hint
    fixed = mpirun(int(hint[2]), hint[6:])
    assert fixed.returncode == 0 and "verdict: MATCH" in fixed.stdout, fixed.stdout[-1500:] + fixed.stderr[-1500:]
