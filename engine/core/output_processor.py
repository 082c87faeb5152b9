"""Token ids -> user-facing outputs: incremental text, stop strings, logprobs, usage, n > 1.

One `RequestState` per completion holds its detokenizer and stop checker; one `PromptGroup` per
user request gathers its n completions into one `RequestOutput`. Stop strings are matched here,
on text, and end the request through the `finish` callback the engine passes in.
"""

from collections.abc import Callable

from localllm.engine.core.outputs import CompletionOutput, Logprob, RequestOutput, Usage
from localllm.engine.core.request import Request
from localllm.engine.sampling.sampler import SampledToken
from localllm.engine.sampling.stop import StopChecker
from localllm.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestState:
    """Text side of one completion."""

    def __init__(self, req: Request, tokenizer: Tokenizer, group_id: str):
        p = req.params
        self.req = req
        self.group_id = group_id  # the user's request id (n > 1 completions share it)
        self.finish_reported = False
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(
            tokenizer, skip_special=p.skip_special_tokens, prompt_ids=req.prompt_token_ids
        )
        self.stop = StopChecker(p.stop, p.include_stop_str_in_output) if p.stop else None
        self.text = ""
        self.num_processed = 0  # output ids detokenized so far
        self.num_ids_emitted = 0  # output ids already handed out (delta streaming)
        self.num_logprobs_emitted = 0
        self.text_emitted = 0
        self.stopped_by_text = False
        self.cumulative_logprob = 0.0

    def add_tokens(self, tokens: list[SampledToken], finish: Callable[[str, str], None]) -> None:
        """Detokenize what the scheduler appended this step; may end the request on a stop string.

        The scheduler appends a prefix of `tokens` (it stops at an end-of-generation id).
        """
        req, p = self.req, self.req.params
        new = req.output_token_ids[self.num_processed :]
        self.num_processed = len(req.output_token_ids)
        for i, tok_id in enumerate(new):
            if p.logprobs is not None:
                self._record_logprob(tokens[i])
            last = i == len(new) - 1
            stop_id = last and req.finished and req.stop_reason == tok_id
            if stop_id and not p.include_stop_str_in_output:
                break  # the end-of-generation / stop id is not part of the text
            if self._add_text(self.detok.add(tok_id), finish):
                return
        if req.finished and not self.stopped_by_text:
            self._add_text(self.detok.flush(), finish)
            if self.stop is not None and not self.stopped_by_text:
                self.text += self.stop.flush()

    def _add_text(self, piece: str, finish: Callable[[str, str], None]) -> bool:
        if not piece:
            return False
        if self.stop is None:
            self.text += piece
            return False
        emit, matched = self.stop.add(piece)
        self.text += emit
        if matched is not None:
            self.stopped_by_text = True
            finish("stop", matched)
            return True
        return False

    def _record_logprob(self, tok: SampledToken) -> None:
        entry = {tok.token_id: Logprob(tok.logprob, tok.rank, self._piece(tok.token_id))}
        for rank, (tid, lp) in enumerate(tok.top or [], start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, self._piece(tid))
        self.req.logprobs.append(entry)
        self.cumulative_logprob += tok.logprob

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special=False)

    def completion(self, delta: bool) -> CompletionOutput:
        req = self.req
        ids = req.output_token_ids
        lps = req.logprobs if req.params.logprobs is not None else None
        self.finish_reported = req.finished
        if delta:
            text = self.text[self.text_emitted :]
            ids = ids[self.num_ids_emitted :]
            lps = lps[self.num_logprobs_emitted :] if lps is not None else None
            self.text_emitted = len(self.text)
            self.num_ids_emitted = len(req.output_token_ids)
            self.num_logprobs_emitted = len(req.logprobs)
        return CompletionOutput(
            index=req.index,
            text=self.text if not delta else text,
            token_ids=list(ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=lps,
            cumulative_logprob=self.cumulative_logprob if req.params.logprobs is not None else None,
        )


class PromptGroup:
    """The n completions of one user request, reported as one RequestOutput."""

    def __init__(
        self, request_id: str, prompt: str | None, states: list[RequestState], delta: bool
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.states = states
        self.delta = delta  # stream only what is new (AsyncEngine), or whole outputs (LLM)

    @property
    def finished(self) -> bool:
        return all(s.req.finished for s in self.states)

    def output(self, changed: set[int] | None = None) -> RequestOutput:
        """Cumulative output, or (delta) only the completions in `changed` with their new parts."""
        delta = self.delta
        first = self.states[0].req
        states = self.states
        if delta:
            # New tokens, or an end (abort, error) not yet reported.
            changed = changed or set()
            states = [
                s
                for s in self.states
                if s.req.index in changed or (s.req.finished and not s.finish_reported)
            ]
        outs = [s.completion(delta) for s in states]
        usage = Usage(
            prompt_tokens=first.num_prompt_tokens,
            completion_tokens=sum(s.req.num_output_tokens for s in self.states),
            cached_tokens=first.num_cached_tokens,
        )
        errors = [s.req.error for s in self.states if s.req.error]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            prompt_logprobs=first.prompt_logprobs or None,
            usage=usage,
            metrics=first.metrics,
            error=errors[0] if errors else None,
        )
