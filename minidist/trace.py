"""Timelines as Chrome trace event JSON, which chrome://tracing and https://ui.perfetto.dev open.

    mpirun -n 4 python -m minidist.lessons.04_pipeline_parallel --trace pipeline.json

One track per rank; every event is a complete event ("ph": "X") with a start and a
duration in microseconds (the Trace Event Format's unit). Written as plain JSON.
"""
import json


def chrome_trace(tracks, path, process="minidist"):
    """Write tracks {rank: [(name, start_s, end_s, category)]} to `path`; return the dict written."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": process}}]
    for rank in sorted(tracks):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": int(rank),
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": int(rank),
                       "args": {"sort_index": int(rank)}})
        for name, t0, t1, cat in tracks[rank]:
            events.append({"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": int(rank),
                           "ts": round(t0 * 1e6, 3), "dur": round((t1 - t0) * 1e6, 3)})
    doc = {"traceEvents": events, "displayTimeUnit": "ms"}
    with open(path, "w") as f:
        json.dump(doc, f)
    return doc
