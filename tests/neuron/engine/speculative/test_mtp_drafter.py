"""Speculation with the checkpoint's MTP head (speculation = "mtp"), in the engine core on
tiny Qwen3.5 and Qwen3-Next checkpoints: greedy output is token-identical to plain decoding
alone and in a batch of 8 with other drafters and chunked prefill; a head that predicts
the target right gets its drafts accepted (fewer steps); the ledger is whole after; a
model without a head is refused and serves without drafting."""

from __future__ import annotations

import msgspec
import pytest
from support.engine import assert_whole, drive, with_drafter
from support.fla import StandInRecurrent
from support.mtp import SPEC, assert_right_head_drafted, craft_right_mtp_head, requests, spec_for

from helexa.kernels import fla_gdn as fla
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.engine.speculative.drafters import NgramDrafter, PerRequestDrafter
from helexa.neuron.engine.speculative.mtp import MtpDrafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

class _Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict]] = []

    def info(self, event: str, **kw) -> None:
        return None

    def warning(self, event: str, **kw) -> None:
        self.warnings.append((event, kw))

    def exception(self, event: str, **kw) -> None:
        raise AssertionError(f"{event} {kw}")


def test_a_head_that_predicts_the_target_has_its_drafts_accepted(tiny_checkpoint, tmp_path):
    model_dir = craft_right_mtp_head(tiny_checkpoint("qwen3_5", mtp=True), tmp_path / "crafted")
    news = requests(1, 3)
    plain = drive(EngineCore(spec_for(model_dir)), news, served=True)
    core = EngineCore(spec_for(model_dir, speculation="mtp", **SPEC))
    assert core.status().drafter == "mtp"
    assert_right_head_drafted(core, news, plain.tokens, plain.steps)


def test_on_fla_verification_and_its_settling_are_one_launch_each(tiny_checkpoint, tmp_path,
                                                                  monkeypatch):
    """With fla's recurrent kernel (stood in for on CPU), verification rows run as one kernel
    call per layer and step, their settling as one more, and the tokens are still plain
    decoding's: a right head's drafts accepted, an untrained head's mostly rejected (each
    settle then keeps the state past the first position or two of its row)."""
    untrained = tiny_checkpoint("qwen3_5", mtp=True)
    model_dir = craft_right_mtp_head(untrained, tmp_path / "crafted")
    news = requests(1, 3)
    plain = drive(EngineCore(spec_for(model_dir)), news, served=True)
    plain_untrained = drive(EngineCore(spec_for(untrained)), news, served=True).tokens
    kernel = StandInRecurrent()
    monkeypatch.setattr(fla, "_fla_recurrent", kernel)
    monkeypatch.setattr(fla, "fla_decode_available", lambda device: True)
    rejecting = EngineCore(spec_for(untrained, speculation="mtp", **SPEC))
    assert drive(rejecting, news, served=True).tokens == plain_untrained
    s = rejecting.status()
    assert 0 < s.spec_accepted_tokens < 0.5 * s.spec_drafted_tokens, s
    assert_whole(rejecting)
    core = EngineCore(spec_for(model_dir, speculation="mtp", **SPEC))
    assert "fla fused decode" in core.runner.linear_states.describe()
    assert_right_head_drafted(core, news, plain.tokens, plain.steps)
    verify = [c for c in kernel.calls if c["q"][1] > 1 and not c["final"]]
    settle = [c for c in kernel.calls if c["q"][1] > 1 and c["final"]]
    assert verify and settle
    # a row is its last token and up to spec_k drafts (fewer near max_tokens), padded together
    assert max(c["q"][1] for c in verify) == SPEC["spec_k"] + 1


def test_a_steps_greedy_verification_rows_are_read_back_together(tiny_checkpoint, monkeypatch):
    """Each greedy request's verification needs its rows' argmax on the host: a step reads
    them for all its greedy rows at once (on a GPU one wait, not one per request), and each
    request's verification gets exactly its own rows' argmax."""
    from helexa.neuron.engine.speculative import speculator as spec_mod
    from helexa.neuron.engine.speculative import verify as verify_mod

    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    news = requests(3, 6)
    want = drive(EngineCore(spec_for(model_dir)), news, served=True).tokens
    calls: list[tuple[list[int], list[int]]] = []
    real = spec_mod.verify_rows
    per_step: list[int] = []
    reads: list[int] = []
    real_read = verify_mod._read

    def recording(rows):
        before = len(reads)
        outs = real(rows)
        for row, out in zip(rows, outs, strict=True):  # its own rows' argmax, taken apart
            own = row.logits.argmax(-1).tolist()
            a = next((j for j, d in enumerate(row.draft) if d != own[j]), len(row.draft))
            calls.append((out, row.draft[:a] + [own[a]]))
        per_step.append(len(rows))
        assert len(reads) - before == 1  # every greedy row of the step: one read
        return outs

    monkeypatch.setattr(spec_mod, "verify_rows", recording)
    monkeypatch.setattr(verify_mod, "_read", lambda t: reads.append(1) or real_read(t))
    core = EngineCore(spec_for(model_dir, speculation="mtp", **SPEC))
    assert drive(core, news, served=True).tokens == want
    assert len(calls) > 10 and all(got == own for got, own in calls), calls[:3]
    assert max(per_step) == len(news), per_step  # a step's rows are verified in one call (verify.verify_rows)
    assert_whole(core)


def test_chained_head_passes_take_their_tokens_on_the_device(tiny_checkpoint, tmp_path,
                                                             monkeypatch):
    """Drafts 2..k: each head pass takes the pass before's argmax as device tokens (never
    read back between passes; rows that draft fewer drop out), and the drafts are what the
    same passes give with those tokens read back and sent as the rows' own: with a right
    head (whose drafts stand only where each row got its own token) the same drafted and
    accepted counts, the same output."""
    model_dir = craft_right_mtp_head(tiny_checkpoint("qwen3_5", mtp=True), tmp_path / "right")
    news = requests(4, 6)  # budgets of 6..29 tokens: near its end a request drafts fewer
    device_passes: list[int] = []

    def run(host_tokens: bool) -> tuple[dict, int, int]:
        core = EngineCore(spec_for(model_dir, speculation="mtp", **SPEC))
        runner = core.runner
        real = runner.execute_mtp

        def execute_mtp(seqs, hidden, tokens=None):
            if tokens is not None:
                if host_tokens:  # as before: the tokens read back and sent in the rows
                    for seq, t in zip(seqs, tokens.tolist(), strict=True):
                        seq.token_ids = [t]
                    tokens = None
                else:
                    device_passes.append(len(seqs))
            return real(seqs, hidden, tokens)

        monkeypatch.setattr(runner, "execute_mtp", execute_mtp)
        got = drive(core, news, served=True).tokens
        st = core.status()
        assert_whole(core)
        return got, st.spec_drafted_tokens, st.spec_accepted_tokens

    on_device, host = run(False), run(True)
    assert on_device == host and host[2] >= 0.9 * host[1], host[1:]
    assert device_passes and min(device_passes) < max(device_passes)  # rows dropped out


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_greedy_output_identical_alone_and_in_a_mixed_batch_of_8(tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch, mtp=True)
    news = requests(2, 8)
    want = drive(EngineCore(spec_for(model_dir)), news, served=True).tokens
    alone = EngineCore(spec_for(model_dir, speculation="mtp", **SPEC))
    got = drive(alone, news[:1], served=True).tokens
    assert got == {"r0": want["r0"]}
    assert alone.status().spec_drafted_tokens > 0
    assert_whole(alone)
    # batch of 8: MTP for most, prompt lookup for two, none for one; chunked prefill
    runner = ModelRunner(model_dir, num_blocks=200, block_size=4, max_num_seqs=8,
                         max_batched_tokens=40, num_state_slots=8)
    core = EngineCore(spec_for(model_dir, **SPEC), runner)
    mtp, ngram = MtpDrafter(runner, core.ensure_blocks), NgramDrafter(min_n=1)
    by_req = {n.req_id: (ngram if i in (2, 5) else mtp) for i, n in enumerate(news) if i != 7}
    with_drafter(core, PerRequestDrafter(by_req))
    got = drive(core, news, served=True).tokens
    assert got == want
    s = core.status()
    assert s.spec_drafted_tokens > 0  # (a random head's drafts are rarely right)
    assert not mtp.follows  # every request's drafter state went with it
    assert_whole(core)


def test_a_storm_with_mtp_sampling_and_aborts_leaves_the_ledger_whole(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_next", mtp=True)
    core = EngineCore(spec_for(model_dir, speculation="mtp", **SPEC, max_queue_depth=64,
                               max_per_principal=64))
    news = requests(3, 24)
    for i in range(1, 24, 4):  # sampled ones too: greedy drafts, verified by the rejection rule
        news[i] = msgspec.structs.replace(news[i], sampling=m.SamplingParams(
            temperature=0.8, top_k=20, seed=i))
    abandon = {n.req_id for n in news[::3]}
    finished: set[str] = set()
    streamed: dict[str, int] = {}
    inbound: m.ToEngine | None = m.ToEngine(new=news)
    for _ in range(5000):
        out = core.step(inbound)
        inbound = m.ToEngine()
        for u in out.updates:
            assert u.refused_code is None, u
            streamed[u.req_id] = streamed.get(u.req_id, 0) + len(u.new_token_ids)
            if u.finished is not None:
                finished.add(u.req_id)
            elif u.req_id in abandon and streamed[u.req_id] >= 2:
                inbound.aborts.append(m.Abort(req_id=u.req_id))
        core.pool.check()
        if not core.has_work and not inbound.aborts:
            break
    assert finished == {n.req_id for n in news}
    assert core.status().spec_drafted_tokens > 0
    assert not core.speculator.drafter.follows
    assert_whole(core)


def test_a_head_the_plan_gave_no_kv_is_refused(tiny_checkpoint):
    # The plan read a config.json without mtp_num_hidden_layers: no pool layer for the head.
    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    log = _Log()
    spec = msgspec.structs.replace(spec_for(model_dir, speculation="mtp", **SPEC),
                                   mtp_kv_layers=0)
    core = EngineCore(spec, logger=log)
    assert len(core.runner.kv_pools) == 1  # the target's one full-attention layer
    assert [e for e, _ in log.warnings] == ["engine.speculation_refused"]
    assert "plan counts no KV" in log.warnings[0][1]["reason"]
    assert core.status().drafter == "off"


def test_a_model_without_a_head_is_refused_and_serves_without_drafting(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    news = requests(4, 2)
    want = drive(EngineCore(spec_for(model_dir)), news, served=True).tokens
    log = _Log()
    core = EngineCore(spec_for(model_dir, speculation="mtp", **SPEC), logger=log)
    assert [e for e, _ in log.warnings] == ["engine.speculation_refused"]
    assert "no MTP head" in log.warnings[0][1]["reason"]
    assert core.status().drafter == "off"
    got = drive(core, news, served=True).tokens
    assert got == want and core.speculator.drafted_tokens == 0
    assert_whole(core)


class _Recording(MtpDrafter):
    """An MtpDrafter that records each request's context and its first draft."""

    def __init__(self, runner, ensure_blocks) -> None:
        super().__init__(runner, ensure_blocks)
        self.seen: list[tuple[list[int], int]] = []

    def propose_batch(self, reqs, ks):
        drafts = super().propose_batch(reqs, ks)
        self.seen += [(r.all_token_ids(), d.tokens[0]) for r, d in zip(reqs, drafts, strict=True)
                      if d.tokens]
        return drafts


@pytest.mark.parametrize("policy", ["every step", "adaptive"])
def test_first_drafts_are_the_heads_prediction_over_the_whole_context(tiny_checkpoint, policy):
    # What the head drafts after chunked prefill, decode and verification rows (its KV
    # filled as it follows the target, rejected positions overwritten) is what it
    # predicts in one pass over the context with the target's hidden states of that
    # context. "adaptive": the random head's drafts fail, so requests draft only a probe
    # every few steps and the head catches up on the positions between when they do;
    # a 90-token prompt's backlog is run once it reaches CATCH_UP_ROWS.
    from helexa.neuron.engine.seq_input import SeqInput

    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    runner = ModelRunner(model_dir, num_blocks=200, block_size=4, max_num_seqs=8,
                         max_batched_tokens=40, num_state_slots=8)
    limits = SPEC if policy == "every step" else {"spec_k": 3}
    core = EngineCore(spec_for(model_dir, **limits), runner)
    with_drafter(core, _Recording(runner, core.ensure_blocks))
    drafter = core.speculator.drafter
    assert isinstance(drafter, _Recording)
    news = requests(5, 3)
    if policy == "adaptive":
        news[0] = msgspec.structs.replace(news[0], max_tokens=60,
                                          prompt_token_ids=list(range(3, 93)))
    drive(core, news, served=True)
    assert len(drafter.seen) > 6
    fresh = ModelRunner(model_dir, num_blocks=64, block_size=4, max_num_seqs=1,
                        max_batched_tokens=256, num_state_slots=1)
    for context, first in drafter.seen[::2]:
        n = len(context) - 1  # the last token is not computed yet: its draft follows it
        table = list(range(-(-n // 4)))
        hidden = fresh.run_step([SeqInput(context[:n], 0, table, True, state_slot=0)],
                                keep_hidden=True).hidden
        logits, _ = fresh.execute_mtp([SeqInput(context[1:n + 1], 0, table, True)], hidden)
        assert int(logits.argmax()) == first


def test_a_head_that_fails_costs_drafts_not_output(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    news = requests(6, 3)
    want = drive(EngineCore(spec_for(model_dir)), news, served=True).tokens
    runner = ModelRunner(model_dir, num_blocks=200, block_size=4, max_num_seqs=8,
                         max_batched_tokens=40, num_state_slots=8)
    calls = 0
    real = runner.execute_mtp

    def flaky(seqs, hidden):  # every third pass of the head raises
        nonlocal calls
        calls += 1
        if calls % 3 == 0:
            raise RuntimeError("head failed")
        return real(seqs, hidden)

    runner.execute_mtp = flaky  # type: ignore[method-assign]
    failures: list[str] = []
    log = _Log()
    log.exception = lambda event, **kw: failures.append(event)  # type: ignore[method-assign]
    core = EngineCore(spec_for(model_dir, **SPEC), runner, logger=log)
    with_drafter(core, MtpDrafter(runner, core.ensure_blocks))
    got = drive(core, news, served=True).tokens
    assert got == want
    assert failures and set(failures) == {"engine.draft_failed"}
    assert core.status().spec_drafted_tokens > 0
    assert_whole(core)


def test_an_image_request_is_not_followed_by_the_head(tiny_checkpoint):
    """An image request never drafts (its positions are M-RoPE's, a drafter's 1-D): the
    MTP head must not run catch-up passes over its rows either (it ran one per step,
    over every prompt row, for drafts that could never come); a text request beside it is
    followed and drafts."""
    from support.vision import hf_inputs, image_inputs, make_image

    model_dir = tiny_checkpoint("qwen3_5", vision=True, mtp=True)
    img = make_image(64, 48, 1)
    ask = [{"role": "user", "content": [{"type": "image"},
                                        {"type": "text", "text": "What is it?"}]}]
    prompt = hf_inputs(model_dir, ask, [img])["input_ids"][0].tolist()
    image = m.NewRequest(req_id="img", prompt_token_ids=prompt, max_tokens=8,
                         sampling=m.SamplingParams(temperature=0.0),
                         images=image_inputs(model_dir, prompt, [img]))
    text = m.NewRequest(req_id="txt", prompt_token_ids=list(range(3, 40)), max_tokens=8,
                        sampling=m.SamplingParams(temperature=0.0))
    core = EngineCore(spec_for(model_dir, speculation="mtp", **SPEC))
    followed: list[str] = []
    real = core.speculator.drafter.observe

    def observe(step, kept):
        followed.extend(k[0].req_id for k in kept)
        return real(step, kept)

    core.speculator.drafter.observe = observe
    got = drive(core, [image, text], served=True).tokens
    assert len(got["img"]) == len(got["txt"]) == 8
    assert "img" not in followed and "txt" in followed
    assert_whole(core)
