"""Reasoning split: text inside `<think>...</think>` is the model's reasoning, the rest its answer.

Generation may start inside a think block when the chat template opened one at the end of the
prompt (Qwen3, DeepSeek-R1); otherwise a block counts only when the output opens with `<think>`.
Fed piece by piece, the split does not depend on where the pieces were cut.
"""

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("none", "deepseek")


def opens_thinking(prompt_tail: str) -> bool:
    """Does the rendered prompt end inside an open think block?"""
    return prompt_tail.rstrip().endswith(OPEN)


@dataclass(frozen=True, slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Incremental `<think>` splitter for one completion."""

    def __init__(self, in_think: bool = False):
        self._state = "think" if in_think else "start"
        self._buf = ""

    def feed(self, text: str) -> Split:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> Split:
        return self._run(final=True)

    def _run(self, final: bool) -> Split:
        reasoning, content = [], []
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(OPEN):
                    self._buf, self._state = head[len(OPEN) :], "think"
                    continue
                if OPEN.startswith(head) and not final:
                    break  # only blanks or a part of the tag so far
                self._state = "content"
            elif self._state == "think":
                i = self._buf.find(CLOSE)
                if i >= 0:
                    reasoning.append(self._buf[:i])
                    self._buf, self._state = self._buf[i + len(CLOSE) :], "after"
                    continue
                keep = 0 if final else _partial_suffix(self._buf, CLOSE)
                reasoning.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            elif self._state == "after":  # blanks between the block and the answer are dropped
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._state = "content"
            else:
                content.append(self._buf)
                self._buf = ""
                break
        return Split("".join(reasoning), "".join(content))


def _partial_suffix(s: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(s)), 0, -1):
        if marker.startswith(s[-n:]):
            return n
    return 0
