"""The SQLite history store alone: schema, WAL, ordering, search, truncation, export, and that a
process killed mid-answer loses no committed message."""

import os
import sqlite3
import subprocess
import sys
import textwrap

from localllm.app.tui.history import HistoryStore, history_path, slug


def test_history_path_follows_xdg(tmp_path):
    assert history_path({"XDG_DATA_HOME": str(tmp_path)}) == (
        tmp_path / "localllm" / "history.sqlite3"
    )
    home = history_path({"HOME": "/x"})
    assert home.parts[-4:] == (".local", "share", "localllm", "history.sqlite3")


def test_wal_mode_and_messages_round_trip(tmp_path):
    path = tmp_path / "sub" / "h.sqlite3"
    store = HistoryStore(path)
    assert store.journal_mode == "wal"
    conv = store.new_conversation("Greeting", {"temperature": 0.3}, model="m")
    store.add_message(conv.id, "user", "hi")
    store.add_message(
        conv.id, "assistant", "hello", finish_reason="stop", prompt_tokens=5, completion_tokens=2
    )
    store.close()
    # A separate plain connection sees WAL mode persisted in the file and both rows.
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    rows = db.execute("SELECT role, content, finish_reason, completion_tokens FROM messages")
    assert rows.fetchall() == [("user", "hi", None, None), ("assistant", "hello", "stop", 2)]
    again = HistoryStore(path)
    (c,) = again.conversations()
    assert (c.title, c.settings, c.model) == ("Greeting", {"temperature": 0.3}, "m")


def test_search_rename_delete_truncate(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    a = store.new_conversation("Pasta recipes")
    b = store.new_conversation("Rust lifetimes")
    store.add_message(a.id, "user", "how long to boil 100%_durum spaghetti?")
    m2 = store.add_message(b.id, "user", "explain borrowck")
    store.add_message(b.id, "assistant", "the borrow checker...")
    store.add_message(b.id, "user", "more")
    assert [c.id for c in store.conversations()] == [b.id, a.id]  # most recently updated first
    assert [c.id for c in store.conversations("PASTA")] == [a.id]  # title, case-insensitive
    assert [c.id for c in store.conversations("borrow")] == [b.id]  # message text
    assert [c.id for c in store.conversations("100%_d")] == [a.id]  # wildcards are literal
    assert store.conversations("100%%") == []
    store.rename(a.id, "Italian")
    assert store.conversation(a.id).title == "Italian"
    assert store.delete_from(b.id, m2.id) == 3
    assert store.messages(b.id) == []
    store.delete(a.id)
    assert [c.id for c in store.conversations()] == [b.id]
    assert store.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0  # cascaded


def test_export_markdown(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    conv = store.new_conversation("Demo chat", {"system_prompt": "Be terse."})
    store.add_message(conv.id, "user", "2+2?")
    store.add_message(conv.id, "assistant", "4", finish_reason="abort")
    assert store.export_markdown(conv.id) == (
        "# Demo chat\n\n**System:** Be terse.\n\n## User\n\n2+2?\n\n## Assistant _(stopped)_\n\n4\n"
    )
    assert slug("Demo chat: C++ / Rust?") == "demo-chat-c-rust"


def test_killed_writer_loses_no_committed_message(tmp_path):
    path = tmp_path / "h.sqlite3"
    script = textwrap.dedent(
        f"""
        import os, sys
        from localllm.app.tui.history import HistoryStore
        store = HistoryStore({str(path)!r})
        conv = store.new_conversation("t")
        store.add_message(conv.id, "user", "q1")
        store.add_message(conv.id, "assistant", "a1", finish_reason="stop")
        store.add_message(conv.id, "user", "q2")
        # Mid-answer: an uncommitted write is in flight when the process dies.
        store.db.execute("BEGIN")
        store.db.execute(
            "INSERT INTO messages (conversation_id, role, content, created) "
            "VALUES (?, 'assistant', 'partial', 0)", (conv.id,))
        sys.stdout.flush()
        os._exit(9)
        """
    )
    env = dict(os.environ, PYTHONSAFEPATH="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=120)
    assert proc.returncode == 9
    store = HistoryStore(path)
    (conv,) = store.conversations()
    assert [(m.role, m.content) for m in store.messages(conv.id)] == [
        ("user", "q1"),
        ("assistant", "a1"),
        ("user", "q2"),
    ]


def test_a_history_file_from_before_reasoning_gains_the_column(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)  # the schema as it was before reasoning was kept
    db.executescript(
        """
        CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL,
            created REAL NOT NULL, updated REAL NOT NULL, model TEXT,
            settings TEXT NOT NULL DEFAULT '{}');
        CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL
            REFERENCES conversations(id) ON DELETE CASCADE, role TEXT NOT NULL,
            content TEXT NOT NULL, created REAL NOT NULL, finish_reason TEXT,
            prompt_tokens INTEGER, completion_tokens INTEGER);
        INSERT INTO conversations VALUES (1, 'Old', 0, 0, NULL, '{}');
        INSERT INTO messages VALUES (1, 1, 'user', 'hi', 0, NULL, NULL, NULL);
        """
    )
    db.commit()
    db.close()
    store = HistoryStore(path)
    (old,) = store.messages(1)
    assert (old.content, old.reasoning) == ("hi", None)
    store.add_message(1, "assistant", "hello", reasoning="greet back")
    store.close()
    assert HistoryStore(path).messages(1)[1].reasoning == "greet back"


def test_export_keeps_the_reasoning_folded(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    conv = store.new_conversation("Think")
    store.add_message(conv.id, "user", "2+2?")
    store.add_message(conv.id, "assistant", "4", reasoning="Two and two.")
    assert store.export_markdown(conv.id) == (
        "# Think\n\n## User\n\n2+2?\n\n## Assistant\n\n"
        "<details><summary>Reasoning</summary>\n\nTwo and two.\n\n</details>\n\n4\n"
    )
