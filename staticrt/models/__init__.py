"""The model: one decoder for the four families, its presets, and weight quantization (the spec, torch-free,
and its application, with GGUF's kept blocks)."""
