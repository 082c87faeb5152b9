"""Chat-screen answer streaming: run one answer in a worker, stream its text (and a reasoning
model's think block) into a message view, save it when it ends, is stopped or the app quits.

The answer is saved before any await once the stream ends, so a stopped or quit answer keeps its
partial text. A mixin of `ChatScreen` (which provides `history`, `conversation`, `store`,
`gen_settings`, `refresh_status`, `_mount`).
"""

import asyncio
import contextlib
import time

from textual.widgets import Markdown
from textual.worker import Worker, WorkerCancelled, WorkerFailed

from localllm.app.tui.backend import chat_messages
from localllm.app.tui.stats import GenStats
from localllm.app.tui.widgets.message import MessageView

STATUS_INTERVAL = 0.1  # seconds between status-line redraws while streaming


class AnswerStreaming:
    answer_worker: Worker | None = None
    _last_status = 0.0

    @property
    def generating(self) -> bool:
        return self.answer_worker is not None and not self.answer_worker.is_finished

    async def stop_answer(self) -> None:
        """Cancel a running answer and wait until its partial text is saved."""
        worker = self.answer_worker
        if worker is not None and not worker.is_finished:
            worker.cancel()
            with contextlib.suppress(WorkerCancelled, WorkerFailed):
                await worker.wait()

    def generate(self) -> None:
        self.answer_worker = self.run_worker(self._answer(), group="answer", exclusive=True)
        self.refresh_bindings()

    async def _answer(self) -> None:
        backend, conv = self.app.backend, self.conversation
        view = MessageView("assistant")
        await self._mount(view)
        stream = Markdown.get_stream(view.markdown)
        think = None  # the think block's stream, opened by the first reasoning
        stats = self.stats = GenStats()
        settings = self.gen_settings
        messages = chat_messages([(m.role, m.content) for m in self.history], settings)
        text, reasoning, finish, error = "", "", None, None
        self.refresh_status()
        try:
            async for delta in backend.stream(messages, settings):
                stats.update(delta)
                if delta.reasoning:
                    if think is None:
                        view.think.display = True
                        think = Markdown.get_stream(view.think)
                    reasoning += delta.reasoning
                    await think.write(delta.reasoning)
                if delta.text:
                    text += delta.text
                    await stream.write(delta.text)
                finish = delta.finish_reason or finish
                self._tick()
            finish = finish or "stop"
        except asyncio.CancelledError:
            finish = "abort"
            raise
        except Exception as e:
            finish, error = "error", str(e) or type(e).__name__
        finally:
            # Saved before any await: durability.
            self._save_answer(conv, view, text, reasoning, finish, stats)
            for s in (stream, think):
                with contextlib.suppress(Exception):  # the view may be gone (switched, closing)
                    if s is not None:
                        await s.stop()
            self.call_later(self._generation_done, error)

    def _save_answer(self, conv, view, text, reasoning, finish, stats) -> None:
        if not text and not reasoning:
            if view.is_attached:
                view.remove()
            return
        msg = self.store.add_message(
            conv.id,
            "assistant",
            text,
            finish_reason=finish,
            prompt_tokens=stats.prompt_tokens or None,
            completion_tokens=stats.completion_tokens or None,
            reasoning=reasoning or None,
        )
        view.message_id = msg.id
        if finish in ("abort", "error"):
            view.set_note("stopped" if finish == "abort" else "error")
        if self.conversation is not None and self.conversation.id == conv.id:
            self.history.append(msg)

    def _generation_done(self, error: str | None) -> None:
        if error:
            self.notify(error, title="Generation failed", severity="error", timeout=6)
        self.refresh_status()
        self.refresh_bindings()
        self.query_one("#messages").scroll_end(animate=False)

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_status >= STATUS_INTERVAL:
            self._last_status = now
            self.refresh_status()
            self.query_one("#messages").scroll_end(animate=False)
