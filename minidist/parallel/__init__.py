"""One strategy per file: data_parallel.py, then tensor, pipeline, ZeRO, FSDP in later lessons."""
