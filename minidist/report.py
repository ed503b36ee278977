"""The report every lesson ends with: its keys, its verdict line and its JSON.

`new_report` makes a dict with every key of the contract (docs/architecture.md), None where
a lesson has nothing to say; `finish` prints the verdict on rank 0, writes --json there and
returns the exit code, 0 only on a match. Under the grader (`cli.running`) it prints
nothing and keeps the report for the grader to read.
"""
import json

import numpy as np

from minidist.cli import captured, is_root, say, world

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
    """NumPy scalars and arrays -> JSON-friendly Python values; inf/nan -> None."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
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


def finish(report, args):
    """Print the verdict, write --json on rank 0, return the exit code (0 only on a match)."""
    match = bool(report.get("match"))
    said = captured()
    if said is not None:                       # run by the grader: keep it, print nothing
        said.reports.append(report)
        return 0 if match else 1
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
