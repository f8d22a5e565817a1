"""Which drafters a model can run, and the one a speculation names.

A `speculation = "draft:<id>"` model loads its draft checkpoint before its own
runner (runner.py load_runners; draft_model.py), because a CUDA target sizes its
pool counting the draft's share of every block. `Drafters` is made once the
target's pool is sized: the draft runner takes the target's block count and
becomes a drafter. `drafter_for(speculation)` is then the drafter a
Speculation names (helexa/config/speculation.py): none for off, prompt lookup, the
MTP head of the target (mtp.py), or the draft model loaded with it. A drafter that
cannot run here raises ValueError saying why; the Speculator logs it and serves
without drafting.
"""

from __future__ import annotations

from collections.abc import Callable

from helexa.config.speculation import Speculation
from helexa.neuron.engine import messages
from helexa.neuron.engine.request import Request
from helexa.neuron.engine.runner import Runners
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.engine.speculative.draft_model import DraftModelDrafter
from helexa.neuron.engine.speculative.drafters import Drafter, NgramDrafter
from helexa.neuron.engine.speculative.mtp import MtpDrafter

EnsureBlocks = Callable[[Request, int], None]  # draw req's blocks until they cover n tokens


class Drafters:
    """The drafters of one model: the draft model it loaded, and how to make the others."""

    def __init__(self, runners: Runners, ensure_blocks: EnsureBlocks, spec: EngineSpec,
                 limits: messages.Limits) -> None:
        """`runners`: the target's (its pool sized) and a draft model's, whose layers now
        take the target's block count (draft_model.py)."""
        self.runner, self.ensure_blocks = runners.target, ensure_blocks
        self._draft_runner = runners.draft
        self.draft: DraftModelDrafter | None = None  # kept while speculation switches away
        if runners.draft is not None:
            runners.draft.reset_kv(runners.target.num_blocks, spec.kv_dtype)
            self.draft = DraftModelDrafter(spec.draft_model_id, runners.draft, ensure_blocks,
                                           max_batched_tokens=limits.max_batched_tokens)

    def reset_kv(self, num_blocks: int, kv_dtype: str) -> None:
        """The target re-planned its pool: the draft's layers follow its blocks."""
        if self._draft_runner is not None:
            self._draft_runner.reset_kv(num_blocks, kv_dtype)

    def drafter_for(self, speculation: Speculation) -> Drafter | None:
        """The drafter `speculation` names; None for off. ValueError where it cannot run
        here: a draft model not loaded with this model, an MTP head it lacks (mtp.py)."""
        method = speculation.method
        if method == "off":
            return None
        if method == "ngram":
            return NgramDrafter()
        if method == "draft":
            if self.draft is not None and self.draft.name == speculation.speculation:
                return self.draft
            raise ValueError(f"speculation = {speculation.speculation!r}: that draft model was "
                             "not loaded with this model (a draft model loads with its target, "
                             "from the target's [[models]] speculation at start; "
                             "docs/speculation.md)")
        return MtpDrafter(self.runner, self.ensure_blocks)  # method == "mtp"
