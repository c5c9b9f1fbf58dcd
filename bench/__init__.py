"""The benchmarks, a source-tree package: run each from the repository root as
`python -m bench.<name>` (engine_throughput, serving, memory, forward_kernels, sampling, sampled,
native_ab, gelu, interference, load). Not part of the installed `nanoserve`, and never imported by
`model` or `service`: it measures them. Nothing here asserts a speed; results land in
bench/results/.

Imports run one way, from the scripts down to the pieces they share:
  shapes (the model shapes and prompts), record (results files, machine, load), timing, peak,
  throughput_runs (what a run records)
  <- limits (the machine's limits), peer_runs (each peer's timed batch), llama_peer
  <- peers (a process per peer), levers <- engine_throughput_report <- engine_throughput.
"""
