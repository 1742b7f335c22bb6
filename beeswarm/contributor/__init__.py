"""The contributor side: serving a span of layers to the swarm."""
