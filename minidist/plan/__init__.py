"""The cost model: every formula a lesson prints, once, and the planner built on them.

Layers of this package (each imports only those above it):
  rules        the small rules the engine follows and the planner counts (chunk_bounds,
               padded_vocab, assign_buckets, segments, parameter_count): the engine
               imports them from here
  collectives  bytes each rank sends in a ring (exact, uneven chunks included) and the
               alpha-beta time of each all-reduce algorithm
  memory       model states by ZeRO stage and precision; activations per layer
  flops        FLOPs per token and per step (PaLM; Narayanan et al.), model and hardware
  gemm         how fast one matrix product runs for its shape (tiles, waves, bytes)
  pipeline     bubbles, micro-batches in flight, point-to-point volume
  traffic      bytes per rank per step of every strategy (DP, TP/SP, PP, ZeRO/FSDP, MoE)
  context      context parallelism's bytes per rank (ring, Ulysses, all-gather) and
               attention work per rank, exact and the papers'
  step_bytes   those bytes for one GPU of a planned layout, by group, CP's included (what
               cost times)
  cluster      GPUs and links from their datasheets
  layout       the model's shape, a layout of it, and the rules a layout must keep
  cost         one layout on one cluster (context parallelism included): memory, FLOPs,
               communication, step time, MFU
  search       every legal layout, best first; `python -m minidist.plan`
  experts      mixture of experts: expert parallelism added to a dense estimate
  choose       the fastest layout under a memory cap (exercise 12.4)
  published    published runs and the planner's predictions of them (lesson 12)
  plot         step time against memory per GPU as a PNG (stdlib only)

The package imports nothing of minidist's outside plan/ and no mpi4py (tests/test_layers.py
holds it): `python -m minidist.plan` is arithmetic, and comm, the strategies and the
calculator import plan, never the other way. Lesson 12's --measure, the planner against
this machine run as a time-scaled cluster, trains lesson 07 and so lives with the lessons
(minidist/lessons/plan_measure.py and cpu_cluster.py).
"""
