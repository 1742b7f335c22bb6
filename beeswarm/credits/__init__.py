"""Credits: serving earns them, generating spends them, and a full stage admits whoever holds more first.

`ledger` (pure): the coordinator's book of balances and the rules a receipt must meet; `receipts`: signing and
verifying receipts and ledgers; `entry_receipts`: an entry's receipts for the work stages served its sessions;
`stage_receipts`: a stage's, taken from its entries and handed in to the coordinator. The coordinator records
and publishes them (`coordinator.credit_keeper`); the messages are `protocol.credits`.
"""
