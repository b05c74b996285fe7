"""GLANCE export toolkit: adapters, draft head, exporters and audits (needs torch)."""

__version__ = "0.1.0"
