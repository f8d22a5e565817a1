"""kv.prefix_sharing in the engine: under "principal" (the default) a principal's cached
blocks are found only by that principal, so cached_tokens cannot tell B what A sent;
under "global" anyone's are. Prompt-only and output blocks alike, and the ledger whole."""

from __future__ import annotations

import pytest
from support.engine import assert_whole, drive
from support.fake_runner import FakeRunner, fake_continuation

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec

VOCAB = 100
SECRET = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3, 3]  # three full blocks of 4, one token over


def core_with(prefix_sharing: str) -> EngineCore:
    spec = EngineSpec(model_id="fake", num_blocks=64, block_size=4, context=256,
                      bytes_per_token=2, prefix_cache=True, prefix_sharing=prefix_sharing,
                      limits=m.Limits(anon_max_in_flight=64))
    return EngineCore(spec, FakeRunner(VOCAB, 64, 4))


def ask(core: EngineCore, rid: str, prompt: list[int], principal: str) -> tuple[int, list[int]]:
    """(cached_tokens, output tokens) of one greedy request run to its end."""
    req = m.NewRequest(req_id=rid, prompt_token_ids=prompt, max_tokens=3,
                       sampling=m.SamplingParams(temperature=0.0), principal=principal)
    tokens, _, admitted, _ = drive(core, m.ToEngine(new=[req]))
    return admitted[rid].cached_tokens, tokens[rid]


def expected(prompt: list[int], n: int) -> list[int]:
    return fake_continuation(prompt, n, VOCAB)


def test_a_guessed_prompt_hits_nothing_of_another_principal_by_default():
    core = core_with("principal")
    assert ask(core, "a1", SECRET, "alice")[0] == 0
    cached, tokens = ask(core, "b1", SECRET, "bob")  # bob guesses alice's prompt right
    assert cached == 0 and tokens == expected(SECRET, 3)
    assert ask(core, "a2", SECRET, "alice")[0] == 12  # alice still finds her own blocks
    assert ask(core, "b2", SECRET, "bob")[0] == 12  # and bob, now, his own
    assert_whole(core)


def test_output_blocks_and_short_prompts_are_salted_too():
    core = core_with("principal")
    short = [5, 6, 1]  # under one block: its chain starts in the output blocks
    _, out = ask(core, "a1", short, "alice")
    turn2 = short + out + [9, 9]  # 8 tokens: two full blocks, both filed while a1 ran
    assert ask(core, "b1", turn2, "bob")[0] == 0
    assert ask(core, "a2", turn2, "alice")[0] == 4  # the last block is recomputed for logits
    assert_whole(core)


@pytest.mark.parametrize("mode, bob_hit", [("principal", 0), ("global", 12)])
def test_global_sharing_lets_any_principal_hit(mode: str, bob_hit: int):
    core = core_with(mode)
    ask(core, "a1", SECRET, "alice")
    assert ask(core, "b1", SECRET, "bob")[0] == bob_hit
    assert_whole(core)
