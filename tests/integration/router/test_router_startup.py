"""A router process says it listens only once it has heard its neurons: a request sent the
moment `ROUTER LISTENING` is printed is served (processes started as `helexa up` starts them:
the neuron first, then the router)."""

from __future__ import annotations

from router_procs import router_over_fake


def test_a_request_sent_as_the_router_says_listening_is_served(tmp_path):
    with router_over_fake(tmp_path, "slow", "--first-report-delay", "1.0") as router:
        r = router.client(None).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert r.choices[0].message.content == "w0 "
