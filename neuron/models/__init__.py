"""helexa.neuron.models."""
