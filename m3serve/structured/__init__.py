"""Structured outputs: compiling a request's constraint (JSON schema, regex, choice, grammar, the
forced tool-call markup) with xgrammar, checked by the engine at admission and applied as token
masks by the sampling rank."""
