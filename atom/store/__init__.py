"""Floor 1: what a run leaves on disk. `checkpoint` writes and reads atomic safetensors
checkpoints; `run_dir` decides which run directory a command writes and what continuing
from a step does to it."""
