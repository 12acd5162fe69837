"""Networks on one host and the fault soak: `tools.net.shape` (kernel-shaped links between
network namespaces), `tools.net.wire` (a lossy wire in user space), `tools.net.soak` (a group
trained through crashes, partitions, full disks and restarts, checked against invariants)."""
