"""Chat history in SQLite: conversations and their messages, one commit per finished message.

WAL mode with `synchronous=NORMAL`: a committed message survives the app being killed (only a
power loss may drop the last transactions). Pure `sqlite3`, no Textual, so it is unit-tested alone.
"""

import json
import os
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TITLE_CHARS = 40  # a new conversation's title: the first message, cut to this length

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    model TEXT,
    settings TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL,
    created REAL NOT NULL,
    finish_reason TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    reasoning TEXT
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


def history_path(env: dict[str, str] | None = None) -> Path:
    """`$XDG_DATA_HOME/localllm/history.sqlite3`, else `~/.local/share/localllm/...`."""
    env = os.environ if env is None else env
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "localllm" / "history.sqlite3"


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    model: str | None
    settings: dict[str, Any]


@dataclass(frozen=True)
class StoredMessage:
    id: int
    conversation_id: int
    role: str
    content: str
    created: float
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning: str | None = None  # a reasoning model's thinking, kept apart from its answer


class HistoryStore:
    """One SQLite file; every write method commits before it returns."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The TUI calls us from its event loop and from worker threads; calls are serialised by
        # the caller (one at a time), so sharing the connection across threads is safe.
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        columns = {r["name"] for r in self.db.execute("PRAGMA table_info(messages)")}
        if "reasoning" not in columns:  # a history file from before reasoning was kept
            self.db.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT")

    def close(self) -> None:
        self.db.close()

    @property
    def journal_mode(self) -> str:
        return self.db.execute("PRAGMA journal_mode").fetchone()[0]

    # -- conversations -----------------------------------------------------------------------

    def new_conversation(
        self, title: str, settings: dict[str, Any] | None = None, model: str | None = None
    ) -> Conversation:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations (title, created, updated, model, settings) "
            "VALUES (?, ?, ?, ?, ?)",
            (title, now, now, model, json.dumps(settings or {})),
        )
        return self.conversation(cur.lastrowid)

    def conversation(self, conversation_id: int) -> Conversation:
        row = self.db.execute(
            "SELECT * FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return _conversation(row)

    def conversations(self, query: str = "") -> list[Conversation]:
        """Newest first; `query` matches titles and message text (case-insensitive substring)."""
        if not query.strip():
            rows = self.db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC")
        else:
            pattern = "%" + re.sub(r"([%_\\])", r"\\\1", query.strip()) + "%"
            rows = self.db.execute(
                "SELECT * FROM conversations c WHERE c.title LIKE ?1 ESCAPE '\\' OR EXISTS "
                "(SELECT 1 FROM messages m WHERE m.conversation_id = c.id "
                "AND m.content LIKE ?1 ESCAPE '\\') ORDER BY updated DESC, id DESC",
                (pattern,),
            )
        return [_conversation(r) for r in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        self._update(conversation_id, "title", title)

    def set_settings(self, conversation_id: int, settings: dict[str, Any]) -> None:
        self._update(conversation_id, "settings", json.dumps(settings))

    def set_model(self, conversation_id: int, model: str | None) -> None:
        self._update(conversation_id, "model", model)

    def delete(self, conversation_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _update(self, conversation_id: int, column: str, value: Any) -> None:
        self.db.execute(
            f"UPDATE conversations SET {column} = ?, updated = ? WHERE id = ?",
            (value, time.time(), conversation_id),
        )

    # -- messages ----------------------------------------------------------------------------

    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        *,
        finish_reason: str | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        reasoning: str | None = None,
    ) -> StoredMessage:
        now = time.time()
        with self.db:  # one transaction: the message and the conversation's timestamp
            self.db.execute("BEGIN")
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, role, content, created, finish_reason, "
                "prompt_tokens, completion_tokens, reasoning) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    conversation_id,
                    role,
                    content,
                    now,
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                    reasoning,
                ),
            )
            self.db.execute(
                "UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id)
            )
        return StoredMessage(
            cur.lastrowid,
            conversation_id,
            role,
            content,
            now,
            finish_reason,
            prompt_tokens,
            completion_tokens,
            reasoning,
        )

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self.db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        )
        return [StoredMessage(**dict(r)) for r in rows]

    def delete_from(self, conversation_id: int, message_id: int) -> int:
        """Delete `message_id` and every later message of the conversation (regenerate, edit)."""
        cur = self.db.execute(
            "DELETE FROM messages WHERE conversation_id = ? AND id >= ?",
            (conversation_id, message_id),
        )
        return cur.rowcount

    # -- export ------------------------------------------------------------------------------

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.conversation(conversation_id)
        parts = [f"# {conv.title}\n"]
        system = conv.settings.get("system_prompt")
        if system:
            parts.append(f"**System:** {system}\n")
        for m in self.messages(conversation_id):
            note = " _(stopped)_" if m.finish_reason == "abort" else ""
            think = ""
            if m.reasoning:  # folded, as GitHub and most viewers render <details>
                think = f"<details><summary>Reasoning</summary>\n\n{m.reasoning}\n\n</details>\n\n"
            parts.append(f"## {m.role.capitalize()}{note}\n\n{think}{m.content}\n")
        return "\n".join(parts)


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(
        row["id"],
        row["title"],
        row["created"],
        row["updated"],
        row["model"],
        json.loads(row["settings"] or "{}"),
    )


def slug(title: str) -> str:
    """A file-name-safe form of a title, for exports."""
    s = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()
    return s[:60] or "conversation"


def conversation_title(text: str, limit: int = TITLE_CHARS) -> str:
    """A new conversation's title from its first message: one line, at most `limit` characters,
    cut at a word where one is near the end and then marked with an ellipsis."""
    line = " ".join(text.split())
    if len(line) <= limit:
        return line
    cut = line[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:  # a word boundary not too far back
        cut = cut[:space]
    return cut.rstrip() + "…"
