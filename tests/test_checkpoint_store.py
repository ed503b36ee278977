"""Checkpoint storage in one process: the safetensors bytes, the index, kills, the CLI.

    python -m pytest -q tests/test_checkpoint_store.py

The pieces here are those several ranks would write (boxes of a matrix, flat ranges of a
vector, a 0-d counter), all saved by one process (comm None); tests/mpi/test_checkpoint_store.py
splits them across ranks. A kill at each stage of save runs in a subprocess that SIGKILLs
itself there (MINIDIST_CKPT_KILL_AT); the subprocesses run side by side to stay fast.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minidist.checkpoint import cli, store
from minidist.checkpoint import index as ckindex, read as reader
from minidist.checkpoint import format as format_
from minidist.checkpoint.format import (CheckpointError, read_header, read_safetensors, read_tensor,
                                        write_safetensors)

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


# ---- the file format ----

def every_dtype():
    import ml_dtypes
    rng = np.random.default_rng(0)
    return {"f16": rng.standard_normal((2, 3)).astype(np.float16),
            "f32": rng.standard_normal((4,)).astype(np.float32),
            "f64": rng.standard_normal((2, 2, 2)),
            "bf16": rng.standard_normal((3, 2)).astype(ml_dtypes.bfloat16),
            "i32": np.arange(-3, 3, dtype=np.int32), "i64": np.arange(5, dtype=np.int64) * 2**40,
            "u8": np.arange(250, 256, dtype=np.uint8), "bool": np.array([True, False, True]),
            "scalar": np.array(7, np.int64), "scalar_f": np.array(2.5, np.float32),
            "empty": np.zeros((0, 3), np.float32), "big_endian": np.arange(4, dtype=">i4"),
            "strided": np.arange(12.0).reshape(3, 4).T}


def test_every_dtype_survives_a_round_trip_bit_for_bit(tmp_path):
    tensors = every_dtype()
    write_safetensors(tmp_path / "a.safetensors", tensors, {"step": "3"})
    back = read_safetensors(tmp_path / "a.safetensors")
    assert list(back) == list(tensors)
    for name, a in tensors.items():
        b = back[name]
        assert b.shape == a.shape and b.dtype == a.dtype.newbyteorder("="), f"{name}: {b.shape} {b.dtype}"
        assert np.array_equal(b.reshape(-1).view(np.uint8), np.ascontiguousarray(a, b.dtype).reshape(-1).view(np.uint8)), name
    header = read_header(tmp_path / "a.safetensors")
    assert header["__metadata__"] == {"step": "3"} and header.data_start % 8 == 0
    assert header["bf16"]["dtype"] == "BF16" and header["scalar"]["shape"] == []


def test_the_bytes_are_the_safetensors_layout(tmp_path):
    """8 bytes little-endian N, N bytes of JSON padded with spaces, the raw bytes: read by hand."""
    write_safetensors(tmp_path / "b.safetensors", {"x": np.array([1.0, 2.0], np.float32)})
    raw = (tmp_path / "b.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and json.loads(raw[8:8 + n]) == {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    assert raw[8 + n:] == np.array([1.0, 2.0], "<f4").tobytes()


def test_truncated_or_foreign_files_are_clear_errors(tmp_path):
    path = tmp_path / "c.safetensors"
    write_safetensors(path, {"x": np.arange(10.0), "y": np.arange(3.0)})
    header = read_header(path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-5])
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(path)
    with pytest.raises(CheckpointError, match="truncated"):
        read_tensor(path, "y", header)                 # a stale header: the read itself notices
    assert np.array_equal(read_tensor(path, "x", header), np.arange(10.0))   # only x's bytes are read
    path.write_bytes(raw[:4])
    with pytest.raises(CheckpointError, match="too short"):
        read_header(path)
    path.write_bytes(b"PK\x03\x04 not safetensors at all")
    with pytest.raises(CheckpointError, match=str(path)):
        read_header(path)
    with pytest.raises(CheckpointError, match="cannot read"):
        read_header(tmp_path / "missing.safetensors")
    write_safetensors(path, {"x": np.zeros(1)})
    with pytest.raises(CheckpointError, match="holds no tensor 'z'"):
        read_tensor(path, "z")
    with pytest.raises(CheckpointError, match="complex128 cannot be stored"):
        write_safetensors(path, {"c": np.zeros(2, complex)})


# ---- sharded checkpoints ----

W = np.arange(42.0).reshape(6, 7)
V = np.linspace(0, 1, 11).astype(np.float32)


def pieces(step=0):
    """What three ranks would hold: W in row boxes (one empty), V in uneven flat ranges, a counter."""
    w, v = W + step, V + step
    return [dict(name="w", global_shape=(6, 7), dtype=w.dtype, box=[[0, 4], [0, 7]], array=w[:4]),
            dict(name="w", global_shape=(6, 7), dtype=w.dtype, box=[[4, 6], [0, 7]], array=w[4:]),
            dict(name="w", global_shape=(6, 7), dtype=w.dtype, box=[[6, 6], [0, 7]], array=w[6:]),
            dict(name="v", global_shape=(11,), dtype=v.dtype, flat=[0, 5], array=v[:5]),
            dict(name="v", global_shape=(11,), dtype=v.dtype, flat=[5, 11], array=v[5:]),
            dict(name="n", global_shape=(), dtype=np.dtype(np.int64), box=[], array=np.array(step, np.int64))]


def assert_holds(root, step):
    ckpt = ckindex.resolve(root)
    assert ckpt.endswith(ckindex.step_dir(step)), f"latest names {ckpt}, expected step {step}"
    assert reader.verify(root) == []
    index = ckindex.load_index(root)
    assert index["step"] == step
    assert np.array_equal(reader.read_global(ckpt, index, "w"), W + step)
    assert np.array_equal(reader.read_global(ckpt, index, "v"), V + step)
    assert reader.read_global(ckpt, index, "n") == step


def test_save_then_read_whole_tensors_and_regions(tmp_path, monkeypatch):
    path = store.save(None, tmp_path, 3, pieces(3), {"layout": {"kind": "test"}, "data": {"pos": 12}})
    assert path == os.path.join(tmp_path, "step00000003") and (tmp_path / "latest").read_text() == "step00000003\n"
    assert_holds(tmp_path, 3)
    index = ckindex.load_index(path)
    assert index["meta"] == {"layout": {"kind": "test"}, "data": {"pos": 12}}
    assert index["tensors"]["w"]["shape"] == [6, 7] and index["tensors"]["v"]["dtype"] == "float32"
    read = []
    monkeypatch.setattr(reader, "read_tensor", lambda path, key, header: read.append(key) or read_tensor(path, key, header))
    monkeypatch.setattr(reader, "read_ranges", lambda path, key, ranges, header: read.append(key) or
                        format_.read_ranges(path, key, ranges, header))
    assert np.array_equal(reader.read_region(path, index, "w", box=[[4, 6], [2, 5]]), (W + 3)[4:6, 2:5])
    assert np.array_equal(reader.read_region(path, index, "v", flat=[6, 9]), (V + 3)[6:9])
    assert read == ["w@1", "v@1"], f"read_region read {read}: only the overlapping pieces should be read"
    assert np.array_equal(reader.read_region(path, index, "w", box=[[3, 5], [0, 7]]), (W + 3)[3:5])
    # across kinds (a flat range of a boxed tensor): the runs of each box that overlap
    assert np.array_equal(reader.read_region(path, index, "w", flat=[5, 30]), (W + 3).reshape(-1)[5:30])
    assert np.array_equal(reader.read_region(path, index, "v", box=[[2, 4]]), (V + 3)[2:4])
    assert reader.read_region(path, index, "n", box=[]) == 3
    with pytest.raises(CheckpointError, match="outside"):
        reader.read_region(path, index, "w", box=[[0, 7], [0, 7]])


def test_a_box_out_of_flat_pieces_reads_only_the_overlapping_bytes(tmp_path):
    """ZeRO saved a (6, 5, 4) tensor as uneven flat ranges, and a (10,) one as boxes; every
    box and range asked of them equals the slice, and the tensor bytes read equal the
    bytes asked for (a reader of whole pieces would read more)."""
    rng = np.random.default_rng(1)
    T = rng.standard_normal((6, 5, 4))
    cuts = [0, 7, 8, 50, 51, 119, 120]
    ps = [dict(name="t", global_shape=T.shape, dtype=T.dtype, flat=[a, b], array=T.reshape(-1)[a:b])
          for a, b in zip(cuts, cuts[1:])]
    ps += [dict(name="u", global_shape=(10,), dtype=T.dtype, box=[[a, b]], array=np.arange(a, b, dtype=float))
           for a, b in ((0, 3), (3, 10))]
    path = store.save(None, tmp_path, 1, ps, {})
    index = ckindex.load_index(path)
    boxes = [[[0, 6], [0, 5], [0, 4]], [[1, 3], [0, 5], [0, 4]], [[2, 5], [1, 4], [0, 4]],
             [[0, 6], [2, 3], [1, 3]], [[5, 6], [4, 5], [3, 4]], [[0, 6], [0, 5], [2, 2]]]
    boxes += [[sorted(rng.integers(0, n + 1, 2).tolist()) for n in T.shape] for _ in range(20)]
    for box in boxes:
        reader.reset_reads()
        got = reader.read_region(path, index, "t", box=box)
        assert np.array_equal(got, T[tuple(slice(a, b) for a, b in box)]), box
        assert reader.READS["read"] == reader.READS["needed"] == got.nbytes, (box, reader.READS)
    for a, b in ((0, 120), (7, 9), (60, 61), (3, 3)):
        reader.reset_reads()
        assert np.array_equal(reader.read_region(path, index, "t", flat=[a, b]), T.reshape(-1)[a:b])
        assert reader.READS["read"] == reader.READS["needed"] == 8 * (b - a)
    reader.reset_reads()
    assert np.array_equal(reader.read_region(path, index, "u", flat=[2, 5]), [2.0, 3.0, 4.0])
    assert reader.READS["read"] == reader.READS["needed"] == 24
    assert reader.READS["checked"] == 0          # the file's sha256 was checked once, earlier


@pytest.mark.parametrize("fault", ["flipped byte", "truncated", "missing"])
def test_a_damaged_file_is_named_when_read_and_by_verify(tmp_path, fault):
    path = store.save(None, tmp_path, 1, pieces(1), {})
    file = Path(path) / "rank00000.safetensors"
    raw = bytearray(file.read_bytes())
    if fault == "flipped byte":
        raw[-3] ^= 0x10                                 # inside a tensor's bytes: only sha256 sees it
        file.write_bytes(raw)
    elif fault == "truncated":
        file.write_bytes(raw[:-8])
    else:
        file.unlink()
    word = {"flipped byte": "sha256", "truncated": "bytes, the index says", "missing": "missing"}[fault]
    with pytest.raises(CheckpointError, match=word) as e:
        reader.read_global(path, ckindex.load_index(tmp_path), "v")
    assert str(file) in str(e.value)
    problems = reader.verify(tmp_path)
    assert len(problems) >= 1 and str(file) in problems[0] and word in problems[0], problems


@pytest.mark.parametrize("bug", ["gap", "overlap"])
def test_a_layout_bug_publishes_nothing(tmp_path, bug):
    store.save(None, tmp_path, 1, pieces(1), {})
    bad = pieces(2)
    if bug == "gap":
        bad[3]["flat"], bad[3]["array"] = [0, 4], bad[3]["array"][:4]
    else:
        bad[0]["box"], bad[0]["array"] = [[0, 5], [0, 7]], W[:5] + 2
    word = {"gap": "1 of 11 elements not covered", "overlap": "7 of 42 elements covered by more than one"}[bug]
    with pytest.raises(CheckpointError, match=word) as e:
        store.save(None, tmp_path, 2, bad, {})
    assert ("'v'" if bug == "gap" else "'w'") in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step00000001"], "a failed save left something behind"
    assert_holds(tmp_path, 1)


def test_bad_pieces_and_steps_are_refused(tmp_path):
    store.save(None, tmp_path, 1, pieces(1), {})
    with pytest.raises(CheckpointError, match="already exists"):
        store.save(None, tmp_path, 1, pieces(1), {})
    for change, word in [(dict(box=[[0, 4], [0, 8]]), "outside its global shape"),
                         (dict(array=W[:3]), "its region is"),
                         (dict(array=W[:4].astype(np.float32)), "dtype float32"),
                         (dict(flat=[0, 28]), "exactly one of")]:
        bad = pieces(2)
        bad[0].update(change)
        with pytest.raises(CheckpointError, match=word):
            store.save(None, tmp_path, 2, bad, {})
    with pytest.raises(CheckpointError, match="JSON-able"):
        store.save(None, tmp_path, 2, pieces(2), {"rng": np.arange(3)})
    assert sorted(os.listdir(tmp_path)) == ["latest", "step00000001"]


def test_resolve_follows_latest_and_says_what_is_wrong(tmp_path):
    with pytest.raises(CheckpointError, match="no such folder"):
        ckindex.resolve(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="no latest"):
        ckindex.resolve(tmp_path)
    store.save(None, tmp_path, 5, pieces(5), {})
    assert ckindex.resolve(tmp_path) == ckindex.resolve(tmp_path / "step00000005") == str(tmp_path / "step00000005")
    (tmp_path / "latest").write_text("step00000009\n")
    with pytest.raises(CheckpointError, match="step00000009/index.json does not exist"):
        ckindex.resolve(tmp_path)
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        ckindex.resolve(tmp_path)
    (tmp_path / "step00000005" / "index.json").write_text('{"format": "minidist-checkpoint", "version": 99}')
    with pytest.raises(CheckpointError, match="version 99"):
        ckindex.load_index(tmp_path / "step00000005")


def test_keep_deletes_the_oldest_and_never_latest(tmp_path):
    for step in (10, 20, 30):
        store.save(None, tmp_path, step, pieces(step), {}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step00000020", "step00000030"]
    store.save(None, tmp_path, 15, pieces(15), {}, keep=1)      # resumed from an older step
    assert sorted(os.listdir(tmp_path)) == ["latest", "step00000015"]
    assert_holds(tmp_path, 15)


def test_check_against_names_the_first_mismatch(tmp_path):
    index = ckindex.load_index(store.save(None, tmp_path, 1, pieces(1), {}))
    ok = {"w": ((6, 7), np.float64), "v": ((11,), np.float32), "n": ((), np.int64)}
    ckindex.check_against(index, ok)
    for expected, word in [({**ok, "w": ((7, 6), np.float64)}, "'w'.*holds \\(6, 7\\) float64, the model \\(7, 6\\)"),
                           ({**ok, "v": ((11,), np.float64)}, "'v'.*float32, the model \\(11,\\) float64"),
                           ({**ok, "b": ((1,), np.float32)}, "no tensor 'b'"),
                           ({k: ok[k] for k in ("w", "v")}, "holds 'n', which the model lacks")]:
        with pytest.raises(CheckpointError, match=word):
            ckindex.check_against(index, expected)


KILL = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_checkpoint_store import pieces
from minidist.checkpoint import store
store.save(None, {root!r}, 2, pieces(2), {{}}, keep=1)
"""


def test_a_kill_at_any_stage_leaves_a_loadable_checkpoint(tmp_path):
    """SIGKILL at each stage: latest names the old checkpoint, or (after latest moved) the new one."""
    runs = {}
    for stage in store.KILL_STAGES:
        root = tmp_path / stage
        store.save(None, root, 1, pieces(1), {})
        env = dict(ENV, MINIDIST_CKPT_KILL_AT=stage)
        code = KILL.format(tests=str(ROOT / "tests"), root=str(root))
        runs[stage] = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    for stage, proc in runs.items():
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -9, f"{stage}: the saving process was not killed: {err.decode()}"
        root = tmp_path / stage
        assert_holds(root, 2 if stage == "after-latest" else 1)
        left = sorted(os.listdir(root))
        assert (any(n.startswith(".tmp-") for n in left) == (stage in ("after-data", "after-index"))), left
        store.save(None, root, 3, pieces(3), {}, keep=1)      # the next save cleans up
        assert sorted(os.listdir(root)) == ["latest", "step00000003"], sorted(os.listdir(root))


# ---- the command line ----

def gpt_checkpoint(root, step=7):
    """A checkpoint as the training code writes it: model.<param>, optim.* beside them."""
    from minidist.model import GPT, GPTConfig
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8))
    params = dict(model.named_parameters())
    ps = []
    for name, p in params.items():
        a = np.asarray(p.data)
        ps.append(dict(name="model." + name, global_shape=a.shape, dtype=a.dtype, box=[[0, n] for n in a.shape], array=a))
        ps.append(dict(name="optim.exp_avg." + name, global_shape=a.shape, dtype=a.dtype, flat=[0, a.size], array=a.reshape(-1) * 0))
        ps.append(dict(name="optim.step." + name, global_shape=(), dtype=np.dtype(np.int64), box=[], array=np.array(step)))
    store.save(None, root, step, ps, {"layout": {"kind": "single"}, "data": {"position": 123}})
    return {n: np.asarray(p.data) for n, p in params.items()}


def test_export_import_export_is_bit_for_bit(tmp_path, capsys):
    params = gpt_checkpoint(tmp_path / "run")
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "a.safetensors")]) == 0
    exported = read_safetensors(tmp_path / "a.safetensors")
    assert set(exported) == set(params) | {"lm_head.weight"}, "only model tensors, under nanoGPT's names"
    assert np.array_equal(exported["transformer.h.0.attn.c_attn.weight"], params["transformer.h.0.attn.c_attn.weight"].T)
    assert exported["transformer.h.0.attn.c_attn.weight"].shape == (24, 8), "nn.Linear's (out, in)"
    assert np.array_equal(exported["transformer.wte.weight"], params["transformer.wte.weight"])
    assert np.array_equal(exported["lm_head.weight"], params["transformer.wte.weight"])
    assert cli.main(["import", str(tmp_path / "a.safetensors"), str(tmp_path / "back")]) == 0
    index = ckindex.load_index(tmp_path / "back")
    assert index["step"] == 0 and index["meta"]["layout"] == {"kind": "single"}
    assert set(index["tensors"]) == {"model." + n for n in params}, "no optimizer state, no lm_head"
    assert cli.main(["export", str(tmp_path / "back"), str(tmp_path / "b.safetensors")]) == 0
    again = read_safetensors(tmp_path / "b.safetensors")
    assert list(again) == list(exported)
    for name, a in exported.items():
        assert again[name].dtype == a.dtype and np.array_equal(again[name].view(np.uint8), a.view(np.uint8)), name
    out = capsys.readouterr().out
    assert out.count("wrote") == 3


def test_show_lists_tensors_pieces_and_files(tmp_path, capsys):
    store.save(None, tmp_path, 4, pieces(4), {"layout": {"kind": "zero", "dp": 3}, "data": {"position": 99}})
    assert cli.main(["show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 4" in out and "'kind': 'zero'" in out and "'position': 99" in out
    assert "w (6, 7) float64  r0:[0:4,0:7] r0:[4:6,0:7] r0:[6:6,0:7]" in out
    assert "v (11,) float32  r0:flat[0:5] r0:flat[5:11]" in out and "rank00000.safetensors" in out


def test_the_command_exits_0_when_sound_and_2_with_one_line_per_problem(tmp_path):
    """python -m minidist.checkpoint, in subprocesses side by side."""
    store.save(None, tmp_path / "good", 1, pieces(1), {})
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    file = tmp_path / "bad" / "step00000001" / "rank00000.safetensors"
    file.write_bytes(file.read_bytes()[:-1])
    commands = {"good": ["verify", str(tmp_path / "good")], "bad": ["verify", str(tmp_path / "bad")],
                "missing": ["export", str(tmp_path / "nowhere"), str(tmp_path / "x.safetensors")],
                "no model": ["export", str(tmp_path / "good"), str(tmp_path / "x.safetensors")]}
    procs = {k: subprocess.Popen([sys.executable, "-m", "minidist.checkpoint", *c], env=ENV, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k, c in commands.items()}
    done = {k: (p.communicate(timeout=60), p.returncode) for k, p in procs.items()}
    (out, err), code = done["good"]
    assert code == 0 and out == "ok: 1 files, 3 tensors, %d bytes verified\n" % os.path.getsize(
        tmp_path / "good" / "step00000001" / "rank00000.safetensors"), out + err
    (out, err), code = done["bad"]
    assert code == 2 and str(file) in out and "bytes, the index says" in out, out + err
    for k in ("missing", "no model"):
        (out, err), code = done[k]
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, f"{k}: {err}"


def test_pytorch_reads_an_export(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here: the export is read by hand above")
    params = gpt_checkpoint(tmp_path / "run")
    cli.main(["export", str(tmp_path / "run"), str(tmp_path / "a.safetensors")])
    raw = (tmp_path / "a.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    e = header["transformer.h.0.mlp.c_fc.weight"]
    begin, end = e["data_offsets"]
    w = torch.frombuffer(bytearray(raw[8 + n + begin:8 + n + end]), dtype=torch.float32).reshape(e["shape"])
    linear = torch.nn.Linear(8, 32)
    linear.weight.data.copy_(w)
    linear.bias.data.copy_(torch.from_numpy(params["transformer.h.0.mlp.c_fc.bias"]))
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    want = x @ params["transformer.h.0.mlp.c_fc.weight"] + params["transformer.h.0.mlp.c_fc.bias"]
    assert np.allclose(linear(torch.from_numpy(x)).detach().numpy(), want, atol=1e-5)


def test_a_tensor_no_rank_wrote_is_refused_before_publishing(tmp_path):
    """Coverage checks the tensors some rank wrote; `require` names the ones that must be
    there, so a layout that lost a whole tensor cannot publish a checkpoint without it."""
    a = np.arange(6.0).reshape(2, 3)
    piece = {"name": "model.w", "global_shape": (2, 3), "dtype": a.dtype, "box": [[0, 2], [0, 3]], "array": a}
    with pytest.raises(CheckpointError, match="no rank wrote tensor 'model.b'"):
        store.save(None, str(tmp_path), 1, [piece], {}, require={"model.w", "model.b"})
    assert not [f for f in os.listdir(tmp_path) if f.startswith("step")]
    store.save(None, str(tmp_path), 1, [piece], {}, require={"model.w"})
    assert reader.verify(str(tmp_path)) == []


def test_latest_is_flushed_and_fsynced_before_it_replaces_the_old(tmp_path, monkeypatch):
    """The order of the calls that publish `latest`: its temporary file written, flushed
    (Python's buffer into the kernel) and fsynced (the kernel's onto the disk) BEFORE
    os.replace puts it in place, and the folder fsynced after. A replace first could
    leave, after a power cut, a `latest` that is empty: no checkpoint found at all."""
    calls, fds = [], {}

    class Recorded:
        def __init__(self, f, name):
            self.f, self.name = f, name

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            calls.append(("close", self.name))
            fds.pop(self.f.fileno(), None)           # the number may name a folder next
            return self.f.__exit__(*exc)

        def write(self, text):
            calls.append(("write", self.name))
            return self.f.write(text)

        def flush(self):
            calls.append(("flush", self.name))
            return self.f.flush()

        def fileno(self):
            fds[self.f.fileno()] = self.name
            return self.f.fileno()

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    real_open, real_fsync, real_replace = open, os.fsync, os.replace
    monkeypatch.setattr(store, "open", lambda path, *a, **k: Recorded(real_open(path, *a, **k),
                                                                       os.path.basename(path)), raising=False)
    monkeypatch.setattr(store.os, "fsync", lambda fd: calls.append(("fsync", fds.get(fd, "a folder")))
                        or real_fsync(fd))
    monkeypatch.setattr(store.os, "replace", lambda a, b: calls.append(("replace", os.path.basename(a)))
                        or real_replace(a, b))
    store.save(None, tmp_path, 1, pieces(1), {})
    assert (tmp_path / "latest").read_text() == "step00000001\n"
    mine = [c for c in calls if c[1] in ("latest.tmp", "a folder") or c[0] == "replace"]
    i = mine.index(("replace", "latest.tmp"))
    before = [c for c in mine[:i] if c[1] == "latest.tmp"]
    assert before[:1] == [("write", "latest.tmp")], calls
    assert ("flush", "latest.tmp") in before and ("fsync", "latest.tmp") in before, \
        f"latest.tmp must be flushed and fsynced before os.replace: {mine}"
    assert before.index(("flush", "latest.tmp")) < before.index(("fsync", "latest.tmp")), mine
    assert ("fsync", "a folder") in mine[i + 1:], f"the folder is fsynced after the replace: {mine}"


def test_a_weights_only_checkpoint_given_to_resume_says_so(tmp_path):
    """What `checkpoint import` writes (weights, no optimizer state) is not a run to resume:
    the message says that, not "(another model?)"."""
    from mpi4py import MPI
    from minidist.checkpoint import layouts
    from minidist.model import GPT, GPTConfig
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8))
    ps = [dict(name="model." + n, global_shape=p.data.shape, dtype=p.data.dtype,
               box=[[0, k] for k in p.data.shape], array=np.asarray(p.data)) for n, p in model.named_parameters()]
    store.save(None, tmp_path, 0, ps, {"layout": {"kind": "single"}})
    with pytest.raises(CheckpointError, match="weights only") as e:
        layouts.load(MPI.COMM_SELF, str(tmp_path), model, model.configure_optimizers(0.1, 1e-3))
    assert "another model" not in str(e.value)
