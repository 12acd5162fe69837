"""Floor 0, the ground: errors, sizes, devices, the engine protocol, threads, atomic
directories. No behaviour beyond validation; imports nothing above itself."""
