"""Inference sessions: the generation loop, sampling, and (later) routes through the swarm."""
