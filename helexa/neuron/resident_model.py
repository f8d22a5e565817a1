"""One catalogue model on this neuron: its state, plan, engine link and live figures.

`ResidentModel` is the record `Residency` (helexa/neuron/residency.py) keeps per
model, and what the servicer, Watch and the metrics read. States follow the
proto's ModelState: loading → ready ⇄ switching, ready → draining → (gone),
and failed from any of them. A failed model keeps its reason and the time
before which no Load retries it: FAILED_RETRY_SECS, doubling per consecutive
failure up to FAILED_RETRY_MAX_SECS, so a load that fails at once never
becomes a tight retry loop.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from helexa.config.schema import ModelEntry
from helexa.neuron.engine import messages
from helexa.neuron.limits import ModelLimits

if TYPE_CHECKING:
    from helexa.neuron.activation import Activations

FAILED_RETRY_SECS = 30.0
FAILED_RETRY_MAX_SECS = 600.0


class ModelState(enum.IntEnum):
    """Values match helexa.neuron.v1.ModelState."""

    LOADING = 1
    READY = 2
    SWITCHING = 3
    DRAINING = 4
    FAILED = 5


@dataclass
class ResidentModel:
    """One catalogue model on this neuron: its plan, engine and live figures."""

    entry: ModelEntry
    state: ModelState = ModelState.LOADING
    error: str = ""
    plan: Any = None  # helexa.plan.ModelPlan
    limits: ModelLimits | None = None
    admission: messages.Limits | None = None  # limits in force in the engine
    profile: str = ""
    kv_dtype: str = ""
    client: Any = None  # EngineClient
    tokenizer: Any = None  # helexa.neuron.tokenizer.Tokenizer
    engine_status: messages.EngineStatus | None = None
    devices: list[str] = field(default_factory=list)
    active: int = 0  # Generate calls open in the daemon for this model
    last_used_unix_ms: int = 0
    ready_unix_ms: int = 0  # when this load became ready (Watch; /v1/models' `created`)
    failures: int = 0  # consecutive failed loads
    retry_at: float = 0.0  # time.monotonic() before which a failed model is not reloaded
    num_state_slots: int = 0  # hybrid models: linear-attention state slots the engine holds
    # the most decode rows and step tokens its runner was built for at load (engine_launch)
    step_ceilings: tuple[int, int] = (0, 0)
    # the ceilings a re-plan last failed to build (profile_switch.switch_pool): a reload
    # asking for them again does not drain the model to fail again (Residency.pool_replans)
    refused_ceilings: tuple[int, int] = (0, 0)
    # a reload that came while it loaded or switched, applied once it is ready
    # (helexa/neuron/reconfigure.py settle), with the profile the file then named for it
    # (None: the file named no other)
    reload_pending: bool = False
    reload_profile: str | None = None
    # a reload's switch scheduled, not yet begun (reconfigure._switch): a reload meanwhile
    # waits for it as for a switch under way, not racing it to be refused `switching`
    switch_queued: bool = False
    # The activation dtype measured for a GGUF on CPU (helexa/neuron/activation.py)
    activations: Activations | None = None

    @property
    def activations_status(self) -> str:
        """The activation dtype and why, as Watch and `helexa ctl status` show it."""
        if self.activations is not None:
            return self.activations.status()
        if self.plan is None:
            return ""
        whose = "checkpoint" if self.entry.dtype == "auto" else "config"
        return f"{self.plan.float_dtype} (the {whose}'s dtype)"

    @property
    def load_entry(self) -> ModelEntry:
        """The entry as planned and loaded: ``dtype = "auto"`` replaced by the measured one."""
        if self.activations is None:
            return self.entry
        return msgspec.structs.replace(self.entry, dtype=self.activations.dtype)

    @property
    def model_id(self) -> str:
        return self.entry.id

    @property
    def busy(self) -> bool:
        """Work in flight anywhere: an open call in the daemon, or queued/in flight in the engine."""
        s = self.engine_status
        return self.active > 0 or (s is not None and (s.in_flight + s.queued) > 0)

    @property
    def footprint_bytes(self) -> int:
        """Device memory per card: weights + the KV pool."""
        if self.plan is None:
            return 0
        return int(self.plan.weight_bytes_per_card) + int(self.plan.kv_budget_bytes)

    def touch(self) -> None:
        self.last_used_unix_ms = int(time.time() * 1000)

    def begin(self) -> None:
        self.active += 1
        self.touch()

    def end(self) -> None:
        self.active -= 1
        self.touch()

    def fail(self, reason: str) -> None:
        """FAILED with its reason, and the time before which no Load retries it."""
        self.state = ModelState.FAILED
        self.error = reason
        self.failures += 1
        self.retry_at = time.monotonic() + min(
            FAILED_RETRY_MAX_SECS, FAILED_RETRY_SECS * 2 ** (self.failures - 1))

    @property
    def retry_after_ms(self) -> int:
        return max(1000, int((self.retry_at - time.monotonic()) * 1000))


def failure_reason(e: BaseException) -> str:
    """One line saying why: the last line of an engine's traceback, else the exception."""
    text = str(e)
    if "Traceback (most recent call last)" in text:
        last = [ln for ln in text.strip().splitlines() if ln.strip()][-1].strip()
        return f"{text.splitlines()[0].strip()} {last}"
    return f"{type(e).__name__}: {text}"
