"""The engine: one engine core per data-parallel replica (scheduler + executor), its process,
the group of replicas, and the clients the server and `LLM` reach it through."""
