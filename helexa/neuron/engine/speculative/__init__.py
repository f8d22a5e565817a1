"""Speculative decoding: drafters propose k tokens, the target verifies them in one step.

Which speculation applies to a model is helexa/config/speculation.py's
(`resolve_speculation`); the engine runs under it as part of its limits.

- drafters.py: the Drafter base class and its kinds (n-gram prompt lookup, test oracles);
- mtp.py: the checkpoint's MTP head as a drafter; mtp_passes.py: the head's passes;
- draft_model.py: a smaller checkpoint of the same tokenizer as a drafter, and its loading;
- setup.py: the drafters a model can run, and the one a speculation names;
- policy.py: how many tokens to draft per request this step (0 = off), from load and acceptance;
- verify.py: which drafted tokens the target accepts, greedy or by the rejection rule;
- speculator.py: the engine's side: per step the drafts, after it the verification and counts.

The engine core (engine_core.py) holds one Speculator: see docs/speculation.md.
"""
