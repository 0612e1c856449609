"""The MS Coordinator (spec §4.3)."""
