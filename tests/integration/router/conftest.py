"""Real `helexa router` + real `helexa neuron` processes, shared across the session.

- `na`, `nb`: both serve `tiny` (na's pool is half of nb's, so the router's
  /v1/models shows na's smaller limits); nb also serves `tiny-ngram` (the same
  checkpoint, n-gram speculation set on its [[models]] entry); one request per principal at a time
  (max_per_principal 1), which makes a refusal → failover deterministic.
  na also serves `qwen35`: a tiny Qwen3.5 hybrid with Qwen3.5's chat template
  (XML tool calls).
- `nt`: serves `tight` (fat KV tokens in a 1 MiB pool, one request in flight,
  a 0.1 s wait for it) for 429 and 503 overloaded, and has `lazy` in its catalogue
  (not preloaded) for on-demand loads; `tiny-grow` (the tiny checkpoint, a 64-token
  context, 8 tokens of default output) for a reservation's growth.
- the router: require_auth with a keys file (alice may cause loads), alias
  `helexa/balanced` → tiny, a short load wait, fast reconnects.

Clients: the official openai client with max_retries=0 (`client(principal)`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
import pytest
import tomli_w

sys.path.insert(0, str(Path(__file__).parent))

from router_procs import (  # noqa: E402
    PRINCIPALS,
    TOKEN,
    RouterProcess,
    key_of,
    neuron_cfg,
    router_config,
    start_router,
    wait_for,
)
from support.neuron import (  # noqa: E402
    NeuronProcess,
    start_neurons,
    stop_all,
    write_neuron_config,
)

from helexa.router.auth import hash_key  # noqa: E402


@pytest.fixture(scope="session")
def rdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("router-int")
    (d / "token").write_text(TOKEN + "\n")
    (d / "keys.toml").write_text(tomli_w.dumps(
        {"keys": {hash_key(key_of(p)): p for p in PRINCIPALS}}))
    return d


@pytest.fixture(scope="session")
def neurons(rdir: Path, tiny_model_dir: Path,
            tiny_checkpoint: Callable[..., Path]) -> Iterator[dict[str, NeuronProcess]]:
    # 4 KiB of KV per token: 1,024 tokens in nt's 4 MiB. The wide MLP (~100 MB of fp32
    # weights read a token) keeps a 1,000-token request in flight for seconds on any CPU,
    # so the 429 / 503 tests' holder cannot finish before their second request arrives.
    fat = tiny_checkpoint("qwen3", num_heads=4, num_kv_heads=4, head_dim=64, hidden_size=512,
                          intermediate_size=8192)
    # A short thinking budget (high 16 tokens, medium 8, low 2) keeps thoughts testable.
    tiny = [{"id": "tiny", "path": str(tiny_model_dir), "thinking_budget_tokens": 16}]
    qwen35 = tiny_checkpoint("qwen3_5", chat_template="qwen3_5")
    configs = {
        "na": neuron_cfg("na", tiny + [{"id": "qwen35", "path": str(qwen35)}], 1,
                         max_per_principal=1, max_in_flight=4),
        # tiny-ngram: speculation set on its own [[models]] entry (usage reports drafts)
        "nb": neuron_cfg("nb", tiny + [{"id": "tiny-ngram", "path": str(tiny_model_dir),
                                        "speculation": "ngram"}],
                         2, max_per_principal=1, max_in_flight=4),
        "nt": neuron_cfg("nt", [{"id": "tight", "path": str(fat)},
                                 {"id": "lazy", "path": str(tiny_model_dir), "preload": False},
                                 # a 64-token context and an 8-token default output budget:
                                 # a reply without max_tokens grows 7 times in a second
                                 {"id": "tiny-grow", "path": str(tiny_model_dir),
                                  "context": 64, "profile": "short"}],
                          4, max_per_principal=1, max_in_flight=1, max_queue_depth=1,
                          # far under the seconds the 1,000-token request holding the
                          # model takes, so a queued request times out before it ends
                          kv_max_wait_secs=0.1),
    }
    configs["nt"]["profiles"] = {"short": {"default_output_tokens": 8}}
    started = start_neurons({name: (write_neuron_config(rdir / f"{name}.toml", cfg),
                                    rdir / f"{name}.log") for name, cfg in configs.items()})
    try:
        yield started
    finally:
        stop_all(started.values())


@pytest.fixture(scope="session")
def router(rdir: Path, neurons: dict[str, NeuronProcess]) -> Iterator[RouterProcess]:
    path = rdir / "router.toml"
    path.write_text(tomli_w.dumps(router_config(rdir, neurons)))
    r = start_router(path)
    try:
        wait_for(lambda: all(n["healthy"] for n in httpx2.get(r.url + "/health").json()
                             ["neurons"].values()), timeout=30)
        yield r
    finally:
        assert r.stop() == 0
