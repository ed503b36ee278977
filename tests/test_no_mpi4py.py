"""The one-process tools run on a machine without MPI, and print within 100 columns.

    python -m pytest -q tests/test_no_mpi4py.py

`python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm` (its search),
`python -m minidist.checkpoint import/export/show`,
`python -m minidist.bench model` and `--help`, and `python -m minidist.memory` run in
subprocesses whose PYTHONPATH starts with a folder holding an mpi4py package that raises
ImportError, as on a laptop where mpi4py is not installed. They run side by side (the
import needs to come before show and export).
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from minidist.checkpoint import store
from minidist.checkpoint.format import write_safetensors

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100
C, V, T = 8, 16, 4


def blocked_env(tmp_path):
    fake = tmp_path / "no_mpi" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("No module named \'mpi4py\' (blocked by the test)")\n')
    path = os.pathsep.join([str(tmp_path / "no_mpi"), str(ROOT)])
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                MINIDIST_NO_WRAP="1")


def start(args, env, cwd):
    return subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(procs):
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[name] = (p.returncode, stdout, stderr)
    return out


def nanogpt_file(path):
    """A one-layer GPT's state dict as nanoGPT saves it (PyTorch layouts, lm_head.weight)."""
    g = np.random.default_rng(0)
    sd = {"lm_head.weight": g.normal(size=(V, C)), "transformer.wpe.weight": g.normal(size=(T, C)),
          "transformer.ln_f.weight": np.ones(C), "transformer.ln_f.bias": np.zeros(C)}
    p = "transformer.h.0."
    for name, shape in {"ln_1.weight": (C,), "ln_1.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
                        "attn.c_attn.weight": (3 * C, C), "attn.c_attn.bias": (3 * C,),
                        "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,),
                        "mlp.c_fc.weight": (4 * C, C), "mlp.c_fc.bias": (4 * C,),
                        "mlp.c_proj.weight": (C, 4 * C), "mlp.c_proj.bias": (C,)}.items():
        sd[p + name] = g.normal(size=shape)
    write_safetensors(path, sd, {"format": "pt"})


def many_pieces(root):
    """A checkpoint whose tensor lines would run far past 100 columns unwrapped."""
    name = "optim.exp_avg_sq.transformer.h.11.mlp.c_proj.weight"
    a = np.arange(3072.0).reshape(96, 32)
    cuts = np.linspace(0, a.size, 17).astype(int)
    pieces = [{"name": name, "global_shape": a.shape, "dtype": a.dtype, "flat": [int(lo), int(hi)],
               "array": a.reshape(-1)[lo:hi]} for lo, hi in zip(cuts[:-1], cuts[1:])]
    store.save(None, root, 7, pieces, {"layout": {"kind": "zero3", "ranks": 16},
                                        "data": {"position": 7, "split": "train"}})


def test_the_one_process_tools_run_without_mpi4py(tmp_path):
    env = blocked_env(tmp_path)
    nanogpt_file(tmp_path / "nano.safetensors")
    many_pieces(tmp_path / "wide")
    first = {
        "mpi4py is blocked": start(["-c", "import mpi4py"], env, tmp_path),
        "import": start(["-m", "minidist.checkpoint", "import", "nano.safetensors", "ckpt"], env, tmp_path),
        "plan": start(["-m", "minidist.plan", "--params", "70e9", "--gpus", "1024", "--gpu", "h100-sxm"],
                      env, tmp_path),
        "bench --help": start(["-m", "minidist.bench", "--help"], env, tmp_path),
        "bench model": start(["-m", "minidist.bench", "model", "--no-torch", "--steps", "1", "--warmup", "0"],
                             env, tmp_path),
        "memory": start(["-m", "minidist.memory", "--params", "7.5e9", "--dp", "64", "--seq", "2048", "--batch",
                         "1", "--hidden", "4096", "--heads", "32", "--layers", "32", "--tp", "2", "--pp", "4",
                         "--sequence-parallel", "--recompute", "selective"], env, tmp_path),
        "show wide": start(["-m", "minidist.checkpoint", "show", "wide"], env, tmp_path),
    }
    done = finish({"import": first.pop("import")})
    assert done["import"][0] == 0, done["import"][2]
    second = {"show": start(["-m", "minidist.checkpoint", "show", "ckpt"], env, tmp_path),
              "export": start(["-m", "minidist.checkpoint", "export", "--dtype", "float32", "ckpt",
                               "out.safetensors"], env, tmp_path)}
    done.update(finish({**first, **second}))
    code, out, err = done.pop("mpi4py is blocked")
    assert code != 0 and "blocked by the test" in err, "the fake mpi4py must make `import mpi4py` fail"
    for name, (code, out, err) in done.items():
        assert code == 0, f"{name} without mpi4py: exit {code}\n{out[-1500:]}{err[-1500:]}"
        wide = [line for line in out.splitlines() if len(line) > WIDTH]
        assert not wide, f"{name}: {len(wide)} lines over {WIDTH} columns: {wide[:3]}"
    assert "legal layouts searched" in done["plan"][1] and "MFU%" in done["plan"][1]
    assert "model" in done["bench --help"][1] and "collectives" in done["bench --help"][1]
    assert "tokens/s" in done["bench model"][1]
    assert "flat[" in done["show wide"][1] and "zero3" in done["show wide"][1]
    assert "does not say n_head" in done["export"][1]      # a state dict carries no head count
    assert (tmp_path / "out.safetensors").stat().st_size > 0
