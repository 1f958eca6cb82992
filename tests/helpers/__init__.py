"""Helpers shared by test modules (never test modules themselves)."""
