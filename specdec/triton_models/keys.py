"""Proof that a call to the verifier or the drafter comes from the speculative loop: a
per-server secret the launcher generates at start-up into this environment variable (never
logged), sent by the loop in the INTERNAL_KEY input. Standard library only: the launcher
reads it."""

INTERNAL_KEY = "internal_key"
INTERNAL_KEY_ENV = "SPECDEC_INTERNAL_KEY"
