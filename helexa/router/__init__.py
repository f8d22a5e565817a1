"""helexa.router."""
