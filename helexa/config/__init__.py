"""Configuration: the msgspec schema (`schema`), reading and validating files (`load`), and the
generated reference (`doc`, docs/config.md)."""
