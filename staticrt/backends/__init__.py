"""Backends: each runs the generation loop's steps on one engine. generation/generator.py names and builds
them, importing each only when asked for, so a deploy path that needs no torch never imports it."""
