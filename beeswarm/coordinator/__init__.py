"""Who serves which layers, and on whose word: the cluster model and the exact planner (pure), the election,
the plan follower every node runs, the coordinator an elected contributor runs, and the credit ledger."""
