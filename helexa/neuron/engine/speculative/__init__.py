"""Speculative decoding: drafters propose k tokens, the target verifies them in one step.

- drafters.py: the Drafter interface and its kinds (n-gram prompt lookup, test oracles);
- policy.py: how many tokens to draft per request this step (0 = off), from load and acceptance;
- verify.py: which drafted tokens the target accepts, greedy or by the rejection rule.

The engine core (engine_core.py) wires them: see docs/speculation.md.
"""
