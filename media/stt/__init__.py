"""Speech to text (Whisper family): weights loaders, model, decoding."""
