"""Floor 4, the other commands: `atom eval` (evaluate), `atom generate`, `atom plot`."""
