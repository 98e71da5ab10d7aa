"""Tests of the IR package: ops, text form, verifier, analyses, types."""
