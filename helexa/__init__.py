"""helexa: serve LLMs from a fleet of GPU hosts (shared code of router and neuron)."""

__version__ = "0.1.0"
