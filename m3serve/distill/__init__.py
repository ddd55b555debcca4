"""Training the speculative drafts against the target model: the data (the engine's greedy
continuations and the target's features), EAGLE3, MTP and DSpark distillation, and random drafts
of the right shapes for tests (`make-draft`)."""
