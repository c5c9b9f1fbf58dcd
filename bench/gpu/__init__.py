"""The GPU check: one prepared run on a machine with a CUDA GPU that tests the CUDA path, times the
engine against Hugging Face `generate` and HTTP against in-process, and judges the targets.

    bench/gpu/run.sh             on the GPU machine (installs the carried wheels first)
    bench/gpu/run.sh --dry-run   here, on CPU: every step at small shapes

bench/gpu/README.md says how to prepare and make the device call; check.py holds the plan.
"""
