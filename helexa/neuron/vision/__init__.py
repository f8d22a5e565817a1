"""Images into a vision-language model, beside its tokenizer: the checkpoint's image
processor (processor.py: resize, token counts), the tower's input layout (patches.py),
a prompt's image placeholders expanded to their tokens (prompt.py)."""
