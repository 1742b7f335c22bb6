"""The entry side: sessions over routes through the swarm, failover, chat sessions, the local oracle."""
