"""TUI screens: one module per screen, its .tcss beside it."""
