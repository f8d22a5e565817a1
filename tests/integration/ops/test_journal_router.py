"""`helexa journal concurrency --component router` over a real router's log."""

from __future__ import annotations

import openai
import pytest
from router_procs import wait_for

from helexa.cli.journal import Journal, format_report


def test_router_spans_all_end_including_a_neurons_context_refusal(ops):
    client = openai.OpenAI(base_url=ops.url + "/v1", api_key=ops.keys["alice"], max_retries=0,
                           timeout=60)
    msgs = [{"role": "user", "content": "hello"}]
    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3)
    # Over the context only as the neuron counts: the router's lower bound from the text's
    # bytes lets it through, so it logs request.start before the neuron refuses.
    long_msgs = [{"role": "user", "content": " ".join(["harbour lights"] * 100)}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=long_msgs, max_tokens=4000)
    assert e.value.code == "context_length_exceeded"
    rid = e.value.response.headers["x-request-id"]
    log = ops.router.log_path
    wait_for(lambda: f'"req_id":"{rid}"' in log.read_text() and "request.rejected"
             in log.read_text().split(rid)[-1], timeout=10)
    # the router had started it (it has no tokenizer: the neuron refused it)
    assert any(rid in line and '"request.start"' in line for line in log.read_text().splitlines())
    j = Journal(component="router")
    j.read(log.read_bytes().splitlines())
    total = j.total()
    report = format_report(j)
    assert total.start_only == 0, report  # every request the router started, it ended
    assert total.rejected["context_length_exceeded"] >= 1 and total.finished >= 1, report


def test_the_journal_leaves_out_a_bench_run_under_its_own_key(ops, tmp_path):
    from helexa.loadgen.bench import main as bench

    def journal(exclude: frozenset[str]) -> Journal:
        j = Journal(component="neuron", exclude=exclude)
        for n in ops.neurons.values():
            j.read(n.log_path.read_bytes().splitlines())
        return j
    before = journal(frozenset({"bench"})).total().excluded
    assert bench(["--url", ops.url, "--model", "tiny", "--scenario", "chat:8", "--requests", "2",
                  "--max-tokens", "2", "--api-key", ops.keys["bench"], "--principal", "bench",
                  "--no-progress", "--out", str(tmp_path / "b.jsonl")]) == 0
    # the key decides the principal: the neurons logged these requests as `bench`
    wait_for(lambda: journal(frozenset({"bench"})).total().excluded >= before + 2, timeout=10)
