"""The entry side: sessions through the stages of a route (`dataplane`), routes and failover (`swarm`), audits
and receipts of the work served, chat sessions, the swarm as a status client sees it."""
