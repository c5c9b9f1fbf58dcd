"""The benchmarks, a source-tree package: run each from the repository root as
`python -m bench.<name>` (engine_throughput, serving, server_vs_llama, memory, forward_kernels,
sampling, sampled, native_ab, gelu, interference, load, llama_cpp_build). Not part of the installed
`nanoserve`, and never imported by `model` or `service`: it measures them. Nothing here asserts a
speed; results land in bench/results/.

Imports run one way, from the scripts down to the pieces they share:
  shapes (the model shapes and prompts), record (results files, machine, load), timing, peak,
  throughput_runs (what a run records)
  <- limits (the machine's limits), peer_runs (each peer's timed batch), llama_peer
  <- peers (a process per peer), levers <- engine_throughput_report <- engine_throughput.
llama.cpp's own programs: llama_cpp_build (built from source) <- gguf_convert (its converter)
  <- llama_batched (the engine benchmark's peer), llama_server (the server as a process)
  <- server_vs_llama_report <- server_vs_llama.
"""
