"""The planner's search and command line (minidist/plan/search.py, __main__.py, layout.py):
every flag given is held and the others searched, --only for one layout; pipelines whose
layers do not split evenly (the end stages lighter, Llama 3's 126 layers on 16 stages) in
legal(), memory and compute; the batch in tokens and the bubble-bound warning; --params
below a million refused; `python -m minidist.plan` with mpi4py unimportable; Llama 3's
shape on 16,384 H100s searched at least as well as a person holding pp 16."""
import json
import os
import subprocess
import sys

import pytest

from minidist.plan.__main__ import BUBBLE_BOUND, main
from minidist.plan.cluster import make_cluster
from minidist.plan.cost import estimate
from minidist.plan.layout import Layout, Model, layout_stages, legal, stage_layers
from minidist.plan.memory import layer_activation_bytes
from minidist.plan.pipeline import live_chunks
from minidist.plan.search import layouts, stage_splits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B70 = ["--params", "70e9", "--gpus", "1024", "--gpu", "h100-sxm"]
LLAMA_SHAPE = ["--layers", "126", "--hidden", "16384", "--heads", "128", "--kv-heads", "8",
               "--ffn-hidden", "53248", "--swiglu", "--seq", "8192"]
ACCEPT = (["--params", "405e9", "--gpus", "16384", "--gpu", "h100-sxm"] + LLAMA_SHAPE
          + ["--global-batch", "2048", "--json"])
LLAMA = Model(126, 16384, 128, 51200, 8192, 2048, 53248, 8, True)


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def fail(capsys, argv):
    with pytest.raises(SystemExit) as err:
        main(argv)
    out = capsys.readouterr()
    assert err.value.code == 2 and out.err.count("\n") == 1, out.err
    return out.err


# ---------------------------------------------------------------------- 1. held and searched

def test_tp_and_pp_given_hold_them_and_search_the_rest(capsys):
    """`--tp 8 --pp 8` used to print one layout at ZeRO 0, no SP, no recomputation; now
    those are searched, and the best under tp 8, pp 8 come first."""
    doc, _ = run_json(capsys, B70 + ["--tp", "8", "--pp", "8", "--top", "1000"])
    lays = doc["layouts"]
    assert len(lays) > 1 and doc["searched"] == len(lays) and doc["held"] == {"tp": 8, "pp": 8}
    assert all((x["tp"], x["pp"], x["dp"]) == (8, 8, 16) for x in lays)
    assert {x["zero"] for x in lays} == {0, 1, 2, 3} and {x["sequence_parallel"] for x in lays} == {False, True}
    assert {x["recompute"] for x in lays} == {"none", "selective", "full"}
    assert {x["micro_batch"] for x in lays} > {1}             # (11 layers a stage: one chunk only)
    steps = [x["step_time_s"] for x in lays if x["fits"]]
    assert steps == sorted(steps) and lays[0]["fits"]
    plain = [x for x in lays if (x["zero"], x["sequence_parallel"], x["recompute"], x["chunks"],
                                 x["micro_batch"]) == (0, False, "none", 1, 1)]
    assert len(plain) == 1 and not plain[0]["fits"]           # the old answer: 70B does not fit so
    one, _ = run_json(capsys, B70 + ["--tp", "8", "--pp", "8", "--only"])
    assert len(one["layouts"]) == 1 and one["only"]
    assert {k: one["layouts"][0][k] for k in plain[0]} == plain[0]   # --only: the plain defaults


@pytest.mark.parametrize("flags, key, value", [
    (["--zero", "1"], "zero", 1), (["--micro-batch", "2"], "micro_batch", 2),
    (["--chunks", "2"], "chunks", 2), (["--sequence-parallel"], "sequence_parallel", True),
    (["--no-sequence-parallel"], "sequence_parallel", False), (["--recompute", "full"], "recompute", "full"),
    (["--cp", "2"], "cp", 2), (["--tp", "4"], "tp", 4), (["--pp", "4"], "pp", 4),
])
def test_each_flag_given_is_held(capsys, flags, key, value):
    doc, _ = run_json(capsys, B70 + flags + ["--top", "50"])
    assert doc["layouts"] and all(x[key] == value for x in doc["layouts"])
    assert doc["held"][key] == value
    varied = {"zero", "recompute", "sequence_parallel"} - {key}
    assert any(len({x[k] for x in doc["layouts"]}) > 1 for k in varied), "nothing else searched"


def test_only_needs_tp_and_pp_and_help_documents_it(capsys):
    assert "needs --tp and --pp" in fail(capsys, B70 + ["--tp", "8", "--only"])
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--only" in text and "exactly one layout" in text and "held" in text
    assert "Bubble-bound" in text and "--global-batch-tokens" in text


def test_text_names_what_is_held_within_100_columns(capsys):
    assert main(B70 + ["--tp", "8", "--pp", "8", "--zero", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("holding tp 8, pp 8, zero 1" in line for line in lines)
    assert max(map(len, lines)) <= 100


# ---------------------------------------------------------------------- 2. uneven stages

def test_stage_layers_first_and_last_given():
    assert stage_layers(126, 16, 7, 7) == stage_layers(126, 16) == [7] + [8] * 14 + [7]
    assert stage_layers(126, 16, 6, 8) == [6] + [8] * 15
    assert stage_layers(126, 16, 6) == [6] + [8] * 15 and stage_layers(126, 16, None, 6) == [8] * 15 + [6]
    assert stage_layers(10, 2, 4) == [4, 6] and stage_layers(10, 2, 4, 6) == [4, 6]
    assert stage_layers(10, 2, 4, 5) is None and stage_layers(10, 3, 5, 5) is None
    assert stage_layers(10, 1, 10) == [10] and stage_layers(10, 1, 9) is None
    assert stage_layers(126, 16, 5) is None and stage_layers(126, 16, 0) is None


def test_stage_splits_are_what_a_person_tries():
    assert stage_splits(126, 16) == [(None, None), (6, 8), (8, 6)]      # 7-8-7 first
    assert stage_splits(88, 8) == [(None, None)]                          # even: nothing else
    assert stage_splits(88, 16) == [(2, 2)] and stage_splits(88, 32) == []
    assert stage_splits(126, 16, 6) == [(6, None)] and stage_splits(126, 16, 5) == []
    for L, p in ((126, 16), (126, 4), (126, 2), (126, 3), (88, 16), (80, 3)):
        for split in stage_splits(L, p):
            layers = stage_layers(L, p, *split)
            assert sum(layers) == L and len(layers) == p and min(layers) >= 1
            assert max(layers[0], layers[-1]) <= max(layers[1:-1] or layers)   # ends never heavier


def test_legal_for_uneven_stages():
    c = make_cluster("h100-sxm", 16384)
    ok = Layout(8, 16, 128, 1, 4, 1, True, first_stage_layers=6, last_stage_layers=8)
    assert legal(LLAMA, c, ok) is None
    bad = Layout(8, 16, 128, 1, first_stage_layers=5)
    assert "do not split over pp 16 with first stage 5" in legal(LLAMA, c, bad)
    # chunks: dividing the fullest stage, every stage within one chunk of it
    lay = Layout(8, 16, 128, 1, 8, first_stage_layers=6, last_stage_layers=8)
    assert "chunks" in legal(LLAMA, c, lay)                   # 6 < 8 - 8/8
    assert legal(LLAMA, c, Layout(8, 16, 128, 1, 8)) is None    # Llama 3's 7-8-7 with 8 chunks


def test_uneven_stages_in_compute_and_memory():
    """Compute is the busiest stage's; memory the fullest of first, second and last: with
    Llama 3's lighter ends the second stage (8 layers, one micro-batch fewer in flight
    than the first's 7) is the fullest."""
    c = make_cluster("h100-sxm", 16384)

    def est(f=None, l=None, **kw):
        kw = dict(dict(chunks=4, zero=1, sequence_parallel=True, recompute="selective"), **kw)
        return estimate(LLAMA, c, Layout(8, 16, 128, 1, first_stage_layers=f, last_stage_layers=l, **kw))

    even_ish, heavy_last, light_last = est(), est(6, 8), est(8, 6)
    assert light_last.compute_s == pytest.approx(even_ish.compute_s, rel=1e-12)   # 8 layers busiest
    assert heavy_last.compute_s > even_ish.compute_s                              # 8 layers + the head
    assert even_ish.bubble_s == pytest.approx(heavy_last.bubble_s, rel=1e-3)     # the mean stage's
    m, keep = 16, layer_activation_bytes(8192, 1, 16384, 128, 8, True, "selective", ffn=53248,
                                         kv_heads=8, swiglu=True, dropout=False)   # Llama's shape
    second = live_chunks("interleaved", 16, m, 4, 1) / 4 * 8 * keep
    first = live_chunks("interleaved", 16, m, 4, 0) / 4 * 7 * keep
    assert second > first and even_ish.bytes_stage == 1
    assert even_ish.memory["activations"] == pytest.approx(second, rel=1e-12)
    assert light_last.memory_bytes_per_gpu > even_ish.memory_bytes_per_gpu        # 8 on the first


def test_search_tries_pipelines_the_layers_do_not_divide():
    """126 layers: the old search tried only pp dividing 126 (1 and 2 of 16,384 GPUs)."""
    c = make_cluster("h100-sxm", 16384)
    pps = {(lay.pp, tuple(layout_stages(LLAMA, lay))[:1] + tuple(layout_stages(LLAMA, lay))[-1:])
           for lay in layouts(LLAMA, c, tp=8, zero=1, recompute="full", sequence_parallel=True,
                              micro_batch=1)}
    assert {(16, (7, 7)), (16, (6, 8)), (16, (8, 6)), (32, (3, 3)), (64, (1, 1))} <= pps


def test_cli_holds_the_end_stages(capsys):
    doc, _ = run_json(capsys, ["--gpus", "16384"] + LLAMA_SHAPE + ["--pp", "16", "--tp", "8",
                               "--first-stage-layers", "6", "--global-batch", "2048", "--zero", "1"])
    assert all(x["stage_layers"] == [6] + [8] * 15 for x in doc["layouts"])
    err = fail(capsys, ["--gpus", "16384"] + LLAMA_SHAPE + ["--pp", "16", "--first-stage-layers", "5"])
    assert "--pp 16 does not divide the 126 layers with first stage 5" in err
    assert main(["--gpus", "16384"] + LLAMA_SHAPE + ["--pp", "16", "--tp", "8", "--zero", "1",
                                                     "--recompute", "full", "--chunks", "8",
                                                     "--global-batch-tokens", "16M"]) == 0
    out = capsys.readouterr().out
    assert "layers per stage: 7, 8 x 14, 7" in out and max(map(len, out.splitlines())) <= 100


# ---------------------------------------------------------------------- 3. tokens, bubble-bound

@pytest.mark.parametrize("tokens, seq, batch", [("16M", 8192, 2048), ("4M", 4096, 1024),
                                                 ("4194304", 4096, 1024), ("2_097_152", 2048, 1024)])
def test_global_batch_in_tokens(capsys, tokens, seq, batch):
    doc, _ = run_json(capsys, B70 + ["--seq", str(seq), "--global-batch-tokens", tokens, "--tp", "8",
                                     "--pp", "8", "--zero", "1", "--top", "1"])
    assert doc["model"]["global_batch"] == batch and doc["model"]["seq"] == seq


@pytest.mark.parametrize("argv, words", [
    (["--global-batch-tokens", "16e6"], "not a whole number of sequences of 4096"),
    (["--global-batch-tokens", "4M", "--global-batch", "1024"], "give the global batch once"),
    (["--global-batch-tokens", "lots"], "whole number of tokens"),
    (["--global-batch-tokens", "1e400"], "whole number of tokens"),
    (["--global-batch-tokens", "0.5"], "whole number of tokens"),
])
def test_bad_token_batches(capsys, argv, words):
    assert words in fail(capsys, B70 + argv)


def test_bubble_bound_warning(capsys):
    """16 sequences over dp 16 at pp 8: one micro-batch each, the bubble (p-1)/(m+p-1) = 7/8
    of compute + bubble whatever else is searched; 1024 sequences: no warning. Llama 3's
    shape on 65,536 GPUs with its 2048 sequences: at most dp 2048, m = 1 (16M tokens
    stop scaling there)."""
    doc, err = run_json(capsys, B70 + ["--tp", "8", "--pp", "8", "--global-batch", "16"])
    assert len(doc["warnings"]) == 1 and "bubble-bound" in doc["warnings"][0]
    assert f"over {BUBBLE_BOUND:.0%} of its compute + bubble" in doc["warnings"][0] and "bubble-bound" in err
    assert all(x["bubble_s"] > BUBBLE_BOUND * (x["compute_s"] + x["bubble_s"]) for x in doc["layouts"])
    assert main(B70 + ["--tp", "8", "--pp", "8", "--global-batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "warning: bubble-bound" in out and max(map(len, out.splitlines())) <= 100
    doc, err = run_json(capsys, B70 + ["--tp", "8", "--pp", "8"])
    assert doc["warnings"] == [] and err == ""
    doc, _ = run_json(capsys, ["--gpus", "65536"] + LLAMA_SHAPE + ["--global-batch-tokens", "16M"])
    assert len(doc["warnings"]) == 1 and all(x["pp"] > 1 for x in doc["layouts"])


# ---------------------------------------------------------------------- 4. --params

@pytest.mark.parametrize("params", ["5e5", "999999", "0.5M"])
def test_params_below_a_million_refused(capsys, params):
    err = fail(capsys, ["--params", params, "--gpus", "8"])
    assert "at least a million" in err


# ---------------------------------------------------------------------- 5. no MPI

def test_plan_runs_where_mpi4py_cannot_be_imported():
    """`python -m minidist.plan` in a Python whose mpi4py import fails (sys.modules entry
    None): one layout's arithmetic and a CP layout; mpi4py never loads. (The search of
    B70 itself, mpi4py blocked: tests/test_no_mpi4py.py.)"""
    code = ("import runpy, sys; sys.modules['mpi4py'] = None\n"
            "for argv in ({}):\n"
            "    sys.argv = ['minidist.plan'] + argv\n"
            "    try:\n"
            "        runpy.run_module('minidist.plan', run_name='__main__', alter_sys=True)\n"
            "    except SystemExit as e:\n"
            "        assert not e.code, e.code\n"
            "assert sys.modules['mpi4py'] is None\n"
            "assert not [m for m in sys.modules if m.startswith(('mpi4py.', 'minidist.comm', "
            "'minidist.parallel'))]\n"
            "print('NO MPI OK')")
    argvs = [B70 + ["--tp", "8", "--pp", "8", "--only", "--explain"],
             B70 + ["--cp", "2", "--tp", "4", "--pp", "4", "--zero", "1", "--top", "1"]]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code.format(repr(argvs))], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "NO MPI OK" in out.stdout and "MFU" in out.stdout and "exposed CP" not in out.stderr


def test_chunk_len_is_the_length_of_the_chunks_of_chunk_bounds():
    """plan.collectives.chunk_len (the search's shortcut) against plan.rules.chunk_bounds,
    and chunk_bounds against numpy.array_split, whose cut it states."""
    import numpy as np
    from minidist.plan.collectives import chunk_len
    from minidist.plan.rules import chunk_bounds
    for n in (0, 1, 7, 64, 1000):
        for size in (1, 2, 3, 8, 13):
            b = chunk_bounds(n, size)
            assert np.diff(b).tolist() == [len(c) for c in np.array_split(np.arange(n), size)]
            assert [chunk_len(n, size, c) for c in range(size)] == [b[c + 1] - b[c] for c in range(size)]


# ---------------------------------------------------------------------- 6. Llama 3 405B

def test_llama3_405b_search_first_is_at_least_the_best_with_pp16(capsys):
    """The issue's command: the search's first layout is at least as fast as the best a
    person finds holding --pp 16 (Llama 3's pipeline), and both fit."""
    doc, _ = run_json(capsys, ACCEPT[:-1])
    first = doc["layouts"][0]
    held, _ = run_json(capsys, ACCEPT[:-1] + ["--pp", "16"])
    best16 = held["layouts"][0]
    assert first["fits"] and best16["fits"] and best16["pp"] == 16
    assert first["step_time_s"] <= best16["step_time_s"]
    assert doc["searched"] > held["searched"] > 0
