"""Text around the token ids, all torch-free: the tokenizer, chat templates rendered in jinja2's sandbox,
and generation_config.json's defaults."""
