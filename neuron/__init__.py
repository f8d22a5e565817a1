"""helexa.neuron."""
