"""The cost model: every formula a lesson prints, once, and the planner built on them.

Layers of this package (each imports only those above it):
  collectives  bytes each rank sends in a ring (exact, uneven chunks included) and the
               alpha-beta time of each all-reduce algorithm
  memory       model states by ZeRO stage and precision; activations per layer
  flops        FLOPs per token and per step (PaLM; Narayanan et al.), model and hardware
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
  choose       the fastest layout under a memory cap (exercise 12.4)
  published    published runs and the planner's predictions of them (lesson 12)
  cpu_cluster  this machine's FLOP/s, memory bandwidth and message cost as a planner Cluster
  measure      lesson 07's layouts timed under the link model (minidist/comm/links.py)
               beside the planner's predictions for them (lesson 12 --measure)
"""
