"""Floor 4, a run: the training loop (`train`), its log (`run_log`, `loggers`), Ctrl+C
(`signals`), the guard against diverged or poisoned weights (`guard`) and the config a run
loads (`run_config`, Hugging Face sections expanded)."""
