"""The MS Controller (spec §4.2)."""
