"""TUI widgets shared by screens."""
