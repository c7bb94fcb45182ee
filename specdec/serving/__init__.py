"""Serving a request over the engine: the request parser, request state and stop rules, the detokenizer, the per-request loop, the in-process backend and engine.
May import: specdec_wire, specdec.config, specdec.errors, specdec.engine."""
