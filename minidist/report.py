"""The report every lesson ends with: its keys, its verdict line and its JSON.

`new_report` makes a dict with every key of the contract (docs/architecture.md), None where
a lesson has nothing to say; `finish` prints the verdict on rank 0, writes --json there and
returns the exit code, 0 only on a match. Under the grader (`cli.running`) it prints
nothing and keeps the report for the grader to read.
"""
import json

import numpy as np

from minidist import backend, equivalence
from minidist.cli import captured, fmt_bytes, is_root, say, world

REPORT_KEYS = ("lesson", "world_size", "parallel", "dtype", "steps", "match", "max_rel_diff",
               "max_abs_diff", "tolerance", "losses", "comm", "memory", "step_time_s", "mfu", "figures")


def new_report(lesson, args, **fields):
    """A report with every key of the architecture's contract, None where not set."""
    rep = dict.fromkeys(REPORT_KEYS)
    rep.update(lesson=lesson, world_size=world()[1], dtype=getattr(args, "dtype", None),
               steps=getattr(args, "steps", None))
    for k, v in fields.items():
        if k not in REPORT_KEYS:
            raise KeyError(f"{k!r} is not a report key; the keys are {REPORT_KEYS}")
        rep[k] = v
    return rep


def _plain(x):
    """NumPy scalars and arrays (device arrays too) -> JSON-friendly Python values; inf/nan -> None."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if backend.on_device(x):                   # a device array in a report: brought home
        x = backend.to_numpy(x)
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if np.isfinite(x) else None
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


# PCIe 4.0 x16: 16 GT/s per lane x 16 lanes, 128b/130b encoding: 31.5 GB/s each way (the
# PCI-SIG's PCIe 4.0 base specification); copies reach about 25 GB/s of it in practice, the
# round figure the lessons' texts price transfers at (this project's choice)
PCIE4_X16_PRACTICAL_BYTES_PER_S = 25e9


def add_host_device_bytes(report):
    """figures["host_device_bytes_per_step"]: the training's host<->device bytes per step
    (equivalence.host_device_bytes_per_step; 0 on the CPU), unless the lesson set it or
    trained nothing. Returns the figure (None when there is none). The runs it was taken
    from are forgotten: a next lesson in this process (the grader's) starts from none."""
    figures = report.get("figures")
    per_step = equivalence.host_device_bytes_per_step()
    equivalence.RUNS.clear()
    if isinstance(figures, dict) and "host_device_bytes_per_step" in figures:
        return figures["host_device_bytes_per_step"]
    if per_step is None:
        return None
    if figures is None:
        figures = report["figures"] = {}
    if isinstance(figures, dict):
        figures["host_device_bytes_per_step"] = per_step
    return per_step


def transfer_line(per_step):
    """One line for a device run: the bytes per step and their time over PCIe 4.0 x16."""
    s = per_step / PCIE4_X16_PRACTICAL_BYTES_PER_S
    took = f"{s * 1e6:.2f} us" if s < 1e-3 else f"{s * 1e3:,.2f} ms"
    return (f"host<->device: {fmt_bytes(per_step)} per training step on this rank (token ids in, the "
            f"loss out,\n  messages staged through the host): {took} at about 25 GB/s (PCIe 4.0 x16, "
            f"whose rate is 31.5),\n  plus each copy's latency")


def finish(report, args):
    """Print the verdict, write --json on rank 0, return the exit code (0 only on a match)."""
    per_step = add_host_device_bytes(report)
    match = bool(report.get("match"))
    said = captured()
    if said is not None:                       # run by the grader: keep it, print nothing
        said.reports.append(report)
        return 0 if match else 1
    if per_step is not None and backend.DEVICE != "cpu":     # quiet on the CPU: nothing crosses
        say("\n" + transfer_line(per_step))
    tol = report.get("tolerance")
    rel = report.get("max_rel_diff")
    if rel is not None:
        verdict = "MATCH" if match else "MISMATCH"
        tol_txt = f" (tolerance {tol:.0e})" if tol is not None else ""
        say(f"\nverdict: {verdict}: max_rel_diff {rel:.3e}{tol_txt}")
    else:
        say(f"\nverdict: {'MATCH' if match else 'MISMATCH'}")
    path = getattr(args, "json", None)
    if path and is_root():
        with open(path, "w") as f:
            json.dump(_plain(report), f, indent=2)
            f.write("\n")
        say(f"report written to {path}")
    return 0 if match else 1
