"""Prefill/decode disaggregation: KV connectors that move a request's prompt KV (both cache
groups: main K/V and the key-only index cache, every layer) from a prefill worker to a decode
worker.

`params` validates the `kv_transfer_params` of a request (vLLM's NIXL wire protocol),
`messages` holds every msgspec type that crosses a process (side channel, scheduler -> worker
metadata, worker -> scheduler results), `side_channel` is the producer's ZMQ endpoint (claims,
metadata handshakes, releases), `connector` the two halves as a `core.kv_connector` connector
("nixl"; the scheduler and the ranks see only that interface),
`layout` the descriptor arithmetic (block and head mapping between TP layouts), and `nixl_*`
the NIXL transport behind it. A second transport implements the same two connector halves.
"""
