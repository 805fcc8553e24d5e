"""One turn, protocol-independent: the runner (`runner`, its types in `protocol`, its record in `ledger`),
mid-stream failover (`failover`, its stream guard `guard`), the output pipeline (`output`), in-flight
writes (`inflight`), prefix reuse (`sessions`), background logprob recomputation, auxiliary models, and
the sweep for a dead replica's running turns."""
