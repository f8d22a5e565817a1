"""Test support, kept out of the product package: daemon helpers and clients (neuron.py),
the in-process engine stand-in (fake_engine.py), a model-free runner (fake_runner.py) and
a greedy driver over a ModelRunner (greedy.py). Benchmarks import it by adding tests/ to
sys.path."""
