"""helexa.neuron.engine."""
