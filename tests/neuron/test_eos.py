"""EOS ids: one rule (helexa.neuron.tokenizer.eos_token_ids) for the daemon and the grammar.

A checkpoint may name its eos in generation_config.json, config.json or only
as tokenizer_config.json's `eos_token`. The daemon stops a request at the ids
it reads; a grammar (response_format, a forced tool call) ends by allowing
only eos once it is complete. Both must read the same ids, or a constrained
request ends at a token the daemon does not know as eos.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engine import assert_whole, drive
from support.fake_runner import FakeRunner

from helexa import grammar
from helexa.fixtures.tiny import init_tiny
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.tokenizer import Tokenizer, eos_token_ids

VOCAB = 512
GREEDY = m.SamplingParams(temperature=0.0)


def drop_eos_id(path: Path) -> None:
    cfg = json.loads(path.read_text())
    cfg.pop("eos_token_id")
    path.write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def eos_only_in_tokenizer_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with its eos named only by tokenizer_config.json's eos_token."""
    d = init_tiny(tmp_path_factory.mktemp("eos") / "m")
    drop_eos_id(d / "generation_config.json")
    drop_eos_id(d / "config.json")
    assert json.loads((d / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    return d


def test_the_ids_are_read_from_every_file_in_one_order(tmp_path: Path) -> None:
    d = init_tiny(tmp_path / "m")
    tok = Tokenizer.from_dir(d)
    im_end, endoftext = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    # generation_config.json [im_end, endoftext], config.json im_end, tokenizer_config im_end
    assert eos_token_ids(d) == tok.eos_token_ids == [im_end, endoftext]
    drop_eos_id(d / "generation_config.json")
    assert eos_token_ids(d) == Tokenizer.from_dir(d).eos_token_ids == [im_end]


def test_eos_only_in_tokenizer_config_is_found_by_the_daemon_and_the_grammar(
        eos_only_in_tokenizer_config: Path) -> None:
    d = eos_only_in_tokenizer_config
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == eos_token_ids(d) == [tok.token_to_id("<|im_end|>")]


class EosFirstRunner(FakeRunner):
    """The fake runner's paged KV, with logits that rank `eos` first, then `digit`, then
    every other token alike: a model that ends at once wherever eos is allowed."""

    def __init__(self, eos: int, digit: int) -> None:
        super().__init__(VOCAB, 256, 16)
        self.eos, self.digit = eos, digit

    def execute(self, seqs: list[Any]) -> torch.Tensor:
        logits = torch.zeros_like(super().execute(seqs))
        logits[:, self.digit], logits[:, self.eos] = 5.0, 10.0
        return logits


@pytest.mark.parametrize("constraint", [
    grammar.json_schema({"type": "integer"}),  # response_format json_schema, open-ended
    grammar.Constraint(kind="regex", source="7+"),
], ids=["json_schema_integer", "regex"])
def test_a_request_ends_at_the_same_eos_with_and_without_a_grammar(
        eos_only_in_tokenizer_config: Path, constraint: grammar.Constraint) -> None:
    """Without a grammar the request ends at its first token, eos. With one that must
    write a digit first and may then end, it ends at that same eos right after: a grammar
    that read another eos would allow that one instead, and the request would go on
    writing 7s to max_tokens."""
    d = eos_only_in_tokenizer_config
    tok = Tokenizer.from_dir(d)
    [eos] = tok.eos_token_ids
    [seven] = tok.encode("7", add_special_tokens=False)
    spec = EngineSpec(model_id="t", model_dir=str(d), num_blocks=256, block_size=16,
                      context=1024, bytes_per_token=2, limits=m.Limits(anon_max_in_flight=8))
    core = EngineCore(spec, EosFirstRunner(eos, seven))
    prompt = tok.encode("A number:")
    # What the servicer sends: the daemon's eos ids as stop ids.
    free = m.NewRequest(req_id="free", prompt_token_ids=prompt, max_tokens=20,
                        stop_token_ids=tok.eos_token_ids, sampling=GREEDY)
    held = m.NewRequest(req_id="held", prompt_token_ids=prompt, max_tokens=20,
                        stop_token_ids=tok.eos_token_ids, sampling=GREEDY,
                        grammar=grammar.grammar_text(constraint))
    tokens, final, _, _ = drive(core, m.ToEngine(new=[free, held]))
    assert tokens["free"] == [eos] and final["free"].finished == m.FinishReason.STOP
    assert tokens["held"] == [seven, eos], tokens["held"][-5:]
    assert final["held"].finished == m.FinishReason.STOP
    assert_whole(core)
    core.close()
