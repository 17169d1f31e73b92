"""Experts as units a user brings: the conformance check every served expert passes."""
