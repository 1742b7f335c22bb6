"""Protocol ids (libp2p stream protocols) and pubsub topic names."""
from __future__ import annotations

SESSION = "/beeswarm/session/1"  # request/response: open and close sessions on a stage
STEP = "/beeswarm/step/1"  # channel: steps pushed entry -> s1 -> ... -> sN
RESULT = "/beeswarm/result/1"  # channel: results and step errors back to the entry
PROBE = "/beeswarm/probe/1"  # channel: link probes (pings, bulk transfers)
AUTH = "/beeswarm/auth/1"  # request: private-swarm challenge
PLAN = "/beeswarm/plan/1"  # request: the coordinator's current signed plan
MEMBERS = "/beeswarm/members/1"  # request: a member's beat to the coordinator, answered with the view
AUDIT = "/beeswarm/audit/1"  # request: a stage reveals what it computed for one of the asker's sessions
PEER_AUDIT = "/beeswarm/peer-audit/1"  # request: an entry asks a contributor to audit a stage of its session
EVIDENCE = "/beeswarm/evidence/1"  # request: an entry hands the coordinator evidence against a stage
PASSED = "/beeswarm/passed/1"  # request: an entry tells the coordinator a stage passed its audit of a session
RECEIPT = "/beeswarm/receipt/1"  # request: an entry hands a stage its signed receipt for a session
CREDITS = "/beeswarm/credits/1"  # request: stages hand receipts to the coordinator; anyone asks for the ledger
DIALBACK = "/beeswarm/dialback/1"  # request: dial the asker back on its ports, say where it came from

MEMBERS_TOPIC = "members"  # heartbeats carrying NodeInfo
COORDINATOR_TOPIC = "coordinator"  # leases and signed plans


def topic(swarm: str, name: str) -> str:
    return f"beeswarm/{swarm}/{name}"
