"""Executors: how the engine core reaches its ranks. `uniproc` runs the one rank in-process;
`multiproc` is a DP replica's leader rank, which drives its TP followers (`rank`) over the
control channel (`control`) and keeps lock step with the other replicas; `supervisor` watches
rank processes.

Every executor offers: `model_config`, `block_size`, `num_blocks`, `draft_window` and
`num_draft_blocks` (a window draft's own pool; 0 without one), `device_type` ("cuda" or
"cpu": the ranks' devices), `has_vision` and `encoder_bytes_per_token` (the ranks hold a
vision encoder, and the bytes per placeholder token of its outputs), `needs_lockstep` (the engine
loop must step every iteration, work or not), `execute_model(scheduler_output)`, `describe()`
(one report per rank of the replica) and `shutdown()`. Lock-step executors (DP replicas) also
offer `request_stop()`: replicas leave together (`ReplicasStopping` from the step where they
agree), never one left waiting in a collective.
"""


class ExecutorFailure(RuntimeError):
    """The ranks can no longer run steps (a rank died, hung or a collective failed): fatal for
    the engine, unlike an error in one request."""


class ReplicasStopping(Exception):
    """The DP replicas agreed to shut down: the step did not run, the engine loop ends."""
