"""A minimal in-process Neuron servicer (grpc.aio) that the router's tests drive.

It implements Generate, Complete, Tokenize, Watch, Models and Load of neuron.proto
with a KV ledger that reserves per request and releases exactly once
(finish, error or cancellation), records which RPC each request came by
(`rpcs`, beside `requests`), and can be told to refuse, fail mid-stream, be
slow or fall silent — through attributes (in-process tests) or through
markers in the prompt text (tests against a separate process); the markers
act alike on both RPCs:

    [[refuse:RESOURCE_EXHAUSTED:overloaded:1500]]   refuse with that status/code/retry-after ms
    [[fail:3]]                                      INTERNAL error after 3 tokens
    [[slow:0.05]]                                   seconds between tokens
    [[tokens:5]]                                    produce 5 tokens (default 8, capped by max_tokens)
    [[emit:3:<b>]]                                  the reply is `<b>` 3 times, one message
                                                    (a model that writes what it is told)
    [[hold:6]]                                      after the first token, the server's
                                                    Python holds the GIL (and its loop) 6 s:
                                                    a neuron busy, not hung

With `kv_wait_secs` set, a request waits for its reservation to fit the pool (its
first message only then), as a neuron's admission does; it is refused overloaded
once the requests holding the pool have sent nothing for that long (a holder
whose reads stopped holds it for ever; one streaming on a loaded host frees it).

Generated tokens are "w0 ", "w1 ", ... with ids 100, 101, ...; a prompt's
tokens are estimated as one per 4 characters (token-id prompts are exact). A
token-id prompt's token t reads "p{t} " (its `prompt_text` where asked), and
where prompt_logprobs are asked each prompt token after the first has logprob
-1.0 (-1.0 - k for its k-th alternative), all on the message that ends the
prefill, as the neuron's output processor sends them.
Run as a script it serves one fake neuron and prints `NEURON LISTENING host:port`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import re
import sys
import time
from dataclasses import dataclass

import grpc

from helexa.neuron.daemon import server_options
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc as pbg
from helexa.responses import merge_responses

_MARK = re.compile(r"\[\[(\w+):([^\]]*)\]\]")


@dataclass
class FakeModel:
    model: str
    state: int = pb.MODEL_STATE_READY
    context: int = 2048
    output: int = 1024
    num_blocks: int = 512
    block_size: int = 16
    bytes_per_token: int = 1024
    max_in_flight: int = 64
    max_queue_depth: int = 256
    max_per_principal: int = 64
    used_bytes: int = 0
    in_flight: int = 0
    queued: int = 0
    drafter: str = ""  # "" as a neuron without speculation reports it
    prefill_tokens_per_sec: float = 0.0
    ready_unix_ms: int = 0  # 0 as a neuron older than the field reports it
    tool_parser: str = ""  # the formats a real neuron reports for its model (hermes, think)
    reasoning_parser: str = ""
    progress_at: float = 0.0  # monotonic time a request last sent a token or let its KV go

    def status(self) -> pb.ModelStatus:
        total = self.num_blocks * self.block_size * self.bytes_per_token
        return pb.ModelStatus(
            model=self.model, state=self.state,
            kv=pb.KvLedger(total_bytes=total, free_bytes=total - self.used_bytes,
                           used_bytes=self.used_bytes, block_size=self.block_size,
                           bytes_per_token=self.bytes_per_token),
            in_flight=self.in_flight, queued=self.queued, running=self.in_flight,
            admission=pb.AdmissionLimits(max_in_flight=self.max_in_flight,
                                         max_queue_depth=self.max_queue_depth,
                                         max_per_principal=self.max_per_principal),
            limits=pb.ModelLimits(context=self.context, input=self.context - 1,
                                  output=self.output),
            drafter=self.drafter, prefill_tokens_per_sec=self.prefill_tokens_per_sec,
            ready_unix_ms=self.ready_unix_ms, tool_parser=self.tool_parser,
            reasoning_parser=self.reasoning_parser)


@dataclass
class Behaviour:
    refuse: tuple[str, str, int] | None = None  # (grpc status name, helexa-code, retry-after ms)
    refuse_times: int = -1  # refuse this many times (-1: always while set)
    fail_after: int | None = None
    token_delay_secs: float = 0.0
    first_delay_secs: float = 0.0
    # a thinking model's way: a first message at admission (thought_open, prompt_tokens),
    # then this long of prefill before the first token
    admission_message_secs: float | None = None
    # admitted with no batch row free: this long before the row (prefill_started), the
    # admission message said nothing of a prefill (with admission_message_secs)
    row_wait_secs: float | None = None
    # after its first token, no batch row for this long (paused, then resumed behind a full
    # batch): said with a waiting_for_row message unless row_lost_said is False (an older
    # neuron, or a hung one)
    row_lost_secs: float | None = None
    row_lost_said: bool = True
    default_tokens: int = 8
    # a request whose reservation does not fit the pool's free bytes waits for them (its
    # first message only then), refused overloaded (kv_max_wait_secs) once the requests
    # holding the pool have sent no token and let no KV go for this long: they stopped
    kv_wait_secs: float | None = None
    late_choice_secs: float = 0.0  # an n > 1 request's second choice (`-1`) admitted this late
    silent: bool = False  # Watch stops sending (the neuron looks hung)
    no_complete: bool = False  # Complete is UNIMPLEMENTED, as on a neuron older than it
    load_secs: float = 0.2
    load_fails: bool = False
    first_report_delay_secs: float = 0.0  # the next Watch call waits this long before reporting


class FakeNeuron(pbg.NeuronServicer):
    def __init__(self, name: str, models: list[str], catalogue: list[str] | None = None,
                 token: str | None = None) -> None:
        self.name = name
        self.models = {m: FakeModel(m) for m in models}
        self.catalogue = list(catalogue or []) + [m for m in models if m not in (catalogue or [])]
        self.token = token
        self.b = Behaviour()
        self.requests: list[pb.GenerateRequest] = []
        self.rpcs: list[str] = []  # "Generate" or "Complete", one per entry of requests
        self.cancelled = 0
        self.sent: dict[str, int] = {}  # req_id -> token messages gRPC took (flow control)
        self.loads: list[str] = []
        self.draining = False
        self.seq = 0
        self._changed = asyncio.Event()
        self.server: grpc.aio.Server | None = None
        self.address = ""

    # ----------------------------------------------------------- plumbing

    def changed(self) -> None:
        self._changed.set()

    def _status(self) -> pb.NeuronStatus:
        self.seq += 1
        return pb.NeuronStatus(neuron=self.name, models=[m.status() for m in self.models.values()],
                               draining=self.draining, seq=self.seq,
                               unix_ms=int(time.time() * 1000), catalogue=self.catalogue)

    async def _auth(self, context) -> None:
        if self.token is None:
            return
        md = dict(context.invocation_metadata() or ())
        if md.get("authorization") != f"Bearer {self.token}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad neuron token")

    async def start(self, address: str = "127.0.0.1:0") -> str:
        self.server = grpc.aio.server(options=server_options())  # the neuron's own
        pbg.add_NeuronServicer_to_server(self, self.server)
        port = self.server.add_insecure_port(address)
        await self.server.start()
        self.address = f"{address.rpartition(':')[0]}:{port}"
        return self.address

    async def stop(self, grace: float | None = None) -> None:
        if self.server is not None:
            await self.server.stop(grace)

    # ----------------------------------------------------------- RPCs

    async def Watch(self, request, context):
        await self._auth(context)
        beat = (request.heartbeat_ms or 1000) / 1000
        delay, self.b.first_report_delay_secs = self.b.first_report_delay_secs, 0.0
        await asyncio.sleep(delay)  # a neuron slow to bring its first report
        while True:
            self._changed.clear()  # before taking the status: a later change is never lost
            if not self.b.silent:
                yield self._status()
            await asyncio.sleep(0.05)  # at most 20 messages a second, as the contract says
            if not self._changed.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(beat):
                        await self._changed.wait()

    async def Models(self, request, context):
        await self._auth(context)
        return pb.ModelsResponse(
            catalogue=[pb.CatalogueEntry(model=m, resident=m in self.models) for m in self.catalogue],
            models=[m.status() for m in self.models.values()])

    async def Load(self, request, context):
        await self._auth(context)
        self.loads.append(request.model)
        if request.model not in self.catalogue:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.model} not in catalogue")
        m = self.models.setdefault(request.model, FakeModel(request.model))
        m.state = pb.MODEL_STATE_LOADING
        self.changed()
        await asyncio.sleep(self.b.load_secs)
        m.state = pb.MODEL_STATE_FAILED if self.b.load_fails else pb.MODEL_STATE_READY
        self.changed()
        if self.b.load_fails:
            await context.abort(grpc.StatusCode.INTERNAL, "fake load failure")
        return pb.LoadResponse(status=m.status())

    async def Health(self, request, context):
        return pb.HealthResponse(status="DRAINING" if self.draining else "SERVING", neuron=self.name)

    async def Generate(self, request, context):
        async for msg in self._generate("Generate", request, context):
            yield msg

    async def Complete(self, request, context):
        if self.b.no_complete:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        async with contextlib.aclosing(self._generate("Complete", request, context)) as stream:
            return merge_responses([m async for m in stream])

    async def Tokenize(self, request, context):
        """One id per 4 characters of the prompt's text (ids back as their count of words)."""
        await self._auth(context)
        m = self.models.get(request.model)
        if m is None or m.state != pb.MODEL_STATE_READY:
            context.set_trailing_metadata([("helexa-code", "model_not_found")])
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model} not resident")
        if request.HasField("token_ids"):
            return pb.TokenizeResponse(text="".join(f"w{i} " for i in request.token_ids.ids),
                                       max_model_len=m.context)
        text = _prompt_text(request)
        return pb.TokenizeResponse(token_ids=range(1, 1 + math.ceil(len(text) / 4)),
                                   max_model_len=m.context)

    async def _generate(self, rpc: str, request, context):
        await self._auth(context)
        self.requests.append(request)
        self.rpcs.append(rpc)
        text = _prompt_text(request)
        marks = dict(_MARK.findall(text))
        refuse = self.b.refuse
        if "refuse" in marks:
            status, code, ms = marks["refuse"].split(":")
            refuse = (status, code, int(ms))
        if refuse is not None and self.b.refuse_times != 0:
            self.b.refuse_times -= 1 if self.b.refuse_times > 0 else 0
            md = [("helexa-code", refuse[1])]
            if refuse[2]:
                md.append(("helexa-retry-after-ms", str(refuse[2])))
            context.set_trailing_metadata(md)
            await context.abort(grpc.StatusCode[refuse[0]], f"fake refusal: {refuse[1]}")
        m = self.models.get(request.model)
        if m is None or m.state != pb.MODEL_STATE_READY:
            context.set_trailing_metadata([("helexa-code", "model_not_found")])
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model} not resident")
        prompt_ids = (list(request.token_ids.ids) if request.HasField("token_ids")
                      else list(range(1, 1 + max(1, math.ceil(len(text) / 4)))))
        budget = request.max_tokens if request.HasField("max_tokens") else m.output
        if len(prompt_ids) >= m.context or len(prompt_ids) + budget > m.context:
            context.set_trailing_metadata([("helexa-code", "context_length_exceeded")])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt has {len(prompt_ids)} tokens and asks for {budget} more;"
                                f" the context is {m.context}")
        n = min(int(marks.get("tokens", self.b.default_tokens)), budget)
        reserve = math.ceil((len(prompt_ids) + budget) / m.block_size) * m.block_size \
            * m.bytes_per_token
        fail_after = int(marks["fail"]) if "fail" in marks else self.b.fail_after
        # [[abort:N:why]]: ended after N tokens as the engine ends one (finish ABORT, its
        # stop_reason `why`: deadline, shutdown; ERROR for `error`)
        abort_after, _, why = marks.get("abort", "").partition(":")
        delay = float(marks.get("slow", self.b.token_delay_secs))
        if self.b.kv_wait_secs is not None:
            total = m.num_blocks * m.block_size * m.bytes_per_token
            since = time.monotonic()
            while m.used_bytes + reserve > total:
                if time.monotonic() - max(since, m.progress_at) > self.b.kv_wait_secs:
                    context.set_trailing_metadata([("helexa-code", "overloaded")])
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        "fake: no KV for it within kv_wait_secs")
                await asyncio.sleep(0.01)
        if request.req_id.endswith("-1"):
            await asyncio.sleep(self.b.late_choice_secs)
        m.used_bytes += reserve
        m.in_flight += 1
        self.changed()
        try:
            if "emit" in marks:
                count, _, unit = marks["emit"].partition(":")
                yield pb.GenerateResponse(text=unit * int(count), token_ids=[100])
                yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage(
                    prompt_tokens=len(prompt_ids), completion_tokens=1))
                return
            if self.b.first_delay_secs:
                await asyncio.sleep(self.b.first_delay_secs)
            if self.b.admission_message_secs is not None:
                waits = self.b.row_wait_secs
                yield pb.GenerateResponse(thought_open=True, prompt_tokens=len(prompt_ids),
                                          prefill_started=waits is None)
                if waits is not None:
                    await asyncio.sleep(waits)
                    yield pb.GenerateResponse(prefill_started=True)
                await asyncio.sleep(self.b.admission_message_secs)
            scored = _prompt_entries(request, prompt_ids)
            for i in range(n):
                if fail_after is not None and i >= fail_after:
                    await context.abort(grpc.StatusCode.INTERNAL, "fake engine failure")
                if abort_after and i >= int(abort_after):
                    yield pb.GenerateResponse(
                        finish_reason=pb.FINISH_REASON_ERROR if why.startswith("error")
                        else pb.FINISH_REASON_ABORT, stop_reason=why,
                        usage=pb.Usage(prompt_tokens=len(prompt_ids), completion_tokens=i))
                    return
                if delay and i:
                    await asyncio.sleep(delay)
                msg = pb.GenerateResponse(text=f"w{i} ", token_ids=[100 + i])
                if request.sampling.logprobs:
                    msg.logprobs.append(pb.TokenLogprob(
                        token_id=100 + i, token=f"w{i} ", logprob=-0.5,
                        top=[pb.TopLogprob(token_id=100 + i + k, token=f"w{i + k} ", logprob=-0.5 - k)
                             for k in range(request.sampling.top_logprobs)]))
                if i == 0 and request.return_prompt_token_ids:
                    msg.prompt_token_ids.extend(prompt_ids)
                if i == 0:
                    msg.prompt_logprobs.extend(scored)
                    msg.prompt_text = _decoded(request, text, prompt_ids)
                yield msg
                self.sent[request.req_id] = i + 1
                m.progress_at = time.monotonic()
                if i == 0 and "hold" in marks:
                    hold_gil(float(marks["hold"]))
                if i == 0 and self.b.row_lost_secs is not None:
                    if self.b.row_lost_said:
                        yield pb.GenerateResponse(waiting_for_row=True)
                    await asyncio.sleep(self.b.row_lost_secs)
            yield pb.GenerateResponse(
                finish_reason=pb.FINISH_REASON_LENGTH if n == budget else pb.FINISH_REASON_STOP,
                usage=pb.Usage(prompt_tokens=len(prompt_ids), completion_tokens=n,
                               cached_tokens=len(prompt_ids) // 2),
                prompt_logprobs=[] if n else scored,
                prompt_text="" if n else _decoded(request, text, prompt_ids))
        except asyncio.CancelledError:
            self.cancelled += 1  # the caller cancelled the call (client gone)
            raise
        finally:
            m.used_bytes -= reserve
            m.in_flight -= 1
            m.progress_at = time.monotonic()
            self.changed()


def hold_gil(secs: float) -> None:
    """Hold the GIL for at least `secs`, each stretch one C call (sum over a range never
    releases it), so no Python thread of this process runs meanwhile: only gRPC's core
    threads can. The first stretch is sized for all of it from a short measured one."""
    end = time.perf_counter() + secs
    t0 = time.perf_counter()
    sum(range(5_000_000))
    rate = 5_000_000 / max(time.perf_counter() - t0, 1e-6)
    while (left := end - time.perf_counter()) > 0:
        sum(range(int(rate * left) + 1))


def _decoded(request: pb.GenerateRequest, text: str, ids: list[int]) -> str:
    """The prompt's text where asked (return_prompt_text): "p{t} " a token id."""
    if not request.return_prompt_text:
        return ""
    return "".join(f"p{t} " for t in ids) if request.HasField("token_ids") else text


def _prompt_entries(request: pb.GenerateRequest, ids: list[int]) -> list[pb.TokenLogprob]:
    """Each prompt token's entry where prompt_logprobs are asked (else none)."""
    if not request.sampling.HasField("prompt_logprobs"):
        return []
    out, at = [], 0
    for j, t in enumerate(ids):
        top = [pb.TopLogprob(token_id=t + k, token=f"p{t + k} ", logprob=-1.0 - k)
               for k in range(request.sampling.prompt_logprobs)] if j else []
        out.append(pb.TokenLogprob(token_id=t, token=f"p{t} ", logprob=-1.0 if j else 0.0,
                                   top=top, text_offset=at))
        at += len(f"p{t} ")
    return out


def _prompt_text(request: pb.GenerateRequest | pb.TokenizeRequest) -> str:
    if request.HasField("chat"):
        return "\n".join(m.content for m in request.chat.messages)
    return request.text


async def _main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="fake")
    p.add_argument("--models", default="tiny")
    p.add_argument("--catalogue", default="")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--token", default=None)
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--first-report-delay", type=float, default=0.0,
                   help="seconds the first Watch call waits before its first report")
    p.add_argument("--context", type=int, default=0,
                   help="each model's context (a quarter of it: its output limit)")
    p.add_argument("--formats", default="",
                   help="reasoning,tool parser each model reports (think,hermes), as a neuron")
    args = p.parse_args(argv)
    neuron = FakeNeuron(args.name, [m for m in args.models.split(",") if m],
                        [m for m in args.catalogue.split(",") if m], token=args.token)
    neuron.b.token_delay_secs = args.token_delay
    neuron.b.first_report_delay_secs = args.first_report_delay
    for m in neuron.models.values():
        if args.context:
            m.context, m.output = args.context, args.context // 4
            m.num_blocks = max(m.num_blocks, 2 * args.context // m.block_size)
        m.reasoning_parser, _, m.tool_parser = args.formats.partition(",")
    address = await neuron.start(args.listen)
    print(f"NEURON LISTENING {address}", flush=True)
    await neuron.server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1:]))
