"""Shared training pieces for the FSDP2 workers (actor, critic, reference)."""
