"""The GPU self-check's parts: `python -m tools.gpu_check OUT_DIR` runs them (its
sections, the timed steps, the compile comparison, bounded child processes)."""
