"""Constrained decoding in the engine: one llguidance matcher per request, masks per step.

A request that carries a grammar (helexa.grammar built it; NewRequest.grammar)
is queued while its grammar compiles (`Grammars.compile`), on a thread of its
own, never on the step loop: compiling a large schema takes seconds (a
13,000-property JSON schema, ~2 CPU s) and llguidance releases the GIL while it
compiles, so the batch keeps stepping meanwhile, as vLLM and SGLang do. Until
its matcher is ready the request holds no in-flight place, KV or row
(admission.py passes over it); each step the engine takes the
matchers that are ready (`Grammars.ready`), and a grammar llguidance refuses
refuses its request with llguidance's message. A request that ends while its
grammar compiles (abort, deadline, drain, shutdown) is forgotten (`Grammars.forget`), and
a compile nobody waits for any more is cancelled where it has not begun.

Compiled grammars are kept (the last `_CACHED_GRAMMARS`, up to
`_CACHED_GRAMMAR_BYTES` of grammar text), keyed by the grammar and the
request's prefix-sharing salt (prefix_filing.cache_salt): the n choices
of one request, or a caller's repeated schema, compile once and each request
gets its own copy (llguidance's deep_copy, ~0.2 ms), while one API key cannot
learn by timing what another compiled (the prefix cache is salted for the same
reason). Tensor-parallel ranks build no matchers: rank 0 alone samples.

Each step, the rows that will be sampled and carry a matcher get their
allowed-token bitmask computed in a worker thread while the model runs the
step (`Grammars.start`): llguidance
fills the masks of all rows in parallel with the GIL released, so a
constrained row costs the batch the mask time only where it exceeds the
forward pass. The sampler then sets every disallowed logit to -inf
(`apply_bitmask`), and the engine feeds the sampled token back (`advance`).

Why llguidance (and not xgrammar): it depends on nothing (xgrammar pulls in
transformers and triton), its matchers compute masks lazily (nothing to
compile per token ahead), and it checks a grammar without a tokenizer, so the
router refuses a bad schema itself.
Masks cost ~11-15 µs per row per step here (bench/constrained.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from queue import SimpleQueue
from typing import Any

import torch

from helexa.kernels.backends.base import host_to_device, to_device
from helexa.neuron.tokenizer import eos_token_ids

# Compiled grammars kept per engine, each keyed by (salt, grammar): at most this many, and
# this much grammar text (a 13,000-property schema's 460 KB compiled holds ~40 MiB).
_CACHED_GRAMMARS = 32
_CACHED_GRAMMAR_BYTES = 2 * 2**20


class GrammarUnavailable(Exception):
    """This engine cannot run grammars (no tokenizer); the message says why."""


class Grammars:
    """The engine's grammar machinery: the tokenizer view llguidance needs, its executor,
    and the worker thread that computes a step's masks beside the forward pass."""

    def __init__(self, model_dir: str, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids: list[int] = []  # read with the tokenizer, at the first grammar
        self._tokenizer: Any = None
        self._executor: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._pin = torch.cuda.is_available()  # pinned masks on a CUDA host (apply_bitmask)
        self.warmed = False  # warm() built the tokenizer view and one matcher's mask
        self.unavailable = ""  # why this engine cannot run grammars, when warm() found out
        self.compiling: dict[str, Any] = {}  # requests whose grammar compiles, by req_id
        self._compiled: OrderedDict[tuple[bytes, str], Future[Any]] = OrderedDict()
        self._compiles: SimpleQueue[tuple[Future[Any], str] | None] = SimpleQueue()

    def warm(self) -> None:
        """Do the grammar library's start-up now, at model load: the tokenizer view (seconds
        for a large vocabulary) and one matcher and mask. Done lazily, the first constrained
        request paid it inside an engine step, and every running stream stalled 3-6 s."""
        from helexa.grammar import Constraint, grammar_text

        try:
            m = self.matcher(grammar_text(Constraint(kind="json_object", source="")))
        except Exception as e:  # a load still serves free text; constrained requests
            self.unavailable = str(e)  # are refused with the same message when they come
            return
        self.start([m]).result()
        self.warmed = True

    def _ensure(self) -> None:
        if self._tokenizer is not None:
            return
        import llguidance

        from helexa.checkpoint.gguf import find_gguf, model_folder

        path = model_folder(self.model_dir) / "tokenizer.json"
        gguf = None if path.is_file() else find_gguf(self.model_dir)
        if gguf is not None:  # no tokenizer.json: the one built from the GGUF metadata
            from helexa.neuron.formats.gguf.tokenizer import tokenizer_parts

            text = tokenizer_parts(gguf)[0].to_str()
        elif path.is_file():
            text = path.read_text()
        else:
            raise GrammarUnavailable(f"constrained decoding needs {path}, which is missing")
        # The daemon's rule, so a finished grammar ends at the eos the daemon stops at
        # (llguidance would guess one from the vocabulary: another token, for a checkpoint
        # that names its eos only in tokenizer_config.json).
        self.eos_token_ids = eos_token_ids(self.model_dir)
        # n_vocab is the logits' width: checkpoints often carry spare rows past the tokenizer.
        self._tokenizer = _text_tokenizer(text, self.vocab_size, self.eos_token_ids or None)
        self._executor = llguidance.LLExecutor()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        # a daemon thread: an engine that exits never waits for a compile to end
        threading.Thread(target=_compile_loop, args=(self._compiles, self.matcher),
                         name="grammar-compile", daemon=True).start()

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher; raises ValueError with llguidance's message on a bad grammar."""
        import llguidance

        self._ensure()
        m = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def compile(self, req: Any, grammar: str, salt: bytes) -> None:
        """Have `req`'s grammar compiled off the step loop; `req` waits (req.compiling) until
        `ready` gives it its matcher. A grammar compiled (or compiling) under the same salt
        is not compiled again. Raises GrammarUnavailable where this engine has none."""
        self._ensure()
        key = (salt, grammar)
        fut = self._compiled.get(key)
        if fut is None or fut.cancelled():
            fut = self._compiled[key] = Future()
            self._compiles.put((fut, grammar))
        self._compiled.move_to_end(key)
        while len(self._compiled) > 1 and (
                len(self._compiled) > _CACHED_GRAMMARS
                or sum(len(g) for _, g in self._compiled) > _CACHED_GRAMMAR_BYTES):
            self._compiled.popitem(last=False)  # the oldest; its waiters hold their future
        req.compiling = fut
        self.compiling[req.req_id] = req

    def ready(self) -> list[tuple[Any, Any, str]]:
        """The requests whose grammar has compiled, each with a matcher of its own (a copy of
        the compiled one) or why llguidance refused the grammar; they wait no more."""
        out = []
        for req_id, req in list(self.compiling.items()):
            fut = req.compiling
            if not fut.done():
                continue
            del self.compiling[req_id]
            req.compiling = None
            try:
                out.append((req, fut.result().deep_copy(), ""))
            except BaseException as e:  # ValueError: llguidance's message; else named
                out.append((req, None, str(e) or type(e).__name__))
        return out

    def forget(self, req: Any) -> None:
        """`req` ended: it waits for no grammar. A compile nobody else waits for is cancelled
        where it has not begun (and leaves the cache); one under way runs to its end."""
        if self.compiling.pop(req.req_id, None) is not req:
            return
        fut, req.compiling = req.compiling, None
        if all(r.compiling is not fut for r in self.compiling.values()) and fut.cancel():
            for key in [k for k, f in self._compiled.items() if f is fut]:
                del self._compiled[key]

    def start(self, matchers: list[Any]) -> Future[torch.Tensor]:
        """Begin filling one bitmask row per matcher; the future gives int32 [rows, words].

        The executor writes into the tensor's memory itself (what `llguidance.torch`'s
        helpers wrap: importing that module compiles a `torch.compile` kernel this engine
        does not use, 2.5 s of every model load on a CPU). The mask is pinned on a CUDA
        host, so its copy to the device need not wait (apply_bitmask)."""
        assert self._pool is not None and self._executor is not None
        words = (self.vocab_size + 31) // 32
        mask = torch.full((len(matchers), words), -1, dtype=torch.int32,
                          pin_memory=self._pin)
        pairs = [(m, i) for i, m in enumerate(matchers)]
        executor = self._executor

        def fill() -> torch.Tensor:
            executor.unsafe_compute_mask_ptr(pairs, mask.data_ptr(), words * 4, len(matchers))
            return mask

        return self._pool.submit(fill)

    def close(self) -> None:
        self._compiles.put(None)  # the compile thread ends after the compile under way
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _compile_loop(compiles: SimpleQueue[tuple[Future[Any], str] | None],
                  build: Any) -> None:
    """The compile thread: each grammar's matcher, or the error, into its future.
    llguidance releases the GIL while it compiles, so the step loop runs beside it."""
    while (item := compiles.get()) is not None:
        fut, grammar = item
        if not fut.set_running_or_notify_cancel():
            continue  # every request waiting for it ended first
        try:
            fut.set_result(build(grammar))
        except BaseException as e:  # a panic included: the request's to refuse
            fut.set_exception(e)


def advance(matcher: Any, token_id: int) -> str:
    """Feed a sampled token to its matcher; "" or why the grammar refused it."""
    if matcher.consume_token(token_id):
        return ""
    return matcher.get_error() or f"token {token_id} does not fit the grammar"


def apply_bitmask(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
    """Set the logits of `rows` [len(rows) of logits' rows] to -inf where `mask` (int32
    [len(rows), ceil(vocab / 32)], bit t % 32 of word t // 32 = token t allowed) is 0.
    On CUDA nothing here waits for the device: the mask and the rows reach it from pinned
    memory (a copy from pageable memory would hold the host until the step before had run,
    and a lookahead step samples while it runs: engine/lookahead.py)."""
    device, vocab = logits.device, logits.shape[1]
    m = host_to_device(mask, device)
    bits = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((m.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    idx = to_device(rows, torch.long, device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


class _TextTokens:
    """What llguidance.TokenizerWrapper reads: the vocabulary as bytes (a special token's
    prefixed with 0xff, llguidance's marker) and a tokenize that reads special-token text
    as plain text."""

    def __init__(self, base: Any, text: str, n_vocab: int, eos: int) -> None:
        from tokenizers import Tokenizer

        self._tk = Tokenizer.from_str(text)
        self._tk.encode_special_tokens = True  # `<|im_start|>` in a string is its characters
        self.special_token_ids = [i for i in range(n_vocab) if base.is_special_token(i)]
        special = set(self.special_token_ids)
        self.tokens = [(b"\xff" if i in special else b"") + base.decode_bytes([i])
                       for i in range(n_vocab)]
        self.eos_token_id = eos
        self.bos_token_id = None

    def __call__(self, s: str) -> list[int]:
        return list(self._tk.encode(s, add_special_tokens=False).ids)


def _text_tokenizer(text: str, n_vocab: int, eos: list[int] | None) -> Any:
    """llguidance's tokenizer for a tokenizer.json text, tokenizing forced text as text.
    Built from the text alone, llguidance tokenizes the bytes a grammar forces (a schema's
    property name, a tool name) with the tokenizer's special tokens parsed: a key
    `<|im_start|>` became the one special token, which the mask then allowed and the
    matcher refused (`forced bytes: got '<'`), and the request failed. The vocabulary is
    read from that first build; the second tokenizes with special tokens off."""
    import llguidance

    base = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
    wrapped = llguidance.TokenizerWrapper(_TextTokens(base, text, n_vocab, base.eos_token))
    return llguidance.LLTokenizer(wrapped, n_vocab=n_vocab, eos_token=eos)
