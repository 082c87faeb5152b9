"""Text to speech: Piper (VITS) and Kokoro voices, phonemization, streaming synthesis."""
