"""Floor 2: the resident engine, plain PyTorch with the whole model on one device: the
reference every swapped run is checked against."""
