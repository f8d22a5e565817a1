"""What a checkpoint is, read without torch: its config.json, GGUF metadata and families, and the
byte formulas `helexa plan`, the neuron and the engine all size memory with."""
