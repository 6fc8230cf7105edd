"""What comes from disk: checkpoint folders (safetensors, config.json, the tokenizer beside them) into a
`Decoder`, and GGUF files converted into such folders."""
