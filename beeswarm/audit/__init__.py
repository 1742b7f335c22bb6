"""Audits: catch a stage that computes something other than its span, with evidence anyone can check.

`commitments`: digests and signatures on the data path; `retention`: what a stage keeps for reveals;
`replay`: recomputing revealed steps and the tolerance outputs must meet; `evidence`: examining a
reveal against commitments and judging an accusation; `layers` and `pieces` (pure): audits a layer
at a time, against a stage's signed boundaries; `probation` (pure): how often a stage is audited,
from what the swarm knows of its layers. The entry's audits as one unit (`auditor`): a book (`book`,
pure), a runner (`runner`, with peer auditors: `peer`) and a reporter to the coordinator (`reporter`).
`faults`: the dishonest stage modes tests switch on.
"""

DEFAULT_RATE = 0.01  # of each stage's steps audited by an entry (cost and detection: BENCHMARKS.md, Audits)
