"""The Textual TUI: the app shell, its screens and widgets, and the chat history store."""
