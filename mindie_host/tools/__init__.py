"""Operator tools that MindIE Service ships beside the server: config upgrade, probes, certificates and secrets."""
