"""`beeswarm serve`: an OpenAI-compatible HTTP API over the swarm."""
