"""A finished generation reply checked against the schema keywords its grammar could not
enforce (docs/api.md, "JSON Schema keywords under constrained decoding"), and the parser
that splits a chat reply into thought, answer and tool calls for it and for the encoders.

The check runs in the work pool's background lane (work_pool.py): the client already has
its reply and the `x-helexa-unenforced-schema` header that warned of it, so what the check
finds is logged, never sent.
"""

from __future__ import annotations

from typing import Any

from helexa.router import agent_request, encode
from helexa.router.agent_output import OutputParser, parser_for
from helexa.router.openai_api import ParsedRequest
from helexa.router.tool_parsers import whole_calls


def check_schema(state: Any, req: ParsedRequest, model: str, calls: list[Any],
                 choices: list[encode.Choice], ctx: dict[str, Any]) -> None:
    """Check each finished reply against the keywords its grammar could not enforce, in the
    work pool's background lane (the check grows with the schema and the reply; it never
    counts toward the principal's share, work_pool.py); a violation is logged (the client
    has its reply and the header that warned of it), and so is a check dropped unrun or
    one that failed."""
    if not req.unenforced:
        return
    ctx = dict(ctx)

    def skipped(why: str) -> None:  # the background lane was full: this check went
        state.metrics.work_refusals.labels(why).inc()
        state.log.warning("request.schema_check_skipped", **ctx, reason=why)
    state.work_pool.submit(ctx["principal"], _check_replies, state, req, model, calls,
                           choices, ctx, on_drop=skipped)


def _check_replies(state: Any, req: ParsedRequest, model: str, calls: list[Any],
                   choices: list[encode.Choice], ctx: dict[str, Any]) -> None:
    for c in choices:
        if c.finish_reason is None:
            continue
        try:
            found = _violations(state, req, model, calls, c)
        except Exception as e:  # a bug of ours: said, with the request it was for
            state.metrics.work_background_failures.inc()
            state.log.exception("request.schema_check_failed", **ctx, choice=c.index,
                                error=repr(e))
            continue
        if found:
            state.log.warning("request.schema_violation", **ctx, choice=c.index,
                              violations=found[:20], unenforced=req.unenforced[:20])


def _violations(state: Any, req: ParsedRequest, model: str, calls: list[Any],
                c: encode.Choice) -> list[str]:
    parser = reply_parser(state, req, model, calls) or OutputParser()
    if c.thought_open:
        parser.thought_opened()
    a, b = parser.feed("".join(c.text)), parser.finish()
    return agent_request.reply_violations(req, a.content + b.content,
                                          whole_calls(a.calls + b.calls))


def reply_parser(state: Any, req: ParsedRequest, model: str,
                 calls: list[Any]) -> OutputParser | None:
    """A chat reply's thought / answer / tool-call parser, on the formats the serving
    neuron reported for the model."""
    if req.messages is None:
        return None
    link = state.registry.links.get(calls[0].neuron) if calls else None
    status = link.model_status(model) if link is not None else None
    tool_parser = status.tool_parser if status is not None else ""
    reasoning_parser = status.reasoning_parser if status is not None else ""
    if req.tool_choice == "none" and not reasoning_parser:
        return None
    return parser_for(req, tool_parser, reasoning_parser)
