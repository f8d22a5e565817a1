"""A refusal as the caller sees it: its gRPC status and trailing metadata."""

from __future__ import annotations

import grpc

from helexa.neuron.grpc_status import STATUS_OF_CODE, status_of, trailing_metadata
from helexa.refusal import Refusal


def test_refusal_carries_code_and_retry_after_as_trailing_metadata() -> None:
    r = Refusal("overloaded", "queue full", 1500)
    assert status_of(r) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(trailing_metadata(r)) == {"helexa-code": "overloaded",
                                           "helexa-retry-after-ms": "1500"}
    assert dict(trailing_metadata(Refusal("shutting_down", "x"))) == {
        "helexa-code": "shutting_down"}


def test_a_code_the_table_lacks_is_internal() -> None:
    assert "something_new" not in STATUS_OF_CODE
    assert status_of(Refusal("something_new", "x")) == grpc.StatusCode.INTERNAL
    assert status_of(Refusal("model_busy", "x")) == grpc.StatusCode.FAILED_PRECONDITION
