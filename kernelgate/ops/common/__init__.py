"""Helpers shared by several op families (fp8 formats, varlen metadata); no ops here."""
