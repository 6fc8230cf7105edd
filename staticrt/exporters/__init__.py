"""Exporters: a model and its cache -> an artifact folder (see artifact.py)."""
