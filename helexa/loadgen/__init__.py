"""`helexa bench`: the HTTP load client (prompts, load shapes, one record per request, stats,
report). Not the repository's bench/ scripts, which measure the engine in-process."""
