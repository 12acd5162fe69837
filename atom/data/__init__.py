"""Floor 2: training inputs. `tokens` holds the token shards, their flags and the windows
a step reads."""
